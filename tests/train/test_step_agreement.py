"""The training step on real gloo ranks handed batches that cannot run together: a different
number of micro-batches on two data-parallel replicas (FSDP2's gradient reduction would
wait forever for the missing one), and different rows on two tensor-parallel ranks of one
replica (the vocabulary collectives would meet different shapes). Every rank raises the
same clear error, within the test's timeout, before any collective of the step runs."""

from __future__ import annotations

import random

import pytest
import torch
from common import SMALL_RUN
from hydra import compose, initialize_config_module
from ranks import mesh_groups, run_on_ranks

from compiled_loss.app import load_config
from compiled_loss.app.batches import sample_batch
from compiled_loss.demo.model import TinyLM
from compiled_loss.train import build_train_step
from compiled_loss.train.parallel import shard_model

pytestmark = pytest.mark.slow  # spawns process groups

SMALL = [*SMALL_RUN, "run.micro_batches=2", "loss=nll", "compile.enabled=false"]


def _step_on_rank(rank: int, world: int, axis: str, rows: tuple[int, int]) -> str:
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        cfg = load_config(compose(config_name="config", overrides=[*SMALL, f"parallel.{axis}={world}"]))
    torch.manual_seed(0)
    groups = mesh_groups(world, **{axis: world})
    policy = shard_model(TinyLM(cfg.model), groups)
    step = build_train_step(cfg, policy, torch.optim.SGD(policy.parameters(), lr=0.1), groups)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(rank if axis == "dp" else 0), clean=True)
    step({k: v[: rows[rank]] for k, v in batch.items()})
    return "stepped"


@pytest.mark.parametrize(
    ("axis", "rows", "message"),
    [
        (
            "dp",
            (4, 1),
            "the ranks of a process group disagree on the number of micro-batches (rows of the batch split "
            "over run.micro_batches): rank 0: 2; rank 1: 1",
        ),
        (
            "tp",
            (4, 3),
            "the ranks of a process group disagree on the batch's input_lengths (the tensor / context "
            "parallel ranks of a data-parallel replica read the same rows):",
        ),
    ],
    ids=["dp-micro-batches", "tp-rows"],
)
def test_every_rank_raises_the_same_error(axis, rows, message):
    results = run_on_ranks(_step_on_rank, axis, rows, world_size=2, timeout=120)
    assert all(r.startswith(f"ValueError: {message}") for r in results), results
    assert results[0] == results[1]
