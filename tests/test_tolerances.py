"""Tolerances are written in one place, `tests/tolerances.py`: an `atol=` / `rtol=` keyword (or a
`pytest.approx` `abs=` / `rel=`, or a default of a parameter so named) with a numeric literal anywhere
else in the suite fails here. Name the kind of comparison instead: `**close(dtype, kind)`,
`approx(want, dtype, kind)`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tolerances import TOLERANCES, approx, close

TESTS = Path(__file__).resolve().parent
HOME = TESTS / "tolerances.py"
KEYWORDS = {"atol", "rtol", "tol"}
APPROX_KEYWORDS = {"abs", "rel"}
# (file relative to tests/, keyword): why its literal stays
ALLOWED = {
    # a wall-clock speed-up printed to two decimals against the ratio of two printed timings: not a dtype's
    # rounding, so no kind of the table fits
    ("tools/test_bench.py", "rel"): "printed timings",
    ("tools/test_bench.py", "abs"): "printed timings",
}


def _has_number(node: ast.AST) -> bool:
    """A numeric literal, or arithmetic on one (`1e-6 * scale`, `1e-12 if ... else 1e-6`); not through a call."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _has_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _has_number(node.left) or _has_number(node.right)
    if isinstance(node, ast.IfExp):
        return _has_number(node.body) or _has_number(node.orelse)
    return False


def _is_approx(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "approx") or (isinstance(f, ast.Name) and f.id == "approx")


def _literal_tolerances(source: str, rel: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            names = KEYWORDS | (APPROX_KEYWORDS if _is_approx(node) else set())
            for kw in node.keywords:
                if kw.arg in names and _has_number(kw.value) and (rel, kw.arg) not in ALLOWED:
                    found.append(f"{rel}:{kw.value.lineno}: {kw.arg}={ast.unparse(kw.value)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in KEYWORDS and _has_number(default):
                    found.append(f"{rel}:{default.lineno}: default {arg.arg}={ast.unparse(default)}")
    return found


def test_no_literal_tolerance_outside_the_table():
    files = sorted(p for p in TESTS.rglob("*.py") if p != HOME)
    assert len(files) > 50
    found = [hit for p in files for hit in _literal_tolerances(p.read_text(), p.relative_to(TESTS).as_posix())]
    assert not found, "write tolerances in tests/tolerances.py and name the kind:\n" + "\n".join(found)


def test_the_check_sees_literals():
    source = (
        "import pytest, torch\n"
        "def f(a, b, rtol=1e-5):\n"
        "    torch.testing.assert_close(a, b, rtol=0, atol=-1e-6 * 2)\n"
        "    assert a == pytest.approx(b, rel=1e-3)\n"
        "    torch.testing.assert_close(a, b, **close(torch.float32, 'same'))\n"
        "    assert a == approx(b, torch.float32, 'same', abs=1)\n"
        "    torch.testing.assert_close(a, b, rtol=t['rtol'] * max(1.0, s), atol=1e-9 if s else t['atol'])\n"
    )
    hits = sorted(h.split(": ", 1)[1] for h in _literal_tolerances(source, "sample.py"))
    assert hits == [
        "abs=1",
        "atol=-1e-06 * 2",
        "atol=1e-09 if s else t['atol']",
        "default rtol=1e-05",
        "rel=0.001",
        "rtol=0",
    ]


def test_the_table():
    for dtype, kinds in TOLERANCES.items():
        assert {"exact", "same"} <= set(kinds), dtype
        assert kinds["exact"] == {"rtol": 0.0, "atol": 0.0}
        for kind, tol in kinds.items():
            assert set(tol) == {"rtol", "atol"} and all(v >= 0 for v in tol.values()), (dtype, kind)
    assert close(torch.float32, "reordered") == TOLERANCES[torch.float32]["reordered"]
    with pytest.raises(KeyError, match="kinds"):
        close(torch.float64, "fused")
    assert 1.0 + 1e-7 == approx(1.0, torch.float32, "same")
    assert 1.0 + 1e-4 != approx(1.0, torch.float32, "same")
