"""Logits from hidden states without ever holding them: `LinearLogits` and
`linear_vocab_reduce`.

`LinearLogits(hidden, weight, bias)` stands for the logits `hidden @ weightᵀ + bias` of an
LM head, kept as their factors. The vocab primitives (`vocab_reduce`, `token_logprobs`)
accept it in place of a logits tensor, and so do input preparation and the packing
wrappers, which only ever reshape, slice, pack or shard its positions (`per_position`).
The statistics come from `linear_vocab_reduce`: the rows go through the LM-head
projection one static chunk at a time, each chunk's logits exist only while its
statistics — and its top-k / top-p thresholds (`top_k_top_p`), taken from the very logits
they filter — are computed, and the backward recomputes them chunk by chunk to produce
`dH`, `dW` (and `d bias`). The statistics, their merge over tensor-parallel vocabulary
shards and the pointwise gradient are `vocab_reduce`'s own (`compiled_loss.vocab.stats`).
Under TP, `weight` is this rank's vocabulary shard, and the gradients are exactly those the
dense logits `hidden @ weightᵀ` of that shard would give: `dW` of the shard's rows and this
shard's share of `dH` — summed over the group by whoever replicated `hidden` (Megatron's
`copy_to_tensor_model_parallel_region`; the training step's gradient all-reduce).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from compiled_loss.parallel import group_rank
from compiled_loss.vocab.sampling import _thresholds
from compiled_loss.vocab.stats import (
    VocabStats,
    _chunk_grad,
    _filtered_chunk,
    _live,
    _local_index,
    _merge_shards,
    _shard_stats,
)

Tensor = torch.Tensor

# Default rows per chunk: fp32 logit tiles of ~16 MiB. Any chunk size — the default or the
# caller's — is raised to at least N / _MAX_CHUNKS rows (and the backward's vocabulary column
# chunks to V / _MAX_CHUNKS): each chunk is unrolled in the compiled graph, so compile time
# grows with their number (115 s for 64 chunks against 36 s for 16 at N=2048, V=128256; one
# row per chunk took 50 s at N=256). Chunking is a memory knob; the values do not depend on it.
_FUSED_CHUNK_ELEMENTS = 1 << 22
_MAX_CHUNKS = 16


@dataclasses.dataclass(frozen=True, eq=False)
class LinearLogits:
    """The logits `hidden @ weightᵀ + bias` of an LM head, kept as their factors.

    `hidden [..., H]` (any leading positions: `[B, S, H]` unpacked, `[1, T, H]` packed),
    `weight [V, H]` — this rank's vocabulary shard `[V / tp, H]` under tensor parallelism —
    and an optional `bias [V]`. `shape` is the shape of the logits it stands for, `dtype`
    their dtype: the one `torch.nn.functional.linear(hidden, weight, bias)` gives where the
    `LinearLogits` is built — inside `torch.autocast`, the autocast dtype (bf16 hidden
    states and an fp32 head, say); outside it, the one dtype of the three (mixed dtypes are
    refused, as `linear` refuses them); or pass `dtype`. The projection runs in that dtype
    whatever the autocast state where it is consumed, the statistics are reduced in fp32,
    and each factor's gradient comes back in its own dtype (the dense path's gradients)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.hidden.dim() < 1 or self.weight.dim() != 2 or self.hidden.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"LinearLogits: hidden must be [..., H] and weight [V, H] with the same H, got "
                f"{tuple(self.hidden.shape)} and {tuple(self.weight.shape)}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(f"LinearLogits: bias must be [{self.weight.shape[0]}], got {tuple(self.bias.shape)}")
        if self.dtype is None:
            device = self.hidden.device.type
            if torch.is_autocast_enabled(device):
                object.__setattr__(self, "dtype", torch.get_autocast_dtype(device))
            elif len({t.dtype for t in (self.hidden, self.weight, self.bias) if t is not None}) > 1:
                raise TypeError(
                    f"LinearLogits: hidden ({self.hidden.dtype}), weight ({self.weight.dtype}) and bias "
                    f"({None if self.bias is None else self.bias.dtype}) must share one dtype outside torch.autocast, "
                    "as torch.nn.functional.linear requires: build it inside the autocast region, or pass dtype="
                )
            else:
                object.__setattr__(self, "dtype", self.weight.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.hidden.shape[:-1] + self.weight.shape[:1]

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def dim(self) -> int:
        return self.hidden.dim()

    def __truediv__(self, temperature: float) -> LinearLogits:
        """The logits divided by `temperature` (hidden states and bias scaled)."""
        bias = None if self.bias is None else self.bias / temperature
        return dataclasses.replace(self, hidden=self.hidden / temperature, bias=bias)

    def logits(self) -> Tensor:
        """The logits themselves, `[..., V]` (for a consumer that reads every logit)."""
        return self.linear(self.weight, self.bias)

    def linear(self, weight: Tensor, bias: Tensor | None) -> Tensor:
        """`hidden @ weightᵀ + bias` in the logits' dtype, for these or other rows of the head."""
        hidden, weight, bias = _cast(self.dtype, self.hidden, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden, weight, bias)


def _cast(dtype: torch.dtype, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Each tensor in `dtype` (differentiable: its gradient comes back in its own dtype)."""
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def per_position(logits: Tensor | LinearLogits, fn: Callable[[Tensor], Tensor]) -> Tensor | LinearLogits:
    """`fn` (a reshape, slice, gather or shard over the leading positions, never over the
    last dimension) applied to logits, or to the hidden states a `LinearLogits` holds."""
    if isinstance(logits, LinearLogits):
        return dataclasses.replace(logits, hidden=fn(logits.hidden))
    return fn(logits)


def _chunk_rows(n_rows: int, vocab: int, chunk_size: int | None) -> int:
    """Rows per chunk: `chunk_size` (default ~16 MiB of fp32 logits), but at most `_MAX_CHUNKS` chunks."""
    return max(chunk_size or max(1, _FUSED_CHUNK_ELEMENTS // max(vocab, 1)), -(-n_rows // _MAX_CHUNKS))


def _chunks(n_rows: int, vocab: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Row ranges of `_chunk_rows` rows, compiled or not."""
    step = _chunk_rows(n_rows, vocab, chunk_size)
    return [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)] or [(0, 0)]


class _LinearVocabReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, index, top_k_top_p, teacher, entropy, chunk_size, group):
        n, vocab = hidden.shape[0], weight.shape[0]
        local, in_shard = _local_index(index, group_rank(group) * vocab, vocab)
        parts, thresholds = [], []
        for s, e in _chunks(n, vocab, chunk_size):
            x = torch.nn.functional.linear(hidden[s:e], weight, bias).float()
            if top_k_top_p is not None:  # from the very logits it filters (a recompute may differ in the last bit)
                thresholds.append(_thresholds(x, *top_k_top_p, group=group))
            x, _ = _filtered_chunk(x, thresholds[-1] if thresholds else None, False)
            parts.append(_shard_stats(x, None if teacher is None else teacher[s:e], local[s:e], in_shard[s:e], entropy))
        stats, weighted, picked = (torch.cat(p) for p in zip(*parts))
        threshold = torch.cat(thresholds) if thresholds else None
        lse, picked, negent, cross, teacher_lse = _merge_shards(
            stats, weighted, picked, entropy, teacher is not None, group
        )
        ctx.save_for_backward(hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse)
        ctx.chunk_size, ctx.entropy = chunk_size, entropy
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        if threshold is None:
            grad_hidden, grad_weight, grad_bias = _vocab_chunked_backward(
                hidden,
                weight,
                bias,
                local,
                in_shard,
                teacher,
                lse,
                negent,
                teacher_lse,
                grads,
                ctx.entropy,
                ctx.chunk_size,
            )
        else:  # the keep mask must be recomputed from the forward's own row chunks
            grad_hidden, grad_weight, grad_bias = _row_chunked_backward(
                hidden,
                weight,
                bias,
                local,
                in_shard,
                threshold,
                teacher,
                lse,
                negent,
                teacher_lse,
                grads,
                ctx.entropy,
                ctx.chunk_size,
            )
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _vocab_chunked_backward(
    hidden, weight, bias, local, in_shard, teacher, lse, negent, teacher_lse, grads, entropy, chunk_size
):
    """dH, dW, d bias over column chunks of the vocabulary (as many logits per chunk as a
    row chunk holds): each chunk's rows of dW and d bias are computed once — no dW-sized
    partial sums — and only the small `[N, H]` dH accumulates (in fp32)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    live = _live(grads)
    step = max(1, _chunk_rows(n, vocab, chunk_size) * vocab // max(n, 1), -(-vocab // _MAX_CHUNKS))
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight, grad_bias = [], []
    for a in range(0, vocab, step):
        b = min(a + step, vocab)
        x = torch.nn.functional.linear(hidden, weight[a:b], None if bias is None else bias[a:b]).float()
        chunk_index, in_chunk = _local_index(local, a, b - a)
        g = _chunk_grad(
            x,
            None,
            None if teacher is None else teacher[:, a:b],
            lse,
            negent,
            teacher_lse,
            grads,
            chunk_index,
            in_chunk & in_shard,
            live,
            entropy,
        ).to(weight.dtype)
        grad_hidden = grad_hidden + (g @ weight[a:b]).float()
        grad_weight.append(g.t() @ hidden)
        if bias is not None:
            grad_bias.append(g.float().sum(0).to(bias.dtype))
    return (grad_hidden.to(hidden.dtype), torch.cat(grad_weight), None if bias is None else torch.cat(grad_bias))


def _row_chunked_backward(
    hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse, grads, entropy, chunk_size
):
    """dH, dW, d bias over the forward's row chunks (each chunk's keep mask from the same
    logits as in the forward)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    live = _live(grads)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = None if bias is None else torch.zeros(vocab, dtype=torch.float32, device=weight.device)
    for s, e in _chunks(n, vocab, chunk_size):
        x = torch.nn.functional.linear(hidden[s:e], weight, bias).float()
        x, kept = _filtered_chunk(x, threshold[s:e], True)
        g = _chunk_grad(
            x,
            kept,
            None if teacher is None else teacher[s:e],
            lse[s:e],
            negent[s:e],
            teacher_lse[s:e],
            tuple(g[s:e] for g in grads),
            local[s:e],
            in_shard[s:e],
            live[s:e],
            entropy,
        ).to(weight.dtype)
        grad_hidden[s:e] = g @ weight
        grad_weight += (g.t() @ hidden[s:e]).float()
        if grad_bias is not None:
            grad_bias += g.float().sum(0)
    return grad_hidden, grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype)


