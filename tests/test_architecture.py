"""The package's rooms by layer: each module imports only rooms of its own layer or below,
and the library (everything below the Hydra application) imports without Hydra."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "compiled_loss"

# Layers, lowest first. A module may import its own layer and the layers before it.
LAYERS = [
    {"interfaces", "metrics", "checks", "compile"},
    {"parallel"},
    {"vocab"},
    {"packing"},
    {"losses"},
    {"inputs"},
    {"draft"},
    {"wrapper", "utils", "loss_functions", "loss_input"},  # the seed facades
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


def test_every_room_has_a_layer():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*.py")}
    rooms |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(r for r in rooms - {"__init__"} if not any(r in layer for layer in LAYERS)) == []


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
