"""`reconstruct_opd_full_teacher_logits` with a context-parallel group (ref §6.6): each rank
gets its load-balanced share of the positions, for both payload kinds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks

from compiled_loss.utils import reconstruct_opd_full_teacher_logits

pytestmark = pytest.mark.slow  # spawns process groups


def _payloads():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 7, 5, generator=g), torch.randn(2, 7, 6, generator=g), torch.randn(6, 5, generator=g)


def _on_ranks(rank: int, world: int):
    hidden, logits, weight = _payloads()
    student = torch.zeros(2, 4, 6)  # S_local = 4: 2 ranks cover 8 >= 7 positions
    group = dist.group.WORLD
    return [
        reconstruct_opd_full_teacher_logits(
            hidden,
            teacher_payload="hidden_states",
            student_logits=student,
            vocab_parallel_rank=0,
            context_parallel_group=group,
            teacher_output_layer_weight_by_index={0: weight},
        ),
        reconstruct_opd_full_teacher_logits(
            logits,
            teacher_payload="logits",
            student_logits=student,
            vocab_parallel_rank=0,
            context_parallel_group=group,
        ),
    ]


def test_each_rank_gets_its_load_balanced_positions():
    hidden, logits, weight = _payloads()
    full = [torch.nn.functional.pad(hidden @ weight.T, (0, 0, 0, 1)), torch.nn.functional.pad(logits, (0, 0, 0, 1))]
    chunks = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}  # 2·cp = 4 chunks of 2 positions; rank r: chunks r, 3 - r
    for rank, got in enumerate(run_on_ranks(_on_ranks)):
        for g, want in zip(got, full):
            torch.testing.assert_close(g, want[:, chunks[rank]])
