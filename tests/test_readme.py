"""Every ```python block of README.md runs as written: each in a fresh Python process, in an
empty directory, on the CPU, and exits 0. A block that imports the `[hf]` extra's packages
or verl is skipped only where they are missing (CI installs the `[hf]` extra in its main
venv, and runs the verl blocks in its verl venv)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
OPTIONAL = {  # a block that imports one of these where it is missing is skipped, naming the install
    **dict.fromkeys(("transformers", "trl", "datasets", "tokenizers"), "pip install 'compiled_loss[hf]'"),
    "verl": "pip install 'compiled_loss[verl]' and pip install --no-deps verl==0.9.1",
}
TIMEOUT_S = 300


def _blocks() -> list[tuple[str, str]]:
    """`(id, code)` of each Python block: its number and the heading it sits under."""
    blocks, heading, fence, lines = [], "top", None, []
    for line in README.read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line == "```":
            if fence == "python":
                blocks.append((f"{len(blocks) + 1}-{heading}", "\n".join(lines) + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").lower()).strip("-")
    return blocks


BLOCKS = _blocks()


def _imported(code: str) -> set[str]:
    """The top-level packages a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_readme_has_python_blocks_that_parse():
    assert len(BLOCKS) >= 5
    for name, code in BLOCKS:
        ast.parse(code, filename=name)


@pytest.mark.slow  # the blocks compile (Inductor) and train
@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_the_block_runs_as_written(code, tmp_path):
    missing = sorted(m for m in _imported(code) if importlib.util.find_spec(m) is None)
    if missing and set(missing) <= set(OPTIONAL):
        pytest.skip(f"needs {', '.join(missing)}: {'; '.join(sorted({OPTIONAL[m] for m in missing}))}")
    (tmp_path / "block.py").write_text(code)
    proc = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-4000:]}"
