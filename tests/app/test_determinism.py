"""`run.deterministic=true`: two runs with the same seed, compiled by Inductor, give
bitwise-identical metrics and weights (without it, Inductor's CPU kernels differ from run
to run in the last bits of a gradient norm from the first step on — measured, docs/runner.md), and
the process's deterministic setting is restored afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from common import LEARNING_TASK

from compiled_loss.app import compose_config
from compiled_loss.app.loop import train

pytestmark = pytest.mark.slow  # two full runs with Inductor

SMALL = [
    *LEARNING_TASK,
    "run.sft_steps=0",
    "run.steps=3",
    "run.micro_batches=1",
    "run.save_every=3",
    "run.deterministic=true",
    "compile.backend=inductor",
]
TIMING = {"sample_seconds", "step_seconds", "tokens_per_s", "compiles"}


def _run(out) -> tuple[list[dict], dict]:
    summary = train(compose_config(*SMALL), out)
    assert summary["compile_problems"] == []
    metrics = [
        {k: v for k, v in json.loads(line).items() if k not in TIMING}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    return metrics, torch.load(out / "checkpoints" / "step_3.pt", weights_only=True)


def test_deterministic_runs_are_bitwise_identical(tmp_path):
    torch._dynamo.reset()
    assert not torch.are_deterministic_algorithms_enabled()
    first, first_state = _run(tmp_path / "first")
    assert not torch.are_deterministic_algorithms_enabled()  # restored
    second, second_state = _run(tmp_path / "second")
    assert first == second
    for part in ("policy", "optimizers"):
        flat = [torch.utils._pytree.tree_leaves(s[part]) for s in (first_state, second_state)]
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(*flat)), part
