"""A loss and a drafter declare their kind once, in `compiled_loss/config/` (`LossKind`,
`DraftKind`): no module outside it compares a loss family or name, or a drafter's name,
against a string literal — the application, the store and the audit read the kind's
attributes."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "compiled_loss"
CONFIG = PACKAGE / "config"
CONF = PACKAGE.parent / "conf"  # the Hydra YAML (shipped as `compiled_loss.conf`)

# what holds a loss family / name or a drafter's name: a variable of that name, `<x>.loss.name`,
# `<x>.draft.name`, a plain config's `["draft.name"]`
_SUBJECTS = {"family", "kind", "loss", "draft", "loss.name", "draft.name", "loss_name", "draft_name"}


def _known_names() -> set[str]:
    """Every loss family (`Family`), `loss` option and `draft` option name."""
    names = {p.stem for group in ("loss", "draft") for p in (CONF / group).glob("*.yaml")}
    for node in ast.walk(ast.parse((CONFIG / "losses.py").read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "Family" for t in node.targets):
            names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def _subject(node: ast.expr) -> str | None:
    """What `node` names: a variable's name, an attribute's (`<x>.loss.name` -> `loss.name`), a
    subscript's string key, `loss_family(...)`'s family."""
    if isinstance(node, ast.Call):
        return "family" if _subject(node.func) == "loss_family" else None
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        if node.attr == "name":
            inner = _subject(node.value)
            return f"{inner}.name" if inner else None
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def _literals(node: ast.expr) -> set[str]:
    """The string literals of `node`: itself, or the items of a literal tuple / list / set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def kind_switches(source: str, known: set[str]) -> list[tuple[int, str]]:
    """`(line, source)` of each comparison (`==`, `!=`, `in`, `not in`) of a loss family /
    name or drafter name (`_SUBJECTS`) against a string literal that names one (`known`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        subjects = {_subject(o) for o in operands} & _SUBJECTS
        if subjects and any(_literals(o) & known for o in operands):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_string_switch_on_a_loss_or_drafter_kind_outside_config():
    known = _known_names()
    assert {"clipped_pg", "grpo", "mse_value", "policy_gradient", "value", "none", "eagle3", "dflash"} <= known
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if CONFIG not in path.parents
        for line, text in kind_switches(path.read_text(), known)
    ]
    assert found == []


def test_the_switch_check_sees_the_forms_of_a_switch():
    known = {"dpo", "value", "eagle3", "none", "mpo", "distillation"}
    source = "\n".join(
        [
            "a = family == 'dpo'",  # 1: flagged
            "b = cfg.loss.name != 'mpo'",  # 2: flagged
            "c = family in ('distillation', 'opd')",  # 3: flagged
            "d = new['draft.name'] == 'eagle3'",  # 4: flagged
            "e = self.reduction == 'none'",  # 5: no loss or drafter
            "f = kind == 'int'",  # 6: no loss or drafter name
            "g = __name__ == '__main__'",  # 7
            "h = kind.value_head",  # 8: an attribute of the kind
            "i = draft is None",  # 9
            "j = config.loss_family(cfg.loss) == 'value'",  # 10: flagged
        ]
    )
    assert [line for line, _ in kind_switches(source, known)] == [1, 2, 3, 4, 10]