def linear_vocab_reduce(
    logits: LinearLogits,
    index: Tensor,
    top_k_top_p: tuple[int | None, float | None] | None,
    teacher: Tensor | None,
    entropy: bool,
    chunk_size: int | None,
    group: Any,
) -> VocabStats:
    """`vocab_reduce` of `LinearLogits` with `[N, H]` hidden states (called by it, arguments
    checked there), computed `chunk_size` rows at a time (default: ~16 MiB of fp32 logits
    per chunk; more rows per chunk where that would make more than 16 chunks) in eager and
    compiled code alike, so no `[N, V]` logits exist at any point; the backward recomputes
    the logits (over at most 16 vocabulary column chunks, or the forward's row chunks under
    top-k / top-p) and returns the gradients of `hidden`, `weight` and `bias`, each in its
    own dtype. `top_k_top_p` thresholds come from each chunk's logits in the same pass."""
    if logits.hidden.dim() != 2:
        raise ValueError(f"linear_vocab_reduce: hidden must be [N, H], got {tuple(logits.hidden.shape)}")
    hidden, weight, bias = _cast(logits.dtype, logits.hidden, logits.weight, logits.bias)
    with torch.autocast(hidden.device.type, enabled=False):  # the projection in the logits' own dtype
        return VocabStats(
            *_LinearVocabReduce.apply(hidden, weight, bias, index, top_k_top_p, teacher, entropy, chunk_size, group)
        )
