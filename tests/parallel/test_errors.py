"""Errors, never hangs: ranks that disagree on the packing, or a layout a context-parallel
group cannot shard, raise a clear error on every rank before any collective that could
block — within seconds."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from ranks import run_on_ranks

from compiled_loss.loss_functions import NLLLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation


def _attempt(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "accepted"


def _errors(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    cu = (0, 4, 8) if rank == 0 else (0, 4, 12)
    data = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "token_mask": torch.ones(1, 6),
            "sample_mask": torch.ones(1)}
    return [
        _attempt(lambda: SequencePackingFusionLossWrapper(NLLLossFn(), prepare_packed_loss_input, cu, cu,
                                                          context_parallel_group=group)),
        _attempt(lambda: SequencePackingFusionLossWrapper(NLLLossFn(), prepare_packed_loss_input, (0, 5, 11),
                                                          (0, 6, 12), context_parallel_group=group)),
        _attempt(lambda: wrap_loss_fn_with_input_preparation(torch.zeros(1, 2, 5), data, None, torch.tensor(1.0),
                                                             NLLLossFn(), prepare_loss_input,
                                                             context_parallel_group=group)),
    ]


def test_every_rank_raises_the_same_clear_error_within_seconds():
    start = time.monotonic()
    rank0, rank1 = run_on_ranks(_errors, timeout=60)
    assert time.monotonic() - start < 30
    assert rank0 == rank1
    assert rank0 == [
        "the ranks of a process group disagree on the packing (cu_seqlens_q, cu_seqlens_q_padded, bucket): "
        "rank 0: ((0, 4, 8), (0, 4, 8), BucketGrid(tokens=1, rows=1, width=1, per_octave=0)); "
        "rank 1: ((0, 4, 12), (0, 4, 12), BucketGrid(tokens=1, rows=1, width=1, per_octave=0))",
        "with context parallel size 2 every padded sequence length must be a multiple of 2*cp=4; sequences [0, 1] "
        "have padded lengths [6, 6]",
        "logits hold 2 positions per context-parallel rank; 2 ranks cover 4, fewer than the 6 positions of "
        "input_ids",
    ]
