"""Run verl's own CPU loss tests against `compiled_loss.integrations.verl`.

    python tools/verl_tests/run.py [--dir build/verl_tests] [--compiled aot_eager|inductor|eager]
                                   [-- PYTEST_ARGS...]

Downloads the source distribution of the installed verl (`pip download --no-deps --no-binary
:all: verl==<version>`; kept in `--dir` and reused), unpacks it and runs its
`tests/trainer/ppo/` loss tests (`TEST_FILES`) from there against the installed verl, with
`verl_plugin` (this folder) rebinding `core_algos`'s loss functions and registry entries to
this library's. Nothing of verl's test code is copied into the project.

It prints the outcomes (passed, failed, skipped) with how many of the passed tests called
this library's functions (a test that called none ran only verl's own code, such as its
advantage estimators), each routed name with the number of tests that called it, then every
failure, and exits 1 on any failure or a test file that collected nothing.
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

HERE = Path(__file__).resolve().parent

TEST_FILES = (
    "test_loss_aggregation_on_cpu.py",
    "test_core_algos_on_cpu.py",
    "test_dynamic_policy_losses_on_cpu.py",
    "test_value_loss_normalization_on_cpu.py",
    "test_rollout_corr_integration.py",
)
"""verl's CPU tests of `core_algos`'s losses, aggregation and KL penalty (`tests/trainer/ppo/`)."""


def fetch(directory: Path) -> Path:
    """The unpacked sdist of the installed verl, downloaded once into `directory`."""
    version = importlib.metadata.version("verl")
    root = directory / f"verl-{version}"
    if (root / "tests" / "trainer" / "ppo").is_dir():
        return root
    archive = directory / f"verl-{version}.tar.gz"
    if not archive.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command += [f"verl=={version}", "-d", str(directory), "-q"]
        subprocess.run(command, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("build/verl_tests"))
    parser.add_argument("--compiled", choices=("aot_eager", "inductor", "eager"), default="aot_eager")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    root = fetch(args.dir.resolve())
    summary = args.dir.resolve() / "outcomes.json"
    summary.unlink(missing_ok=True)
    # -P: the sdist root (the working directory) stays off sys.path, so `verl` is the installed one
    command = [sys.executable, "-P", "-m", "pytest", "-p", "verl_plugin", "-p", "no:cacheprovider"]
    # verl's own pyproject.toml as the configuration (without it pytest would find this project's)
    command += ["-c", "pyproject.toml", "--rootdir", ".", "-q", "--import-mode=importlib"]
    command += ["-W", "ignore::pytest.PytestConfigWarning"]
    command += [f"--verl-compiled={args.compiled}", f"--verl-summary={summary}"]
    command += [f"tests/trainer/ppo/{name}" for name in TEST_FILES] + args.pytest_args
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"verl tests: {' '.join(command)}\n  in {root}", flush=True)
    log = args.dir.resolve() / "pytest.log"
    with open(log, "w") as out:
        pytest_rc = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if not summary.exists():
        print(f"verl tests: pytest exited {pytest_rc} without a summary; its output: {log}")
        return 1
    result = json.loads(summary.read_text())
    outcomes = result["tests"]
    counts = Counter(record["outcome"] for record in outcomes.values())
    ours = sum(1 for record in outcomes.values() if record["outcome"] == "passed" and record["called"])
    print(
        f"verl tests against compiled_loss ({args.compiled}; verl from {Path(result['verl']).parent}): "
        f"{counts['passed']} passed ({ours} of them call compiled_loss, {counts['passed'] - ours} only verl's own "
        f"code), {counts['failed']} failed, {counts['skipped']} skipped; {len(outcomes)} tests, "
        f"{time.perf_counter() - start:.0f} s"
    )
    by_file = Counter(nodeid.split("::", 1)[0].rsplit("/", 1)[-1] for nodeid in outcomes)
    for name in TEST_FILES:
        called = Counter(n for nodeid, r in outcomes.items() if name in nodeid for n in r["called"])
        routed = ", ".join(f"{n} ({c})" for n, c in sorted(called.items())) or "none"
        print(f"  {name}: {by_file[name]} tests; compiled_loss functions called (tests): {routed}")
    for nodeid, record in sorted(outcomes.items()):
        if record["outcome"] == "failed":
            print(f"  FAILED {nodeid}: {record.get('error', '')}")
    missing = [name for name in TEST_FILES if not by_file[name]]
    if missing:
        print(f"verl tests: no test collected from {', '.join(missing)} (its output: {log})")
        return 1
    if counts["failed"] or pytest_rc not in (0, 1):
        print(f"verl tests: FAILED (pytest exit {pytest_rc}; its output: {log})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
