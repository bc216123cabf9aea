"""Curves: the runner writes `curves.png` beside `metrics.jsonl` (one clear line instead
when matplotlib is missing), and `python -m compiled_loss.plot` overlays the runs of a
`-m` sweep, each labelled by the overrides that set it apart."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compiled_loss.plot import labels, run_dirs

pytest.importorskip("matplotlib", reason="the curves need matplotlib (pip install -e '.[plot]'; CI installs it)")

SMALL = [
    "model.vocab_size=32", "model.hidden_size=32", "model.num_heads=2", "model.max_positions=64",
    "data.modulus=16", "data.prompt_terms_max=5", "data.response_max=12", "data.total_terms=10",
    "data.prompts=4", "data.group_size=4", "compile.enabled=false", "run.sft_steps=2", "run.steps=3",
]
PNG = b"\x89PNG\r\n\x1a\n"


def test_a_sweep_writes_curves_and_the_plot_command_overlays_them(tmp_path):
    subprocess.run([sys.executable, "-m", "compiled_loss.run", "-m", "loss=clipped_pg,dpo", *SMALL,
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], check=True, capture_output=True, cwd=tmp_path)
    runs = run_dirs([tmp_path / "sweep"])
    assert [r.name for r in runs] == ["0", "1"]
    for run in runs:
        assert (run / "curves.png").read_bytes().startswith(PNG)
    assert labels(runs) == ["loss=clipped_pg", "loss=dpo"]
    done = subprocess.run([sys.executable, "-m", "compiled_loss.plot", str(tmp_path / "sweep"), str(runs[0]),
                           "--out", str(tmp_path / "overlay.png")], check=True, capture_output=True, text=True)
    assert done.stdout.strip() == f"3 run(s) -> {tmp_path / 'overlay.png'}"
    overlay = (tmp_path / "overlay.png").read_bytes()
    assert overlay.startswith(PNG) and len(overlay) > 50_000


def test_without_matplotlib_the_runner_skips_the_png_with_one_line(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from compiled_loss.app.run import main; "
            f"sys.argv = ['run', *{SMALL!r}, 'hydra.run.dir={tmp_path}']; main()")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert done.stdout.strip().splitlines()[-1] == (
        "curves.png skipped: matplotlib is not installed (pip install 'compiled_loss[plot]')")
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "curves.png").exists()


def test_a_directory_without_runs_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "compiled_loss.plot", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and f"{tmp_path}: no metrics.jsonl in it or in its subdirectories" in done.stderr
