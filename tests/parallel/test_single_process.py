"""On real gloo ranks: every entry point given a process group that spans more than one
rank refuses it with a clear error on every rank (compiled_loss computes over one rank's
full vocabulary and sequence), instead of computing over a shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ranks import run_on_ranks

from compiled_loss.loss_functions import ClippedPGLossFn, DraftCrossEntropyLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.wrapper import DraftLossWrapper, SequencePackingFusionLossWrapper


def _refusals(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    attempts = {
        "draft soft-CE": lambda: DraftCrossEntropyLossFn(vocab_parallel_group=group),
        "draft wrapper": lambda: DraftLossWrapper(None, prepare_loss_input, None, vocab_parallel_group=group),
        "packing wrapper": lambda: SequencePackingFusionLossWrapper(
            ClippedPGLossFn({}), prepare_packed_loss_input, (0, 4), context_parallel_group=group),
        "input preparation": lambda: prepare_loss_input(
            torch.zeros(1, 2, 3), {}, ClippedPGLossFn({}), vocab_parallel_group=group),
    }
    out = []
    for name, attempt in attempts.items():
        try:
            attempt()
            out.append(f"{name}: accepted")
        except NotImplementedError as e:
            out.append(f"{name}: {e}")
    return out


def test_groups_of_two_ranks_are_refused_on_every_rank():
    rank0, rank1 = run_on_ranks(_refusals)
    assert rank0 == rank1
    assert rank0 == [
        "draft soft-CE: vocab_parallel_group has world size 2; compiled_loss computes over one rank's full "
        "vocabulary and sequence; pass vocab_parallel_group=None or a single-rank group",
        "draft wrapper: vocab_parallel_group has world size 2; compiled_loss computes over one rank's full "
        "vocabulary and sequence; pass vocab_parallel_group=None or a single-rank group",
        "packing wrapper: context_parallel_group has world size 2; compiled_loss computes over one rank's full "
        "vocabulary and sequence; pass context_parallel_group=None or a single-rank group",
        "input preparation: vocab_parallel_group has world size 2; compiled_loss computes over one rank's full "
        "vocabulary and sequence; pass vocab_parallel_group=None or a single-rank group",
    ]
