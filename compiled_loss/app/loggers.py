"""Where a run's output goes: the metric loggers `run.loggers` names, and the progress.

A metric logger takes each step's record (`log(step, metrics)`) and is closed once
(`close()`): `jsonl` writes `metrics.jsonl` (JSON, non-finite values as null), `tensorboard`
an event file of scalars in the run directory (`torch.utils.tensorboard`), `wandb` a
Weights & Biases run (offline unless `WANDB_MODE` says otherwise). The progress (`Progress`)
logs a line of metrics every `run.log_every` steps with the step time and the time left,
through `logging` (Hydra writes it to the console and to the run directory's `run.log`); on
a terminal (stderr a TTY) a tqdm bar below the lines shows the same at every step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from compiled_loss.checks import ConfigError
from compiled_loss.config import Config

log = logging.getLogger(__name__)

# the loggers that need a package the runner does not install, each named as the package and its extra
_PACKAGED = ("tensorboard", "wandb")
PACE_STEPS = 20  # the step time is the mean over this many of the latest steps that compiled nothing


class MetricsLogger(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def finite(values: dict[str, Any], where: str, reported: set[str] | None) -> dict[str, Any]:
    """`values` with each non-finite float as None: `metrics.jsonl` and `summary.json` hold
    JSON, which has no NaN or infinity. The first time a key is non-finite, a warning names
    it and `where` (`reported`: the keys named so far; None: name none)."""
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            if reported is not None and key not in reported:
                reported.add(key)
                log.warning(
                    f"{where}: {key} is {value}, written as null (later non-finite {key} values are not reported)"
                )
    return out


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step's record (the step itself, its phase and any None left out),
    each named `<phase>/<key>` (`sft/loss`, `clipped_pg/loss`: the warm start's NLL and the
    loss's curves apart): what TensorBoard and W&B plot."""
    return {
        f"{metrics['phase']}/{key}": float(value)
        for key, value in metrics.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class JsonlLogger:
    """`metrics.jsonl`: one JSON object per step, written and flushed as the step ends."""

    def __init__(self, output_dir: Path, reported: set[str]) -> None:
        self.file = open(output_dir / "metrics.jsonl", "w")
        self.reported = reported  # shared with summary.json: each non-finite key is reported once

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = finite(metrics, f"metrics.jsonl step {step}", self.reported)
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """An event file in the run directory: one scalar per number of a step's record, named
    `<phase>/<key>` of `metrics.jsonl` (`tensorboard --logdir outputs` shows every run)."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in `<run dir>/wandb` with the run's config, offline unless
    `WANDB_MODE` says otherwise (`wandb sync` uploads an offline run); its project is
    `WANDB_PROJECT`, else compiled_loss."""

    def __init__(self, cfg: Config, output_dir: Path) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "compiled_loss"),
            dir=str(output_dir),
            config={**cfg.plain(), "output_dir": str(output_dir)},
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def check_installed(loggers: list[str]) -> None:
    """ConfigError, naming `run.loggers` and the extra to install, for a logger whose package
    this environment lacks."""
    for name in loggers:
        if name in _PACKAGED and importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"run.loggers=[{','.join(loggers)}]: the {name} logger needs the {name} package, which is not "
                f"installed: pip install 'compiled_loss[{name}]'"
            )


def open_loggers(cfg: Config, output_dir: Path, reported: set[str], stack: ExitStack) -> list[MetricsLogger]:
    """The metric loggers of `run.loggers`, each closed when `stack` closes."""
    check_installed(cfg.run.loggers)
    built = {
        "jsonl": lambda: JsonlLogger(output_dir, reported),
        "tensorboard": lambda: TensorBoardLogger(output_dir),
        "wandb": lambda: WandbLogger(cfg, output_dir),
    }
    loggers = []
    for name in cfg.run.loggers:
        logger = built[name]()
        stack.callback(logger.close)
        loggers.append(logger)
    return loggers


def pace(seconds: list[float], remaining: int) -> str:
    """`<s>/step, <time> left`: the mean of the latest `PACE_STEPS` step times (wall clock,
    steps that compiled left out: `seconds`) and the `remaining` steps at that pace."""
    if not seconds:
        return "? s/step, ? left"
    latest = seconds[-PACE_STEPS:]
    mean = sum(latest) / len(latest)
    return f"{mean:.3g} s/step, {tqdm.format_interval(mean * remaining)} left"


def step_line(record: dict[str, Any], total: int, shown: tuple[str, ...]) -> str:
    """A step's metrics as one line: its step of `total`, phase, loss, the `shown` metrics
    it has, reward, training tokens/s and the compiles so far."""
    extra = "".join(f" {key} {record[key]:.4g}" for key in shown if key in record)
    return (
        f"step {record['step']}/{total} {record['phase']} loss {record['loss']:.4f}{extra} reward "
        f"{record['reward']:.3f} | {record['tokens_per_s']:.0f} tok/s | compiles {record['compiles']}"
    )


class Progress:
    """A run's progress on rank 0 (a context manager): `step` logs a step's line every
    `every` steps and after the last, with the step time and the time left (`pace`); on a
    terminal a tqdm bar on stderr shows them at every step, and log lines print above it."""

    def __init__(self, total: int, done: int, every: int, bar: bool) -> None:
        self.total, self.every, self.bar_wanted, self.done = total, every, bar, done
        self.seconds: list[float] = []  # the wall time of each step of this process that compiled nothing
        self.stack = ExitStack()
        self.bar: tqdm | None = None

    def __enter__(self) -> Progress:
        if self.bar_wanted:
            self.bar = self.stack.enter_context(
                tqdm(
                    total=self.total,
                    initial=self.done,
                    unit="step",
                    file=sys.stderr,
                    dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
                )
            )
            self.stack.enter_context(logging_redirect_tqdm())
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def step(self, record: dict[str, Any], line: str, seconds: float, compiled: bool) -> None:
        """After step `record["step"]`, which took `seconds` (wall clock) and compiled (`compiled`) or not."""
        i = record["step"]
        if not compiled:
            self.seconds.append(seconds)
        timing = pace(self.seconds, self.total - i)
        if i % self.every == 0 or i == self.total:
            log.info("%s | %s", line, timing)
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{timing}, {record['phase']} loss {record['loss']:.4f} reward {record['reward']:.3f}", refresh=False
            )
            self.bar.update(1)
