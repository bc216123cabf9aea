"""Every ```python block of README.md and of each docs/*.md page runs as written: each in a fresh
Python process, in an empty directory, on the CPU, and exits 0. A block's test id is the page's
stem, the block's number on its page and the heading it sits under (`readme-2-…`,
`library-4-verl-and-torchtitan`). A block that imports the `[hf]` extra's packages or verl is
skipped only where they are missing (CI installs the `[hf]` extra in its main venv, and runs
the verl blocks, whose ids say verl, in its verl venv)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTIONAL = {  # a block that imports one of these where it is missing is skipped, naming the install
    **dict.fromkeys(("transformers", "trl", "datasets", "tokenizers"), "pip install 'compiled_loss[hf]'"),
    "verl": "pip install 'compiled_loss[verl]' and pip install --no-deps verl==0.9.1",
}
TIMEOUT_S = 300


def _blocks(page: Path) -> list[tuple[str, str]]:
    """`(id, code)` of each Python block of `page`: the page's stem, the block's number on the
    page and the heading it sits under."""
    blocks, heading, fence, lines = [], "top", None, []
    for line in page.read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line == "```":
            if fence == "python":
                blocks.append((f"{page.stem.lower()}-{len(blocks) + 1}-{heading}", "\n".join(lines) + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").lower()).strip("-")
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def _imported(code: str) -> set[str]:
    """The top-level packages a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_readme_and_the_docs_have_python_blocks_that_parse():
    stems = {page.stem for page in PAGES}
    assert {"index", "library", "runner", "fused_head", "deviations"} <= stems, f"docs/ pages missing: {stems}"
    assert len(_blocks(ROOT / "README.md")) >= 5
    assert len(_blocks(ROOT / "docs" / "library.md")) >= 5
    names = [name for name, _ in BLOCKS]
    assert len(set(names)) == len(names), "two blocks with one test id"
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
