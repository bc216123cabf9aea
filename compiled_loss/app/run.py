"""`python -m compiled_loss.run [overrides]`: the embedded training loop from a Hydra config.

The embedded default warm-starts the tiny LM with NLL on correct responses, then trains it
with GRPO on its own samples of the synthetic progression task, with fused packing,
compiled by Inductor. Every choice is an override, e.g.
`python -m compiled_loss.run loss=dpo packing=none compile.backend=aot_eager run.steps=5 run.sft_steps=0`;
`-m` sweeps: `python -m compiled_loss.run -m loss=clipped_pg,dpo packing=none,fused` (the jobs run one
after the other in this process, each from a clean Dynamo state).
Writes into Hydra's run directory: `run.log` (everything the run logs), the files of
`run.loggers` (`metrics.jsonl`, one line per step, by default), `summary.json` and
`curves.png` (from `metrics.jsonl`, with matplotlib).
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from compiled_loss.app.cli import fail
from compiled_loss.app.curves import plot_runs, read_metrics
from compiled_loss.app.loop import train
from compiled_loss.app.store import load_config

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="pkg://compiled_loss.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        config = load_config(cfg)  # every config error surfaces here, before a model is built
    except ValueError as e:  # ConfigError included: one line, exit status 2
        fail(e)
    # The jobs of a sweep share this process: without a reset, each job's compiled variants of the
    # same functions add up until Dynamo's recompile limit, a hard failure under fullgraph=True.
    torch._dynamo.reset()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = train(config, output_dir)
    if summary["parallel"]["rank"] != 0:
        return
    if "jsonl" not in config.run.loggers:
        log.info("curves.png skipped: it is drawn from metrics.jsonl, which run.loggers leaves out")
        return
    try:
        log.info(f"curves: {plot_runs([(output_dir.name, read_metrics(output_dir))], output_dir / 'curves.png')}")
    except ImportError:
        log.info("curves.png skipped: matplotlib is not installed (pip install 'compiled_loss[plot]')")
