"""`linear_vocab_reduce`: `vocab_reduce` of `hidden @ weightᵀ (+ bias)` without ever
holding the `[N, V]` logits.

The rows go through the LM-head projection one static chunk at a time: each chunk's
logits exist only while its statistics are taken, and the backward recomputes them chunk
by chunk to produce `dH`, `dW` (and `d bias`). The statistics, their merge over
tensor-parallel vocabulary shards and the pointwise gradient are `vocab_reduce`'s own
(`compiled_loss.vocab.reduce`); under TP, `weight` is this rank's vocabulary shard and
`dH` is summed over the group.
"""

from __future__ import annotations

from typing import Any

import torch

from compiled_loss.parallel import group_rank
from compiled_loss.parallel.collectives import all_reduce_sum
from compiled_loss.vocab.reduce import (
    VocabStats,
    _chunk_grad,
    _filtered_chunk,
    _live,
    _local_index,
    _merge_shards,
    _shard_stats,
    check_chunk_size,
)

Tensor = torch.Tensor

# Default rows per chunk: fp32 logit tiles of ~16 MiB.
_FUSED_CHUNK_ELEMENTS = 1 << 22


def _chunks(n_rows: int, vocab: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = chunk_size or max(1, _FUSED_CHUNK_ELEMENTS // max(vocab, 1))
    return [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)] or [(0, 0)]


class _LinearVocabReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, index, threshold, teacher, entropy, chunk_size, group):
        n, vocab = hidden.shape[0], weight.shape[0]
        local, in_shard = _local_index(index, group_rank(group) * vocab, vocab)
        parts = []
        for s, e in _chunks(n, vocab, chunk_size):
            x = torch.nn.functional.linear(hidden[s:e], weight, bias).float()
            x, _ = _filtered_chunk(x, None if threshold is None else threshold[s:e], False)
            parts.append(_shard_stats(x, None if teacher is None else teacher[s:e], local[s:e], in_shard[s:e],
                                      entropy))
        stats, weighted, picked = (torch.cat(p) for p in zip(*parts))
        lse, picked, negent, cross, teacher_lse = _merge_shards(stats, weighted, picked, entropy,
                                                                teacher is not None, group)
        ctx.save_for_backward(hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse)
        ctx.chunk_size, ctx.entropy, ctx.group = chunk_size, entropy, group
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        live = _live(grads)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(vocab, dtype=torch.float32, device=weight.device)
        for s, e in _chunks(n, vocab, ctx.chunk_size):
            x = torch.nn.functional.linear(hidden[s:e], weight, bias).float()
            x, kept = _filtered_chunk(x, None if threshold is None else threshold[s:e], True)
            g = _chunk_grad(
                x, kept, None if teacher is None else teacher[s:e], lse[s:e], negent[s:e], teacher_lse[s:e],
                tuple(g[s:e] for g in grads), local[s:e], in_shard[s:e], live[s:e], ctx.entropy,
            ).to(weight.dtype)
            grad_hidden[s:e] = g @ weight
            grad_weight += (g.t() @ hidden[s:e]).float()
            if grad_bias is not None:
                grad_bias += g.float().sum(0)
        grad_hidden = all_reduce_sum(grad_hidden, ctx.group)  # every vocabulary shard's share
        return (
            grad_hidden, grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None, None,
        )


def linear_vocab_reduce(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    index: Tensor | None = None,
    *,
    threshold: Tensor | None = None,
    teacher: Tensor | None = None,
    entropy: bool = False,
    chunk_size: int | None = None,
    group: Any = None,
) -> VocabStats:
    """`vocab_reduce(hidden @ weightᵀ + bias, index, ...)` for `hidden [N, H]`, `weight
    [V, H]` (this rank's vocabulary shard under a tensor-parallel `group`), `bias [V]`,
    computed `chunk_size` rows at a time (default: ~16 MiB of fp32 logits per chunk) in
    eager and compiled code alike, so no `[N, V]` logits exist at any point; the backward
    recomputes each chunk's logits and returns the gradients of `hidden`, `weight` and
    `bias`. The logits are computed in the parameters' dtype (as an LM head's linear
    layer does) and reduced in fp32."""
    check_chunk_size(chunk_size)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_vocab_reduce: hidden must be [N, H] and weight [V, H] with the same H, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_vocab_reduce: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if index is None:
        index = torch.zeros(hidden.shape[0], 1, dtype=torch.long, device=hidden.device)
    if teacher is not None:
        teacher = teacher.detach()
    if threshold is not None:
        threshold = threshold.detach().float()
    return VocabStats(
        *_LinearVocabReduce.apply(hidden, weight, bias, index, threshold, teacher, entropy, chunk_size, group)
    )
