"""`tools/bench.py --quick` end to end: the CSV has one row per variant × direction, finite
numbers, and the NeMo-RL-style loop (a) agrees with compiled_loss eager (b) and compiled (c).
The tool is a benchmark, not a speed test: no timing is asserted."""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tolerances import F32, close

pytestmark = pytest.mark.slow  # runs the benchmark

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = [
    "tokens",
    "vocab",
    "seqs",
    "dtype",
    "device",
    "variant",
    "direction",
    "repeat",
    "median_ms",
    "min_ms",
    "compile_s",
    "peak_extra_mib",
    "peak_extra_rel",
    "logits_mib",
    "loss",
    "ratio_to_a",
    "ratio_to_d",
    "status",
]
VARIANTS = ["a_loop", "b_eager", "c_compiled", "d_proxy", "lp_compiled", "c_topp"]


def test_quick_run_writes_consistent_csv(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--quick", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets:" in proc.stdout
    with open(tmp_path / "bench.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [(r["variant"], r["direction"]) for r in rows] == [(v, d) for v in VARIANTS for d in ("fwd", "fwd+bwd")]
    for r in rows:
        assert r["status"] == "ok"
        assert (r["tokens"], r["vocab"], r["seqs"], r["dtype"], r["device"]) == ("512", "2048", "4", "bf16", "cpu")
        for key in ("median_ms", "min_ms", "peak_extra_mib", "peak_extra_rel", "ratio_to_a", "ratio_to_d"):
            assert math.isfinite(float(r[key])), (r["variant"], key, r[key])
        assert float(r["median_ms"]) > 0
        assert float(r["logits_mib"]) == 512 * 2048 * 2 / 2**20
        if r["variant"] in ("c_compiled", "d_proxy", "lp_compiled", "c_topp"):
            assert float(r["compile_s"]) > 0
        else:
            assert r["compile_s"] == ""
    loss = {(r["variant"], r["direction"]): r["loss"] for r in rows}
    for direction in ("fwd", "fwd+bwd"):
        a, b, c = (float(loss[v, direction]) for v in ("a_loop", "b_eager", "c_compiled"))
        assert math.isfinite(b) and b != 0
        rtol = close(F32, "accumulated")["rtol"]  # sums over a 2048-entry vocabulary in another order
        assert abs(a - b) <= rtol * abs(b)
        assert abs(c - b) <= rtol * abs(b)
    assert loss["d_proxy", "fwd"] == loss["lp_compiled", "fwd"] == ""
    assert math.isfinite(float(loss["c_topp", "fwd"])) and loss["c_topp", "fwd"] != loss["c_compiled", "fwd"]
    assert (tmp_path / "bench.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_the_speculative_bench_prints_a_row_and_its_profile() -> None:
    """`tools/bench.py speculative` at one tiny batch (DFlash, Dynamo's eager backend): its
    row, τ and the round count in range, speed-up = plain / spec."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "speculative", "--rows", "2", "--repeat", "1"]
        + ["--backend", "eager", "--draft", "dflash"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    lines = done.stdout.splitlines()
    assert lines[1].split() == [
        *("draft", "rows", "tau", "rounds", "plain_ms", "spec_ms", "speedup"),
        *("decode_ms", "verify_ms", "propose_ms", "round_ms", "verify/decode", "propose/decode"),
    ]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["dflash", "2"]]
    for r in rows:
        tau, rounds, plain, spec, speedup = float(r[2]), int(r[3]), float(r[4]), float(r[5]), float(r[6])
        assert 1 <= tau <= 5 and rounds >= 1 and plain > 0 and spec > 0
        assert speedup == pytest.approx(plain / spec, rel=0.02, abs=0.01)
