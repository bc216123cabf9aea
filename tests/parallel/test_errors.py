"""Errors, never hangs: ranks that disagree on the packing, on the shapes or dtypes of a
micro-batch (unpacked `[B, S]`, vocabulary shard widths, rows), or hand a layout a
context-parallel group cannot shard, raise the same clear error on every rank before any
collective that could block — within seconds; so does an id outside the full vocabulary of
the shards."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks

from compiled_loss.loss_functions import NLLLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.packing.context import ContextShards
from compiled_loss.utils import map_teacher_logits_to_draft_vocab
from compiled_loss.vocab import (
    LinearLogits,
    reverse_kl,
    sampling_threshold,
    token_logprobs,
    vocab_reduce,
    vocab_topk,
)
from compiled_loss.wrapper import (
    DraftLossWrapper,
    SequencePackingFusionLossWrapper,
    wrap_loss_fn_with_input_preparation,
)


def _attempt(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "accepted"


def _nll_data(rows: int, width: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "token_mask": torch.ones(rows, width),
        "sample_mask": torch.ones(rows),
    }


def _disagreements(rank: int, world: int) -> list[str]:
    """Each entry point handed inputs that differ between the two ranks (rank 1 the odd one)."""
    group, odd = dist.group.WORLD, rank == 1
    width = 6 if odd else 7  # vocabulary shard widths 7 + 6
    logits, targets = torch.randn(4, width), torch.tensor([0, 3, 7, 12])
    unpacked = functools.partial(
        wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn(), prepare_fn=prepare_loss_input
    )
    seq = 4 if odd else 5  # unpacked [B, S]: [2, 5] and [2, 4]
    packed = SequencePackingFusionLossWrapper(
        NLLLossFn(), prepare_packed_loss_input, (0, 4, 8), (0, 4, 8), vocab_parallel_group=group
    )
    draft = DraftLossWrapper(unpacked, prepare_loss_input, None, vocab_parallel_group=group)
    return [
        _attempt(lambda: token_logprobs(logits, targets, group=group)),
        _attempt(lambda: vocab_reduce(torch.randn(4, 6, dtype=torch.bfloat16 if odd else torch.float32), group=group)),
        _attempt(lambda: vocab_reduce(torch.randn(5 if odd else 4, 6), group=group)),
        _attempt(lambda: token_logprobs(LinearLogits(torch.randn(4, 3), torch.randn(width, 3)), targets, group=group)),
        _attempt(
            lambda: unpacked(
                torch.randn(2, seq, 8), _nll_data(2, seq), None, torch.tensor(8.0), vocab_parallel_group=group
            )
        ),
        _attempt(
            lambda: unpacked(
                torch.randn(2, 4, 8), _nll_data(2, seq), None, torch.tensor(8.0), context_parallel_group=group
            )
        ),
        _attempt(lambda: packed(torch.randn(1, 8, 8), _nll_data(2, seq), None, torch.tensor(6.0))),
        _attempt(
            lambda: draft(
                torch.randn(2, 4, 8),
                {**_nll_data(2, 4), "student_logits": torch.randn(2, 4, width)},
                None,
                torch.tensor(6.0),
            )
        ),
        _attempt(lambda: reverse_kl(logits, torch.randn(4, width), group=group)),
        _attempt(lambda: vocab_topk(logits, 3, group)),
        _attempt(lambda: sampling_threshold(logits, 3, 1.0, group=group)),
        _attempt(
            lambda: map_teacher_logits_to_draft_vocab(
                torch.randn(2, width), torch.zeros(4, dtype=torch.long), vocab_parallel_group=group
            )
        ),
        _attempt(lambda: ContextShards.of_rows(3 if odd else 2, 4, group)),
        _attempt(lambda: ContextShards.of_segments((0, 4), (4, 8) if odd else (4, 4), 12 if odd else 8, group)),
        _attempt(lambda: token_logprobs(torch.randn(4, 6), torch.tensor([0, 3, 11, 12]), group=group)),  # agreed
    ]


def _grid_disagreement(rank: int, world: int) -> str:
    """tp = cp = 2 (rank = cp_rank · 2 + tp_rank): rank 3 alone hands an unpacked batch of
    another width, which neither its tensor- nor its context-parallel partner of rank 0 sees."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    seq = 4 if rank == 3 else 5
    return _attempt(
        lambda: wrap_loss_fn_with_input_preparation(
            torch.randn(2, 4, 8),
            _nll_data(2, seq),
            None,
            torch.tensor(8.0),
            NLLLossFn(),
            prepare_loss_input,
            vocab_parallel_group=tp_groups[rank // 2],
            context_parallel_group=cp_groups[rank % 2],
        )
    )


def _errors(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    cu = (0, 4, 8) if rank == 0 else (0, 4, 12)
    data = {
        "input_ids": torch.zeros(1, 6, dtype=torch.long),
        "token_mask": torch.ones(1, 6),
        "sample_mask": torch.ones(1),
    }
    return [
        _attempt(
            lambda: SequencePackingFusionLossWrapper(
                NLLLossFn(), prepare_packed_loss_input, cu, cu, context_parallel_group=group
            )
        ),
        _attempt(
            lambda: SequencePackingFusionLossWrapper(
                NLLLossFn(), prepare_packed_loss_input, (0, 5, 11), (0, 6, 12), context_parallel_group=group
            )
        ),
        _attempt(
            lambda: wrap_loss_fn_with_input_preparation(
                torch.zeros(1, 2, 5),
                data,
                None,
                torch.tensor(1.0),
                NLLLossFn(),
                prepare_loss_input,
                context_parallel_group=group,
            )
        ),
    ]


def _both(rank: int, world: int) -> tuple[list[str], list[str]]:
    return _errors(rank, world), _disagreements(rank, world)


@functools.cache
def _two_ranks() -> tuple[list, float]:
    """Both 2-rank workers' results (one spawn for the module) and the seconds it took."""
    start = time.monotonic()
    return run_on_ranks(_both, timeout=60), time.monotonic() - start


@pytest.mark.slow
def test_every_rank_raises_the_same_clear_error_within_seconds():
    (rank0, rank1), seconds = _two_ranks()
    assert seconds < 30
    rank0, rank1 = rank0[0], rank1[0]
    assert rank0 == rank1
    assert rank0 == [
        "the ranks of a process group disagree on the packing (cu_seqlens_q, cu_seqlens_q_padded, bucket): "
        "rank 0: ((0, 4, 8), (0, 4, 8), BucketGrid(tokens=1, rows=1, width=1, per_octave=0)); "
        "rank 1: ((0, 4, 12), (0, 4, 12), BucketGrid(tokens=1, rows=1, width=1, per_octave=0))",
        "with context parallel size 2 every padded sequence length must be a multiple of 2*cp=4; sequences [0, 1] "
        "have padded lengths [6, 6]",
        "logits hold 2 positions per context-parallel rank; 2 ranks cover 4, fewer than the 6 positions of input_ids",
    ]


SHARD = "each rank's logits are its vocabulary shard [N, V / tp]: equally wide, with the same"
DISAGREE = "the ranks of a process group disagree on"


def test_disagreeing_inputs_raise_the_same_clear_error_on_every_rank_within_seconds():
    """Shards of 7 + 6 columns once gave log-probs wrong by up to 2.1 with no error, and
    unpacked batches of different widths aborted gloo (a hang on NCCL)."""
    (rank0, rank1), seconds = _two_ranks()
    assert seconds < 30
    rank0, rank1 = rank0[1], rank1[1]
    assert rank0 == rank1
    reduce = f"{DISAGREE} vocab_reduce's inputs ({SHARD} rows, dtype and other inputs on every rank): "
    unpacked = f"{DISAGREE} wrap_loss_fn_with_input_preparation's inputs (shapes and dtypes): "
    assert rank0 == [
        reduce + "rank 0: logits=float32[4, 7], ids outside the vocabulary=0; "
        "rank 1: logits=float32[4, 6], ids outside the vocabulary=1",
        reduce + "rank 0: logits=float32[4, 6]; rank 1: logits=bfloat16[4, 6]",
        reduce + "rank 0: logits=float32[4, 6]; rank 1: logits=float32[5, 6]",
        reduce + "rank 0: logits.weight=float32[7, 3], ids outside the vocabulary=0; "
        "rank 1: logits.weight=float32[6, 3], ids outside the vocabulary=1",
        unpacked + "rank 0: next_token_logits=float32[2, 5, 8], data['input_ids']=int64[2, 5], "
        "data['token_mask']=float32[2, 5]; rank 1: next_token_logits=float32[2, 4, 8], data['input_ids']=int64[2, 4], "
        "data['token_mask']=float32[2, 4]",
        unpacked + "rank 0: data['input_ids']=int64[2, 5], data['token_mask']=float32[2, 5]; "
        "rank 1: data['input_ids']=int64[2, 4], data['token_mask']=float32[2, 4]",
        f"{DISAGREE} sequence_packing_loss's inputs (shapes and dtypes): rank 0: data['input_ids']=int64[2, 5], "
        "data['token_mask']=float32[2, 5]; rank 1: data['input_ids']=int64[2, 4], data['token_mask']=float32[2, 4]",
        f"{DISAGREE} DraftLossWrapper's inputs (shapes and dtypes): rank 0: data['student_logits']=float32[2, 4, 7]; "
        "rank 1: data['student_logits']=float32[2, 4, 6]",
        f"{DISAGREE} reverse_kl's inputs ({SHARD} rows and dtypes on every rank): "
        "rank 0: logits=float32[4, 7], teacher=float32[4, 7]; rank 1: logits=float32[4, 6], teacher=float32[4, 6]",
        f"{DISAGREE} vocab_topk's inputs ({SHARD.replace('[N,', '[...,')} rows, dtype and k on every rank): "
        "rank 0: logits=float32[4, 7]; rank 1: logits=float32[4, 6]",
        f"{DISAGREE} sampling_threshold's inputs ({SHARD} rows, dtype and filter on every rank): "
        "rank 0: logits=float32[4, 7]; rank 1: logits=float32[4, 6]",
        f"{DISAGREE} map_teacher_logits_to_draft_vocab's inputs (each rank's teacher_logits are its vocabulary shard "
        "[..., V / tp]: equally wide, with the same shape and dtype on every rank): "
        "rank 0: teacher_logits=float32[2, 7]; rank 1: teacher_logits=float32[2, 6]",
        f"{DISAGREE} the context-parallel layout of unpacked rows (rows B, padded width cp · S_local): "
        "rank 0: (2, 4); rank 1: (3, 4)",
        f"{DISAGREE} the context-parallel layout (segment starts, padded lengths, slots): "
        "rank 0: ((0, 4), (4, 4), 8); rank 1: ((0, 4), (4, 8), 12)",
        "vocab_reduce: index holds ids outside the vocabulary [0, 12) (1 of 4, 2 tensor-parallel shards of 6)",
    ]


@pytest.mark.slow
def test_a_tensor_by_context_parallel_grid_raises_the_same_error_on_all_four_ranks():
    """One rank of a tp = cp = 2 grid disagrees: the check gathers over its tensor-parallel
    group, then passes that over its context-parallel group, so every rank — rank 0 too, which
    shares no group with rank 3 — sees every rank's inputs and raises the same error."""
    start = time.monotonic()
    errors = run_on_ranks(_grid_disagreement, world_size=4, timeout=120)
    assert time.monotonic() - start < 60
    assert (
        errors
        == [
            f"{DISAGREE} wrap_loss_fn_with_input_preparation's inputs (shapes and dtypes): "
            "rank 0: data['input_ids']=int64[2, 5], data['token_mask']=float32[2, 5]; "
            "rank 1: data['input_ids']=int64[2, 5], data['token_mask']=float32[2, 5]; "
            "rank 2: data['input_ids']=int64[2, 5], data['token_mask']=float32[2, 5]; "
            "rank 3: data['input_ids']=int64[2, 4], data['token_mask']=float32[2, 4]"
        ]
        * 4
    )
