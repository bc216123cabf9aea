"""`python tools/bench.py parallel`: the runner's training at parallel layouts, side by side.

Each layout runs `python -m compiled_loss.run` under `torchrun` (gloo on CPU, NCCL on CUDA)
for `--steps` loss steps (no warm start) of the same job, the same global batch at every
layout, then reads every rank's `summary*.json`:

- `tok/s/rank`: the global batch's tokens per second of a step, divided by the processes —
  each data-parallel rank's tokens (`tokens`) times the data-parallel ranks, over the
  rank's median step time of the steps that compiled nothing (`step_seconds`);
- `vs dp`: that against the replicated layout at the same number of processes
  (`parallel.dp=N`: FSDP2's replicate dimension alone, DDP's layout: every rank holds the
  whole model and all-reduces its gradients);
- `state/rank`: the largest rank's bytes of trained parameters, gradients and AdamW state
  (`state_bytes`) against one process's.

Processes share the machine's cores: the ratios hold only side by side in one run, on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    1: [("single process", [])],
    2: [("dp=2", ["parallel.dp=2"]), ("dp_shard=2", ["parallel.dp_shard=2"]), ("tp=2", ["parallel.tp=2"])],
    4: [
        ("dp=4", ["parallel.dp=4"]),
        ("dp_shard=4", ["parallel.dp_shard=4"]),
        ("tp=2 dp_shard=2", ["parallel.tp=2", "parallel.dp_shard=2"]),
        ("tp=2 cp=2", ["parallel.tp=2", "parallel.cp=2"]),
    ],
}
"""Processes -> (label, overrides); the first of each is the baseline its row is compared with."""


def run_layout(procs: int, overrides: list[str], common: list[str], out: Path) -> dict[str, float]:
    """One layout's run: its tokens per second per rank and the largest rank's state bytes."""
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [] if procs == 1 else [f"--nproc-per-node={procs}"]
    command = [*launcher, "-m", "compiled_loss.run", *common, *overrides, f"hydra.run.dir={out}"]
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warm = [s for s, before in zip(steps[1:], steps) if s["compiles"] == before["compiles"]] or steps[-1:]
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("summary*.json"))]
    parallel = summaries[0]["parallel"]
    data_parallel = parallel["dp"] * parallel["dp_shard"]
    seconds = statistics.median(s["step_seconds"] for s in warm)
    return {
        "tokens_per_s_per_rank": statistics.median(s["tokens"] for s in warm) * data_parallel / seconds / procs,
        "state_bytes": max(sum(s["state_bytes"].values()) for s in summaries),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.py parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", choices=(2, 4), default=[2, 4], help="process counts")
    p.add_argument("--steps", type=int, default=6, help="loss steps per run (default 6)")
    p.add_argument("--backend", default="aot_eager", help="compile.backend (default aot_eager)")
    p.add_argument("overrides", nargs="*", help="more runner overrides, e.g. model=small")
    args = p.parse_args(argv)
    common = [f"run.steps={args.steps}", "run.sft_steps=0", f"compile.backend={args.backend}", *args.overrides]
    print(f"python -m compiled_loss.run {' '.join(common)}; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        one = run_layout(1, [], common, Path(tmp) / "single")
        print(f"{'layout':<18} {'procs':>5} {'tok/s/rank':>11} {'vs dp':>6} {'state/rank':>10}")
        print(f"{'single process':<18} {1:>5} {one['tokens_per_s_per_rank']:>11.0f} {'':>6} {1.0:>9.3f}x")
        for procs in args.procs:
            base = None
            for i, (label, overrides) in enumerate(LAYOUTS[procs]):
                row = run_layout(procs, overrides, common, Path(tmp) / f"procs{procs}_{i}")
                base = base or row
                speed = row["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"]
                state = row["state_bytes"] / one["state_bytes"]
                print(f"{label:<18} {procs:>5} {row['tokens_per_s_per_rank']:>11.0f} {speed:>5.2f}x {state:>9.3f}x")


if __name__ == "__main__":
    main()
