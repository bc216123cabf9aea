"""The runner trains the distillation and MPO options end to end on the embedded task:
`loss=opd_full` (the teacher's full logits from a frozen teacher LM), `loss=mpo` (the
driver's running reward shift δ updated after every step) and `loss=cross_tokenizer`
(teachers with their own vocabulary), compiled (aot_eager) with no graph break."""

from __future__ import annotations

import json

import pytest
import torch
from common import TINY_TASK

from compiled_loss.app import compose_config
from compiled_loss.app.loop import train

pytestmark = pytest.mark.slow  # full runner runs

SMALL = [*TINY_TASK, "compile.backend=aot_eager", "run.sft_steps=1", "run.steps=7"]


def _run(tmp_path, *overrides: str) -> tuple[dict, list[dict]]:
    torch._dynamo.reset()
    summary = train(compose_config(*SMALL, *overrides), tmp_path)
    return summary, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_opd_full_distils_the_teachers_full_distribution(tmp_path):
    summary, steps = _run(tmp_path, "loss=opd_full", "loss.compute_entropy=true", "optim.lr=3e-3")
    kl = [s["opd_full_reverse_kl"] for s in steps if s["phase"] == "opd_full"]
    assert kl[-1] < kl[0] and all(s["opd_full_entropy"] > 0 for s in steps[1:])
    assert summary["compile_problems"] == []


def test_mpo_updates_its_reward_shift_every_step(tmp_path):
    summary, steps = _run(tmp_path, "loss=mpo", "loss.bco_loss_weight=1.0", "loss.reward_shift_momentum=0.5")
    shifts = [s["reward_shift"] for s in steps if s["phase"] == "mpo"]
    assert len(shifts) == 6 and len(set(shifts)) > 1
    assert all("bco_loss" in s for s in steps if s["phase"] == "mpo")
    assert summary["compile_problems"] == []


@pytest.mark.parametrize("packing", ["none", "fused"])
def test_cross_tokenizer_distillation_runs(packing, tmp_path):
    summary, steps = _run(tmp_path, "loss=cross_tokenizer", f"packing={packing}", "packing.width=16")
    assert all({"kl_loss", "ce_loss", "accuracy"} <= set(s) for s in steps if s["phase"] == "cross_tokenizer")
    assert summary["compile_problems"] == []
