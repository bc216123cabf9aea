"""`tools/gpu_check.py --tiny` end to end on the CPU: the report (markdown and JSON) holds
every section — the compile audit, the LM-head bench, the log-prob against the bandwidth
limit, the world-size-1 process group — and each passed; a section stopped at its time
limit is reported failed with the reason while the next one still runs. The check is
made for a GPU; here it runs its tiny sizes, on gloo. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tolerances import F32, close

pytestmark = pytest.mark.slow  # starts the check's processes: about a minute on 2 idle cores

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["audit", "head", "logprob", "nccl"]


def _run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--tiny", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads((out / "report.json").read_text())


def test_tiny_run_reports_every_section_passed(tmp_path: Path) -> None:
    proc, report = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert report["tiny"] and report["passed"]
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == SECTIONS
    for name, s in sections.items():
        assert s["status"] == "passed", (name, s["reason"])
    markdown = (tmp_path / "report.md").read_text()
    for i, name in enumerate(SECTIONS, 1):
        assert f"## {i}. " in markdown and f"(`{name}`)" in markdown

    audit = sections["audit"]["details"]
    assert audit["missing"] == [] and len(audit["rows"]) == len(audit["configurations"]) == 3
    for row in audit["rows"]:
        assert row["failures"] == [] and row["graph_breaks"] == [] and row["syncs"] == []
        assert 1 <= row["compiles"] <= row["buckets"]

    head = {(r["loss"], r["variant"]): r for r in sections["head"]["details"]["rows"]}
    assert set(head) == {("grpo", v) for v in ("eager", "fused", "liger")} | {
        ("nll", v) for v in ("eager", "fused", "cce", "liger")
    }
    assert head["nll", "liger"]["status"].startswith("n/a: Liger's fused-linear cross-entropy is a Triton kernel")
    for loss, peer, module in (("grpo", "liger", "liger_kernel"), ("nll", "cce", "cut_cross_entropy")):
        if importlib.util.find_spec(module) is None:
            assert head[loss, peer]["status"].startswith("n/a: not installed (pip install --no-deps")
        else:
            assert head[loss, peer]["status"] == "ok" and float(head[loss, peer]["compile_s"]) > 0
    for (loss, variant), r in head.items():
        if r["status"] == "ok":
            eager = float(head[loss, "eager"]["loss_value"])
            assert abs(float(r["loss_value"]) - eager) <= close(F32, "accumulated")["rtol"] * abs(eager), (
                loss,
                variant,
            )

    logprob = sections["logprob"]["details"]
    assert logprob["bytes_per_s"] > 0 and [x["direction"] for x in logprob["limits"]] == ["fwd", "fwd+bwd"]
    assert {(r["variant"], r["direction"], r["status"]) for r in logprob["rows"]} == {
        ("lp_compiled", "fwd", "ok"),
        ("lp_compiled", "fwd+bwd", "ok"),
    }

    checks = sections["nccl"]["details"]["checks"]
    names = " | ".join(c["name"] for c in checks)
    for part in ("all_reduce", "all_gather_into_tensor", "compiled", "fused packing", "DistributedDataParallel"):
        assert part in names
    assert all(c["ok"] and c["max_rel_diff"] <= close(F32, "same")["rtol"] for c in checks)


def test_a_section_past_its_time_limit_fails_and_the_next_still_runs(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--sections", "audit", "logprob", "--limit", "audit=2", "--limit", "logprob=2")
    assert proc.returncode == 1
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == ["audit", "logprob"] and not report["passed"]
    assert sections["audit"]["status"] == "failed"
    assert "3 configuration(s) not run" in sections["audit"]["reason"]
    assert "time limit (2 s)" in sections["audit"]["reason"]
    assert sections["logprob"]["status"] == "failed" and "time limit" in sections["logprob"]["reason"]
    assert "FAILED" in (tmp_path / "report.md").read_text()
