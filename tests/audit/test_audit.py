"""The audit tool finds what fullgraph=True and Dynamo's counters hide, and gates on it."""

from __future__ import annotations

import json

import pytest

from compiled_loss.audit.cli import main


def run(tmp_path, *argv):
    code = main([*argv, "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "audit.json").read_text())


def test_planted_item_sync_fails(tmp_path):
    code, rows = run(
        tmp_path, "--target", "audit_targets:with_item", "--inputs", "audit_targets:eight_floats", "backend=eager"
    )
    assert code == 1
    assert rows[0]["graph_breaks"] == [] and rows[0]["syncs"]  # no break counted, yet a sync
    assert any("host sync" in f for f in rows[0]["failures"])


def test_planted_recompile_on_a_seen_bucket_fails(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:per_value",
        "--inputs",
        "audit_targets:same_shape_new_ints",
        "backend=eager",
    )
    assert code == 1
    assert rows[0]["buckets"] == 1 and rows[0]["compiles"] > 1
    assert rows[0]["recompiles"] and "scale" in rows[0]["recompiles"][0]


def test_planted_graph_break_is_reported_with_its_line(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:with_item",
        "--inputs",
        "audit_targets:eight_floats",
        "backend=eager",
        "--no-fullgraph",
    )
    assert code == 1
    assert any("audit_targets.py" in b and ".item()" in b for b in rows[0]["graph_breaks"])


def test_clean_target_passes(tmp_path):
    code, rows = run(
        tmp_path, "--target", "audit_targets:clean", "--inputs", "audit_targets:masked_samples", "backend=eager"
    )
    assert code == 0 and rows[0]["failures"] == [] and rows[0]["buckets"] == 2


@pytest.mark.slow
def test_project_matrix_passes(tmp_path):
    code, rows = run(
        tmp_path,
        "loss=clipped_pg,distillation",
        "packing=per_sequence,fused",
        "draft=none",
        "dtype=bf16",
        "batches=6",
        "steps=2",
        "backend=eager",
    )
    assert code == 0
    assert len(rows) == 8 and all(r["failures"] == [] and r["compiles"] >= 1 for r in rows)
    assert "| configuration |" in (tmp_path / "audit.md").read_text()


def test_default_run_is_the_representative_subset():
    from compiled_loss.audit.cli import DRAFTS, DTYPES, LOSSES, PACKINGS, configurations

    rows, batches, steps = configurations({}, full=False)
    assert (len(rows), batches, steps) == (12, 50, 5)
    assert {r[0] for r in rows} == set(LOSSES) and {r[1] for r in rows} == set(PACKINGS)
    assert {r[2] for r in rows} == set(DRAFTS)
    assert {r[3] for r in rows} == set(DTYPES) and {r[4] for r in rows} == {"inductor", "aot_eager"}
    full, batches, steps = configurations({}, full=True)
    value_with_draft = len(PACKINGS) * (len(DRAFTS) - 1) * len(DTYPES)  # refused: a value head has no drafter
    assert (len(full), batches, steps) == (
        len(LOSSES) * len(PACKINGS) * len(DRAFTS) * len(DTYPES) - value_with_draft,
        200,
        20,
    )
    assert all(r[2] == "none" for r in full if r[0] == "mse_value")
    chosen, _, _ = configurations({"loss": ["dpo"], "backend": ["eager"]}, full=False)
    assert chosen == [("dpo", p, r, d, "eager") for p in PACKINGS for r in DRAFTS for d in DTYPES]


@pytest.mark.slow
def test_distributed_mode_reports_every_rank(tmp_path):
    """`torchrun … compiled_loss.audit.cli tp=2`: every rank's training step (the compiled loss and
    the model, which DDP keeps apart), with and without a co-trained drafter."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free rendezvous port (parallel test workers)
            "--nproc-per-node=2",
            "-m",
            "compiled_loss.audit.cli",
            "tp=2",
            "loss=clipped_pg",
            "packing=fused",
            "dtype=fp32",
            "steps=2",
            "backend=eager",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "audit.json").read_text())
    drafts = [r["name"].split(" ")[2].split("/")[2] for r in rows]
    assert [r["name"].split(" ")[:2] for r in rows] == [["rank", "0"]] * 6 + [["rank", "1"]] * 6
    assert drafts == ["none", "none", "eagle3", "eagle3", "dflash", "dflash"] * 2
    assert all(r["failures"] == [] and 1 <= r["compiles"] <= r["buckets"] for r in rows)
