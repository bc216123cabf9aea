"""Eager row chunks: any chunk size >= 1 gives the unchunked values and gradients; a chunk
size < 1 is refused at every entry point (it once left rows uninitialised)."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, globals_for, make_batch
from common import message

from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.vocab import token_logprobs, vocab_reduce

GRPO = CASE_BY_NAME["grpo"]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_any_chunk_size_gives_the_unchunked_result(chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, requires_grad=True)
    teacher = torch.randn(7, 11, generator=g)
    index = torch.randint(0, 11, (7, 3), generator=g)

    def run(chunk_size):
        stats = vocab_reduce(logits, index, teacher=teacher, entropy=True, chunk_size=chunk_size)
        total = stats.lse.sum() + stats.picked.sum() + stats.negent.sum() + stats.cross.sum()
        return stats, torch.autograd.grad(total, logits)[0]

    (want, want_grad), (got, got_grad) = run(None), run(chunk)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("chunk", [0, -1])
def test_a_chunk_size_below_one_is_refused(chunk):
    data, logits = make_batch(GRPO, [4, 3], 5, seed=0)
    expected = f"ValueError: chunk_size must be None or an int >= 1, got {chunk}"
    assert message(vocab_reduce, torch.randn(3, 4), chunk_size=chunk) == expected
    assert message(token_logprobs, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), chunk_size=chunk) == expected
    assert message(prepare_loss_input, logits, data, GRPO.make_loss(), chunk_size=chunk) == expected
    assert (
        message(prepare_packed_loss_input, torch.randn(1, 9, 16), data, GRPO.make_loss(), (0, 4, 7), chunk_size=chunk)
        == expected
    )
    assert globals_for(data)  # the batch itself is valid
