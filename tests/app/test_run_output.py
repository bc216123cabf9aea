"""What a run shows and writes: its output goes through `logging` (Hydra writes it to the
run directory's `run.log`), a line of metrics with the step time and the time left every
`run.log_every` steps (plain lines when stderr is no terminal, a tqdm bar below them on
one), a "compiling …" line before a step that compiles and its compile time after it; the
metric loggers of `run.loggers` (`metrics.jsonl`, a TensorBoard event file, a W&B run);
`run.steps` optimizer steps in all, the warm start's included."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import types

import pytest
from common import TINY_TASK
from tolerances import F32, approx

from compiled_loss.app import compose_config
from compiled_loss.app.curves import read_metrics
from compiled_loss.app.loggers import Progress, WandbLogger, pace, scalars, step_line
from compiled_loss.app.loop import train

RECORD = {
    "step": 7,
    "phase": "clipped_pg",
    "loss": -0.0687,
    "kl_penalty": 0.00123456,
    "reward": 0.5,
    "tokens_per_s": 9210.4,
    "compiles": 4,
    "flag": True,
    "none": None,
}


def test_the_step_time_is_the_mean_of_the_latest_steps_that_compiled_nothing():
    assert pace([], 10) == "? s/step, ? left"
    assert pace([0.5, 0.25], 100) == "0.375 s/step, 00:37 left"
    assert pace([100.0] + [2.0] * 20, 1800) == "2 s/step, 1:00:00 left"  # the latest 20 only


def test_a_step_line_names_the_step_of_the_run_its_phase_and_its_metrics():
    assert step_line(RECORD, 177, ("kl_penalty", "probs_ratio")) == (
        "step 7/177 clipped_pg loss -0.0687 kl_penalty 0.001235 reward 0.500 | 9210 tok/s | compiles 4"
    )


def test_tensorboard_and_wandb_get_the_numbers_of_a_record():
    assert scalars(RECORD) == {
        "clipped_pg/loss": -0.0687,
        "clipped_pg/kl_penalty": 0.00123456,
        "clipped_pg/reward": 0.5,
        "clipped_pg/tokens_per_s": 9210.4,
        "clipped_pg/compiles": 4.0,
    }


def _steps(progress: Progress, total: int) -> None:
    with progress:
        for i in range(1, total + 1):
            record = {**RECORD, "step": i}
            progress.step(record, step_line(record, total, ()), seconds=0.5, compiled=i == 1)


def test_without_a_terminal_the_progress_is_plain_log_lines_every_log_every_steps(caplog, capsys):
    caplog.set_level(logging.INFO)
    _steps(Progress(total=5, done=0, every=2, bar=False), 5)
    line = "clipped_pg loss -0.0687 reward 0.500 | 9210 tok/s | compiles 4"
    assert caplog.messages == [
        f"step 2/5 {line} | 0.5 s/step, 00:01 left",
        f"step 4/5 {line} | 0.5 s/step, 00:00 left",
        f"step 5/5 {line} | 0.5 s/step, 00:00 left",
    ]
    assert capsys.readouterr() == ("", "")  # no bar, no carriage return


def test_on_a_terminal_a_tqdm_bar_shows_the_step_time_and_the_time_left(caplog, capsys):
    caplog.set_level(logging.INFO)
    _steps(Progress(total=3, done=0, every=3, bar=True), 3)
    bar = capsys.readouterr().err.split("\r")[-1]
    assert re.fullmatch(
        r"100%\|[█#]+\| 3/3 \[00:0\d, 0\.5 s/step, 00:00 left, clipped_pg loss -0\.0687 reward 0\.500\]\n", bar
    ), bar
    assert caplog.messages == [
        "step 3/3 clipped_pg loss -0.0687 reward 0.500 | 9210 tok/s | compiles 4 | 0.5 s/step, 00:00 left"
    ]


class _FakeWandb(types.ModuleType):
    """What `WandbLogger` calls of the `wandb` package, recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, metrics, step):
        self.calls.append(("log", metrics, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.mark.parametrize(("mode", "expected"), [(None, "offline"), ("online", "online")])
def test_wandb_runs_offline_unless_wandb_mode_says_otherwise(mode, expected, monkeypatch, tmp_path):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    if mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    logger = WandbLogger(compose_config("run.steps=30"), tmp_path)
    logger.log(7, RECORD)
    logger.close()
    (_, init), log, finish = fake.calls
    assert (init["mode"], init["project"], init["dir"]) == (expected, "compiled_loss", str(tmp_path))
    assert (init["config"]["run"]["steps"], init["config"]["output_dir"]) == (30, str(tmp_path))
    assert (log, finish) == (("log", scalars(RECORD), 7), ("finish",))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.slow
def test_a_run_whose_stderr_is_a_terminal_draws_the_bar(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    train(compose_config(*TINY_TASK, "compile.enabled=false", "run.steps=3", "run.sft_steps=1"), tmp_path)
    bars = [bar for bar in terminal.getvalue().split("\r") if bar]  # tqdm redraws at most every 0.1 s
    assert bars[0].startswith("  0%|") and " 0/3 [" in bars[0], bars
    assert re.fullmatch(
        r"100%\|[█#]+\| 3/3 \[\d\d:\d\d, \S+ s/step, 00:00 left, clipped_pg loss \S+ reward \S+\]\n", bars[-1]
    )


@pytest.mark.slow
def test_a_run_with_tensorboard_writes_the_scalars_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [
        *TINY_TASK,
        "compile.enabled=false",
        "run.steps=3",
        "run.sft_steps=1",
        "run.loggers=[jsonl,tensorboard]",
    ]
    train(compose_config(*overrides), tmp_path)
    [events] = tmp_path.glob("events.out.tfevents.*")
    written = EventAccumulator(str(events)).Reload()
    records = read_metrics(tmp_path)
    assert set(written.Tags()["scalars"]) == set().union(*(scalars(r) for r in records))
    for phase in ("sft", "clipped_pg"):  # each phase's curves apart (the warm start is "sft")
        ran = [r for r in records if r["phase"] == phase]
        for key in ("loss", "reward", "grad_norm", "tokens_per_s"):
            assert [(e.step, e.value) for e in written.Scalars(f"{phase}/{key}")] == [
                (r["step"], approx(r[key], F32, "logged")) for r in ran
            ], key


@pytest.mark.slow
def test_a_run_logs_to_run_log_plain_lines_and_its_compiles_and_trains_run_steps_steps(tmp_path):
    """`python -m compiled_loss.run … run.steps=3 run.sft_steps=1` without a terminal: 3
    optimizer steps (1 of the warm start, 2 of the loss), every line also in run.log, no
    carriage return, the compiling steps announced and timed."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "compiled_loss.run",
            *TINY_TASK,
            "compile.backend=eager",
            "run.steps=3",
            "run.sft_steps=1",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [(r["step"], r["phase"]) for r in read_metrics(tmp_path)] == [
        (1, "sft"),
        (2, "clipped_pg"),
        (3, "clipped_pg"),
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["sft_steps"]) == (3, 1)
    assert "\r" not in done.stdout + done.stderr
    messages = [line.split("] - ", 1)[1] for line in (tmp_path / "run.log").read_text().splitlines() if "] - " in line]
    assert messages == [line.split("] - ", 1)[1] for line in done.stdout.splitlines() if "] - " in line]
    assert messages[0] == (
        f"run.steps=3: the warm start (NLL, run.sft_steps=1) at step 1, loss=clipped_pg at steps 2-3; output in {tmp_path}"
    )
    announced = [m for m in messages if m.endswith("…")]
    assert announced == [
        "step 1: compiling the sampler and the warm start's training step (loss=nll) (compile.backend=eager) …",
        "step 2: compiling the training step of loss=clipped_pg (compile.backend=eager) …",
    ]
    timed = [m for m in messages if re.fullmatch(r"step \d+: \d+\.\d s, \d+\.\d s of it compiling", m)]
    lines = [m for m in messages if re.match(r"step \d/3 ", m)]
    assert [m.split(":")[0] for m in timed][:2] == ["step 1", "step 2"]  # a later step may compile a new bucket
    assert [m.split()[1] for m in lines] == ["1/3", "2/3", "3/3"]
    for step in (1, 2):  # announced, then timed, then its line
        where = [messages.index(m) for m in (announced[step - 1], timed[step - 1], lines[step - 1])]
        assert where == sorted(where), messages
    assert re.fullmatch(
        r"step 1/3 sft loss \S+ reward \S+ \| \d+ tok/s \| compiles \d+ \| \? s/step, \? left", lines[0]
    )
    assert lines[1].startswith("step 2/3 clipped_pg loss ") and lines[2].startswith("step 3/3 clipped_pg loss ")
    assert re.search(r"\| \S+ s/step, 00:00 left$", lines[2]), lines[2]
    assert messages[-1] == f"curves: {tmp_path / 'curves.png'}" or messages[-1].startswith("curves.png skipped")
