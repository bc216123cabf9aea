"""Run Liger-Kernel's own chunked-loss tests against compiled_loss's Liger front-ends.

    python tools/liger_tests/run.py [--dir build/liger_tests] [--target ours|liger]
                                    [--compiled eager|as-passed] [--all] [-- PYTEST_ARGS...]

Downloads the source distribution of the installed `liger-kernel` (`pip download --no-deps
--no-binary :all: liger-kernel==<version>`; kept in `--dir` and reused), unpacks it and runs
its `test/chunked_loss/` files for the modules this library provides (`TEST_FILES`) from
there, with `liger_plugin` (this folder) swapping Liger's names for this library's modules.
Nothing of Liger's test code is copied into the project.

It prints each test's outcome counted as passed, refused by name (the front-end's
`RefusedOption`: reported as xfail), failed and skipped (by Liger's own tests: no CUDA, no
Triton, combinations Liger does not run), then every failure, and exits 1 on any failure.

`--target liger` runs the same tests against the real Liger (the baseline). `--compiled
eager` (the default for ours) builds this library's modules with `compiled=False` whatever
the test passes; `as-passed` compiles where the test asks (Inductor, one compile per case:
slow on CPU). The default selection is `liger_plugin.CI_SUBSET`; `--all` runs every case.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import liger_plugin

HERE = Path(__file__).resolve().parent

TEST_FILES = ("test_grpo_loss.py", "test_dpo_loss.py", "test_jsd_loss.py")
"""Liger's chunked-loss test files of the modules this library provides (`liger_plugin.MODULES`);
Liger 0.8.5 has no chunked cross-entropy test (its fused-linear cross-entropy is a Triton kernel)."""


def fetch(directory: Path) -> Path:
    """The unpacked sdist of the installed liger-kernel, downloaded once into `directory`."""
    version = importlib.metadata.version("liger-kernel")
    root = directory / f"liger_kernel-{version}"
    if (root / "test" / "chunked_loss").is_dir():
        return root
    archive = directory / f"liger_kernel-{version}.tar.gz"
    if not archive.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command += [f"liger-kernel=={version}", "-d", str(directory), "-q"]
        subprocess.run(command, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("build/liger_tests"))
    parser.add_argument("--target", choices=("ours", "liger"), default="ours")
    parser.add_argument("--compiled", choices=("eager", "as-passed"), default="eager")
    parser.add_argument("--all", action="store_true", help="every case, not the CI subset")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    root = fetch(args.dir.resolve())
    summary = args.dir.resolve() / f"outcomes-{args.target}.json"
    summary.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "liger_plugin", "-p", "no:cacheprovider", "-p", "no:logging"]
    command += ["-q", "-W", "ignore::pytest.PytestConfigWarning", f"--liger-target={args.target}"]
    command += [f"--liger-compiled={args.compiled}", f"--liger-summary={summary}"]
    command += [] if args.all else ["--liger-ci-subset"]
    command += [f"test/chunked_loss/{name}" for name in TEST_FILES] + args.pytest_args
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"liger tests: {' '.join(command)}\n  in {root}", flush=True)
    log = args.dir.resolve() / f"pytest-{args.target}.log"
    with open(log, "w") as out:
        pytest_rc = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if not summary.exists():
        print(f"liger tests: pytest exited {pytest_rc} without a summary; its output: {log}")
        return 1
    outcomes = json.loads(summary.read_text())
    counts = Counter(record["outcome"] for record in outcomes.values())
    internal = sum(1 for record in outcomes.values() if record["internal"] and record["outcome"] == "passed")
    selection = "every case" if args.all else f"the CI subset: {liger_plugin.CI_SUBSET}"
    print(
        f"liger tests against {args.target} ({args.compiled}; {selection}): {counts['passed']} passed ({internal} "
        f"of them exercise only Liger's own internals), {counts['refused']} refused by name, {counts['failed']} "
        f"failed, {counts['skipped']} skipped by Liger's tests; {len(outcomes)} cases, "
        f"{time.perf_counter() - start:.0f} s"
    )
    refused = Counter(record["refused"] for record in outcomes.values() if record["outcome"] == "refused")
    for option, count in sorted(refused.items()):
        print(f"  refused by name: {option} ({count} cases)")
    for nodeid in sorted(n for n, record in outcomes.items() if record["outcome"] == "failed"):
        print(f"  FAILED {nodeid}")
    if counts["failed"] or pytest_rc not in (0, 1):
        print(f"liger tests: FAILED (pytest exit {pytest_rc}; its output: {log})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
