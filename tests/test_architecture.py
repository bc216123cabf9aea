"""The package's rooms by layer: each module imports only rooms of its own layer or below,
no module of the package or of `tools/` reaches itself through its imports, and the library
(everything below the Hydra application) imports without Hydra."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "compiled_loss"
TOOLS = PACKAGE.parent / "tools"

# Layers, lowest first. A module may import its own layer and the layers before it.
LAYERS = [
    {"interfaces", "metrics", "checks", "compile", "edge"},
    {"parallel"},
    {"vocab"},
    {"packing"},
    {"losses"},
    {"inputs"},
    {"draft"},
    {
        "nemo_rl",
        "wrapper",
        "utils",
        "loss_functions",
        "loss_input",
    },  # NeMo-RL's calling convention (old names: re-exports)
    {"integrations"},  # Liger / TRL front-ends (trl imported only by integrations.trl)
    {"config"},
    {"train"},  # the compiled step: usable with any model, without the demo or Hydra
    {"demo"},  # the embedded model (or a transformers one), task data and teachers the app trains on
    {"app", "run", "plot", "conf"},  # the application: run loop, rollouts, checkpoints, Hydra
    {"audit"},
]

# What each room of the application side holds (a new module there is a decision, not a drift).
DEMO = {"__init__", "model", "hf", "data", "cross_tokenizer"}


def _layer(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def _imported_rooms(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "compiled_loss"]
        rooms |= {n.split(".")[1] for n in names if n.startswith("compiled_loss.")}
    return rooms


def test_imports_point_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        room = rel.parts[0].removesuffix(".py")
        if room == "__init__":
            continue
        for imported in _imported_rooms(path):
            if _layer(imported) > _layer(room):
                upward.append(f"{rel} imports compiled_loss.{imported}")
    assert upward == []


def _modules() -> dict[str, Path]:
    """Every module of the package (`compiled_loss.…`) and of `tools/` (by the name a tool
    imports it under: `tools/` is on the path of a tool run as a script)."""
    found = {}
    for root, prefix in ((PACKAGE, ["compiled_loss"]), (TOOLS, [])):
        for path in root.rglob("*.py"):
            parts = prefix + list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports anywhere: at the top, in a function or
    under `TYPE_CHECKING` (`from a import b` is module `a.b` where that is one, else `a`)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` above this module's
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {
                    known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base) for a in node.names
                }
        graph[name] = targets - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_package_or_the_tools():
    assert _cycles(_import_graph(_modules())) == []


def test_the_cycle_check_sees_function_local_and_type_checking_imports(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.b import g\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from pkg import a\n",
    }
    modules = {}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
        modules[name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = tmp_path / name
    graph = _import_graph(modules)
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.c"}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_every_room_has_a_layer():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*.py")}
    rooms |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(r for r in rooms - {"__init__"} if not any(r in layer for layer in LAYERS)) == []


def test_edge_names_resolve_where_they_were_exported():
    """The seed-signature names `inputs`, `packing`, `vocab` and `losses` export while their
    code lives in the edge room (`compiled_loss.edge`): each is the edge's own object."""
    for package in ("inputs", "packing", "vocab", "losses"):
        module = importlib.import_module(f"compiled_loss.{package}")
        for name, edge in module._EDGE.items():
            assert name in module.__all__
            assert getattr(module, name) is getattr(importlib.import_module(f"compiled_loss.nemo_rl.{edge}"), name)
    with pytest.raises(AttributeError, match="module 'compiled_loss.vocab' has no attribute 'nothing'"):
        importlib.import_module("compiled_loss.vocab").nothing


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages the wheel holds: every package of the source tree."""
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"compiled_loss." + ".".join(p.parent.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("__init__.py")}
    assert sorted({name.rstrip(".") for name in found} - listed) == []


def test_the_demo_room_holds_models_and_data_only():
    """The run loop, rollouts, sampler, checkpoints and curves are the app's (`compiled_loss.app`)."""
    assert {p.stem for p in (PACKAGE / "demo").glob("*.py")} == DEMO


@pytest.mark.slow
def test_library_imports_without_hydra():
    code = (
        "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None\n"
        "import compiled_loss.wrapper, compiled_loss.utils, compiled_loss.loss_functions, compiled_loss.loss_input\n"
        "import compiled_loss.config, compiled_loss.train, compiled_loss.demo.data, compiled_loss.demo.cross_tokenizer\n"
        "sys.modules['trl'] = sys.modules['transformers'] = None; import compiled_loss.integrations\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
