"""`python -m compiled_loss.plot RUN_DIR [RUN_DIR …] [--out curves.png]`: the training
curves of one or several runs of `python -m compiled_loss.run` in one PNG.

A RUN_DIR holds a `metrics.jsonl`; a directory without one stands for the runs in its
subdirectories (a `-m` sweep's directory). Each run is labelled by the overrides that set
it apart from the others (Hydra's `.hydra/overrides.yaml`), else by its directory name.
A run still writing its last line plots without it (a line on stderr says so); a damaged
line elsewhere stops the command, naming the file and the line. Null values (non-finite
metrics) are gaps in the curves.
Needs matplotlib (`pip install 'compiled_loss[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from compiled_loss.app.curves import plot_runs, read_metrics


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run directories the arguments name (a sweep directory expands to its runs)."""
    found: list[Path] = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            found.append(path)
            continue
        runs = sorted((p.parent for p in path.glob("*/metrics.jsonl")), key=lambda p: (len(p.name), p.name))
        if not runs:
            raise SystemExit(f"{path}: no metrics.jsonl in it or in its subdirectories")
        found += runs
    return found


def labels(runs: list[Path]) -> list[str]:
    """Each run's overrides that not every run shares, else its directory name."""
    overrides = []
    for run in runs:
        file = run / ".hydra" / "overrides.yaml"
        overrides.append(OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else [])
    shared = set.intersection(*(set(o) for o in overrides)) if len(runs) > 1 else set()
    return [" ".join(o for o in listed if o not in shared) or run.name for run, listed in zip(runs, overrides)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiled_loss.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    runs = run_dirs(args.run_dirs)
    try:
        records = [read_metrics(run) for run in runs]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        out = plot_runs(list(zip(labels(runs), records)), args.out)
    except ImportError:
        print("matplotlib is not installed: pip install 'compiled_loss[plot]'", file=sys.stderr)
        return 1
    print(f"{len(runs)} run(s) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
