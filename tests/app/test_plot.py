"""Curves: the runner writes `curves.png` beside `metrics.jsonl` (one clear line instead
when matplotlib is missing), and `python -m compiled_loss.plot` overlays the runs of a
`-m` sweep, each labelled by the overrides that set it apart; it plots a run still
writing its last line without that line, and stops at a damaged line naming the file and
the line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from common import TINY_TASK

from compiled_loss.app.curves import read_metrics
from compiled_loss.plot import labels, main, run_dirs

pytest.importorskip("matplotlib", reason="the curves need matplotlib (pip install -e '.[plot]'; CI installs it)")

SMALL = [*TINY_TASK, "compile.enabled=false", "run.sft_steps=2", "run.steps=5"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_sweep_writes_curves_and_the_plot_command_overlays_them(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "compiled_loss.run",
            "-m",
            "loss=clipped_pg,dpo",
            *SMALL,
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    runs = run_dirs([tmp_path / "sweep"])
    assert [r.name for r in runs] == ["0", "1"]
    for run in runs:
        assert (run / "curves.png").read_bytes().startswith(PNG)
    assert labels(runs) == ["loss=clipped_pg", "loss=dpo"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "compiled_loss.plot",
            str(tmp_path / "sweep"),
            str(runs[0]),
            "--out",
            str(tmp_path / "overlay.png"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip() == f"3 run(s) -> {tmp_path / 'overlay.png'}"
    overlay = (tmp_path / "overlay.png").read_bytes()
    assert overlay.startswith(PNG) and len(overlay) > 50_000


@pytest.mark.slow
def test_without_matplotlib_the_runner_skips_the_png_with_one_line(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None; from compiled_loss.app.run import main; "
        f"sys.argv = ['run', *{SMALL!r}, 'hydra.run.dir={tmp_path}']; main()"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert (
        done.stdout.strip()
        .splitlines()[-1]
        .endswith("] - curves.png skipped: matplotlib is not installed (pip install 'compiled_loss[plot]')")
    )
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "curves.png").exists()


def test_a_directory_without_runs_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "compiled_loss.plot", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and f"{tmp_path}: no metrics.jsonl in it or in its subdirectories" in done.stderr


RECORDS = [
    {"step": 1, "phase": "sft", "loss": 3.5, "reward": 0.1, "tokens_per_s": 900.0},
    {"step": 2, "phase": "clipped_pg", "loss": 0.2, "reward": None, "tokens_per_s": 950.0},  # null: non-finite
    {"step": 3, "phase": "clipped_pg", "loss": 0.1, "reward": 0.4, "tokens_per_s": 990.0},
]


def _run_dir(tmp_path, tail: bytes):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS) + tail)
    return run


def test_a_run_still_writing_its_last_line_plots_without_it(tmp_path, capsys):
    """A user plots a run in progress: its last line may be half written; the complete lines
    are plotted (null values as gaps) and one line on stderr says what was left out."""
    run = _run_dir(tmp_path, b'{"step": 4, "phase": "clipped_pg", "lo')
    assert main([str(run), "--out", str(tmp_path / "curves.png")]) == 0
    out, err = capsys.readouterr()
    assert out == f"1 run(s) -> {tmp_path / 'curves.png'}\n"
    assert err == (
        f"{run / 'metrics.jsonl'}:4: skipped the incomplete last line (a run still writing it, or a file cut short)\n"
    )
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)
    assert read_metrics(run) == RECORDS


@pytest.mark.parametrize(
    ("tail", "why"),
    [
        (b'{"step": 4, "lo\n{"step": 5}\n', "4: not a JSON line (column 13: Unterminated string starting at)"),
        (b"\xff\xfe\x00garbage\n", "4: not a JSON line (column 1: Expecting value)"),
        (b'{"step": 4, "loss": NaN\n', "4: not a JSON line (column 24: Expecting ',' delimiter)"),
        (b"[4, 0.5]\n", "4: not a metrics record (a JSON object with an integer 'step')"),
        (b'{"loss": 0.5}', "4: not a metrics record (a JSON object with an integer 'step')"),
    ],
    ids=["cut-mid-file", "garbage", "cut-complete-line", "not-an-object", "no-step"],
)
def test_a_damaged_line_stops_the_plot_naming_the_file_and_the_line(tail, why, tmp_path):
    run = _run_dir(tmp_path, tail)
    with pytest.raises(SystemExit) as e:
        main([str(run), "--out", str(tmp_path / "curves.png")])
    assert str(e.value) == f"{run / 'metrics.jsonl'}:{why}"
    assert not (tmp_path / "curves.png").exists()
