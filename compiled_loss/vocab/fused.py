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
`dH`, `dW` (and `d bias`): four matmuls. For a loss that is a sum over rows of a function of
each row's own statistics, `linear_vocab_gradient` computes each chunk's gradient while its
logits exist, in the forward: three matmuls, and a backward that only scales them. Each
chunk is a region compiled once and reused (`torch.compiler.nested_compile_region`), so
compile time does not grow with the number of chunks. The statistics, their merge over
tensor-parallel vocabulary shards and the pointwise gradient are `vocab_reduce`'s own
(`compiled_loss.vocab.stats`).
Under TP, `weight` is this rank's vocabulary shard, and the gradients are exactly those the
dense logits `hidden @ weightᵀ` of that shard would give: `dW` of the shard's rows and this
shard's share of `dH` — summed over the group by whoever replicated `hidden` (Megatron's
`copy_to_tensor_model_parallel_region`; the training step's gradient all-reduce).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import torch
from torch._higher_order_ops.scan import scan
from torch.distributed import ProcessGroup

from compiled_loss.parallel import group_rank
from compiled_loss.vocab.sampling import _thresholds
from compiled_loss.vocab.stats import (
    VocabStats,
    _chunk_grad,
    _filtered_chunk,
    _live,
    _local_index,
    _merge_shards,
    _row_slice,
    _RowGrad,
    _shard_stats,
)

Tensor = torch.Tensor

# Default rows per chunk: fp32 logit tiles of ~16 MiB. Any chunk size — the default or the
# caller's — is raised to at least N / _MAX_CHUNKS rows (and the backward's vocabulary column
# chunks to V / _MAX_CHUNKS): each chunk of the gradient in the forward differentiates the
# loss over all N rows, and thin chunks starve the matmuls. Compile time does not depend on
# the number (a loop / a region compiled once). Chunking is a memory knob; the values do not
# depend on it.
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
    softcap: float | None = None
    """The model's final-logit softcapping (Gemma's `final_logit_softcapping`): the logits are
    `softcap · tanh(z / softcap)` of the projection `z`, inside each chunk, with its gradient."""
    scale: float = 1.0
    """A factor of the logits after the softcap (a temperature divides it; without a softcap,
    scaling folds into the hidden states and the bias instead)."""
    objective: Callable[..., Tensor] | None = dataclasses.field(default=None, repr=False)
    """Set by the micro-batch entry point for a loss that is a sum over tokens
    (`InputSpec.token_separable`): the loss as a function of its inputs and data,
    `objective(loss_input, data)`, which lets input preparation compute the gradient in the
    forward (`linear_vocab_gradient`)."""

    def __post_init__(self) -> None:
        if self.hidden.dim() < 1 or self.weight.dim() != 2 or self.hidden.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"LinearLogits: hidden must be [..., H] and weight [V, H] with the same H, got "
                f"{tuple(self.hidden.shape)} and {tuple(self.weight.shape)}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(f"LinearLogits: bias must be [{self.weight.shape[0]}], got {tuple(self.bias.shape)}")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and 0 < self.softcap < math.inf):
            raise ValueError(f"LinearLogits: softcap must be a finite float > 0 or None, got {self.softcap!r}")
        if not (isinstance(self.scale, (int, float)) and 0 < self.scale < math.inf):
            raise ValueError(f"LinearLogits: scale must be a finite float > 0, got {self.scale!r}")
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
        """The logits divided by `temperature` (hidden states and bias scaled; after a softcap, `scale`)."""
        if self.softcap is not None:
            return dataclasses.replace(self, scale=self.scale / temperature)
        bias = None if self.bias is None else self.bias / temperature
        return dataclasses.replace(self, hidden=self.hidden / temperature, bias=bias)

    @property
    def head(self) -> tuple[float | None, float]:
        """`(softcap, scale)`: what turns the projection into the logits (`_head`)."""
        return self.softcap, self.scale

    def logits(self) -> Tensor:
        """The logits themselves, `[..., V]` (for a consumer that reads every logit)."""
        return self.linear(self.weight, self.bias)

    def linear(self, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The logits (`hidden @ weightᵀ + bias`, softcapped and scaled) in their dtype, for these
        or other rows of the head."""
        hidden, weight, bias = _cast(self.dtype, self.hidden, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            return _head(torch.nn.functional.linear(hidden, weight, bias), self.head)


def _head(z: Tensor, head: tuple[float | None, float]) -> Tensor:
    """The logits of the projection `z`: `scale · softcap · tanh(z / softcap)` (no tanh without a softcap)."""
    softcap, scale = head
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z * scale if scale != 1.0 else z


def _head_grad(z: Tensor, g: Tensor, head: tuple[float | None, float]) -> Tensor:
    """The gradient w.r.t. the projection `z` from `g`, the one w.r.t. the logits `_head(z, head)`."""
    softcap, scale = head
    if scale != 1.0:
        g = g * scale
    if softcap is not None:
        g = g * (1 - torch.tanh(z / softcap).square())
    return g


def _cast(
    dtype: torch.dtype | None, hidden: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The head's factors in `dtype` (`LinearLogits.dtype`, set once the `LinearLogits` is
    built); differentiable: each gradient comes back in its factor's own dtype."""
    assert dtype is not None
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@overload
def per_position(logits: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor: ...
@overload
def per_position(logits: LinearLogits, fn: Callable[[Tensor], Tensor]) -> LinearLogits: ...
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


# Each chunk's work is a region compiled once and reused by every chunk of its shape (the
# last, shorter chunk gets a second one): compile time does not grow with the chunks' number.


class _Options(NamedTuple):
    """The constants of one `linear_vocab_reduce`: the top-k / top-p filter (None without
    one), whether the entropy is wanted, the rows per chunk (None: the default) and the
    head's `(softcap, scale)` (`LinearLogits.head`)."""

    top_k_top_p: tuple[int | None, float | None] | None
    entropy: bool
    chunk_size: int | None
    head: tuple[float | None, float]


@torch.compiler.nested_compile_region
def _reduce_chunk(h, weight, bias, local, in_shard, teacher, group, options):
    """One row chunk's statistics (`_shard_stats`) and its top-k / top-p thresholds (None
    without a filter), taken from the very logits they filter."""
    x = _head(torch.nn.functional.linear(h, weight, bias).float(), options.head)
    threshold = None if options.top_k_top_p is None else _thresholds(x, *options.top_k_top_p, group=group)
    x, _ = _filtered_chunk(x, threshold, False)
    stats = _shard_stats(x, teacher, local, in_shard, options.entropy)
    return *stats, *([] if threshold is None else [threshold])


@torch.compiler.nested_compile_region
def _column_grad_chunk(hidden, weight, bias, rows, grad_hidden, options):
    """One vocabulary column chunk of the backward: `dH` accumulated (fp32), this chunk's
    rows of `dW` and `d bias`."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    g = _chunk_grad(_head(z, options.head), None, rows, options.entropy)
    g = _head_grad(z, g, options.head).to(weight.dtype)
    grad_bias = [] if bias is None else [g.float().sum(0).to(bias.dtype)]
    return grad_hidden + (g @ weight).float(), g.t() @ hidden, *grad_bias


@torch.compiler.nested_compile_region
def _row_grad_chunk(h, weight, bias, threshold, rows, grad_weight, grad_bias, options):
    """One row chunk of the backward under top-k / top-p (the keep mask from the same logits
    as in the forward): its rows of `dH`, `dW` and `d bias` accumulated (fp32)."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    x, kept = _filtered_chunk(_head(z, options.head), threshold, True)
    g = _chunk_grad(x, kept, rows, options.entropy)
    g = _head_grad(z, g, options.head).to(weight.dtype)
    grad_bias = [] if grad_bias is None else [grad_bias + g.float().sum(0)]
    return g @ weight, grad_weight + (g.t() @ h).float(), *grad_bias


class _LinearVocabReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, index, teacher, group, options):
        n, vocab = hidden.shape[0], weight.shape[0]
        local, in_shard = _local_index(index, group_rank(group) * vocab, vocab)
        parts = [
            _reduce_chunk(
                hidden[s:e],
                weight,
                bias,
                local[s:e],
                in_shard[s:e],
                None if teacher is None else teacher[s:e],
                group,
                options,
            )
            for s, e in _chunks(n, vocab, options.chunk_size)
        ]
        stats, weighted, picked = (torch.cat(p) for p in list(zip(*parts))[:3])
        threshold = None if options.top_k_top_p is None else torch.cat([p[3] for p in parts])
        lse, picked, negent, cross, teacher_lse = _merge_shards(
            stats, weighted, picked, options.entropy, teacher is not None, group
        )
        ctx.save_for_backward(hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse)
        ctx.options = options
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, local, in_shard, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        # the per-row inputs as tensors of their own: the compiled chunk regions take no two
        # arguments that alias each other (upstream gradients may be views of one buffer)
        grads = tuple(g.clone() for g in grads)
        rows = _RowGrad(teacher, lse, negent, teacher_lse, grads, local, in_shard, _live(grads))
        if threshold is None:
            grad_hidden, grad_weight, grad_bias = _vocab_chunked_backward(hidden, weight, bias, rows, ctx.options)
        else:  # the keep mask must be recomputed from the forward's own row chunks
            grad_hidden, grad_weight, grad_bias = _row_chunked_backward(
                hidden, weight, bias, threshold, rows, ctx.options
            )
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _vocab_chunked_backward(hidden, weight, bias, rows, options):
    """dH, dW, d bias over column chunks of the vocabulary (as many logits per chunk as a
    row chunk holds): each chunk's rows of dW and d bias are computed once — no dW-sized
    partial sums — and only the small `[N, H]` dH accumulates (in fp32)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    step = max(1, _chunk_rows(n, vocab, options.chunk_size) * vocab // max(n, 1), -(-vocab // _MAX_CHUNKS))
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight, grad_bias = [], []
    for a in range(0, vocab, step):
        b = min(a + step, vocab)
        chunk_index, in_chunk = _local_index(rows.local, a, b - a)
        chunk_rows = _RowGrad(
            None if rows.teacher is None else rows.teacher[:, a:b],
            rows.lse,
            rows.negent,
            rows.teacher_lse,
            rows.grads,
            chunk_index,
            in_chunk & rows.in_shard,
            rows.live,
        )
        grad_hidden, grad_w, *grad_b = _column_grad_chunk(
            hidden,
            weight[a:b],
            None if bias is None else bias[a:b],
            chunk_rows,
            grad_hidden,
            options,
        )
        grad_weight.append(grad_w)
        grad_bias += grad_b
    return (grad_hidden.to(hidden.dtype), torch.cat(grad_weight), None if bias is None else torch.cat(grad_bias))


def _row_chunked_backward(hidden, weight, bias, threshold, rows, options):
    """dH, dW, d bias over the forward's row chunks (each chunk's keep mask from the same
    logits as in the forward)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = None if bias is None else torch.zeros(vocab, dtype=torch.float32, device=weight.device)
    grad_rows = []
    for s, e in _chunks(n, vocab, options.chunk_size):
        grad_h, grad_weight, *grad_b = _row_grad_chunk(
            hidden[s:e], weight, bias, threshold[s:e], _row_slice(rows, s, e), grad_weight, grad_bias, options
        )
        grad_rows.append(grad_h)
        grad_bias = grad_b[0] if grad_b else None
    return torch.cat(grad_rows), grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype)


def linear_vocab_reduce(
    logits: LinearLogits,
    index: Tensor,
    top_k_top_p: tuple[int | None, float | None] | None,
    teacher: Tensor | None,
    entropy: bool,
    chunk_size: int | None,
    group: ProcessGroup | None,
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
            *_LinearVocabReduce.apply(
                hidden, weight, bias, index, teacher, group, _Options(top_k_top_p, entropy, chunk_size, logits.head)
            )
        )


def _scan(
    fn: Callable[..., Any], init: list[Tensor], xs: tuple[Tensor, ...]
) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """`scan(fn, init, xs)`: compiled, one loop in the graph whatever the number of steps; in
    eager mode a Python loop (plain tensor operations, seen as such by any dispatch mode)."""
    if torch.compiler.is_compiling():
        return scan(fn, init, xs)
    carry, ys = init, []
    for i in range(xs[0].shape[0]):
        carry, y = fn(carry, tuple(x[i] for x in xs))
        ys.append(y)
    return carry, tuple(torch.stack(y) for y in zip(*ys))


class _GradientCarrier(torch.autograd.Function):
    """A zero whose gradients w.r.t. `hidden`, `weight` and `bias` are the upstream gradient
    times the ones computed in the forward (`linear_vocab_gradient`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        # An empty sum: exactly 0, and read from an input (a fresh zeros tensor comes out of
        # an Inductor-compiled graph without a grad_fn)
        return hidden.flatten()[:0].float().sum()

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scaled = [None if g is None else (g * grad).to(g.dtype) for g in (grad_hidden, grad_weight, grad_bias)]
        return *scaled, None, None, None


def linear_vocab_gradient(
    logits: LinearLogits,
    index: Tensor,
    objective: Callable[[VocabStats], Tensor],
    chunk_size: int | None,
    group: ProcessGroup | None,
) -> tuple[VocabStats, Tensor]:
    """`linear_vocab_reduce` for a scalar `objective` of the row statistics that is a sum over
    rows of a function of each row's own statistics: the gradient in the forward, three
    matmuls per chunk instead of four.

    Each chunk of `hidden [N, H]` rows gets its logits (one matmul) and its statistics; the
    objective's gradient w.r.t. them — `objective` evaluated with this chunk's statistics in
    their rows (zeros elsewhere: by the sum-over-rows contract no other row's value changes
    it) — gives the chunk's logit gradient, and from it `dH` and the chunk's share of `dW`
    (two matmuls). Returns the statistics (detached) and a zero that carries the gradients:
    added to the loss, its backward hands `hidden`, `weight` and `bias` the upstream gradient
    times the forward's. The chunks are a loop (`scan`): compiled once whatever their number;
    the chunks are balanced and the last padded with zero rows."""
    if logits.hidden.dim() != 2:
        raise ValueError(f"linear_vocab_gradient: hidden must be [N, H], got {tuple(logits.hidden.shape)}")
    hidden, weight, bias = _cast(logits.dtype, logits.hidden, logits.weight, logits.bias)
    n, vocab = hidden.shape[0], weight.shape[0]
    count = max(1, -(-n // _chunk_rows(n, vocab, chunk_size)))
    step = max(1, -(-n // count))  # balanced chunks: fewer than `count` padding rows
    pad = count * step - n
    local, in_shard = _local_index(index, group_rank(group) * vocab, vocab)
    rows = torch.nn.functional.pad(hidden.detach(), (0, 0, 0, pad))
    local = torch.nn.functional.pad(local, (0, 0, 0, pad))
    in_shard = torch.nn.functional.pad(in_shard, (0, 0, 0, pad))
    positions = torch.arange(count * step, device=hidden.device)
    w, b = weight.detach(), None if bias is None else bias.detach()

    def placed(stats: VocabStats, at: Tensor) -> VocabStats:  # a chunk's statistics in their rows, zeros elsewhere
        return VocabStats(*(t.new_zeros((count * step,) + t.shape[1:]).index_copy(0, at, t)[:n] for t in stats))

    def chunk(accumulated: list[Tensor], xs: tuple[Tensor, ...]) -> tuple[list[Tensor], tuple[Tensor, ...]]:
        h, local, in_shard, at = xs
        z = torch.nn.functional.linear(h, w, b).float()
        x = _head(z, logits.head)
        stats = VocabStats(*_merge_shards(*_shard_stats(x, None, local, in_shard, False), False, False, group)[:4])
        grads = tuple(torch.func.grad(lambda chunk_stats: objective(placed(chunk_stats, at)))(stats))
        rows = _RowGrad(None, stats.lse, stats.negent, None, grads, local, in_shard, _live(grads))
        g = _chunk_grad(x, None, rows, False)
        g = _head_grad(z, g, logits.head).to(w.dtype)
        grad_weight, *grad_bias = accumulated
        if h.dtype == torch.float32:
            grad_weight = torch.addmm(grad_weight, g.t(), h)
        else:  # accumulated in fp32
            grad_weight = grad_weight + (g.t() @ h).float()
        return [grad_weight, *(d + g.float().sum(0) for d in grad_bias)], (*stats, g @ w)

    zeros = [torch.zeros(w.shape, dtype=torch.float32, device=w.device)]
    if b is not None:
        zeros.append(torch.zeros(vocab, dtype=torch.float32, device=w.device))
    xs = (rows, local, in_shard, positions)
    (grad_weight, *grad_bias), (*stats, grad_hidden) = _scan(
        chunk, zeros, tuple(t.unflatten(0, (count, step)) for t in xs)
    )
    bias_grad = grad_bias[0].to(bias.dtype) if bias is not None else None
    carrier = _GradientCarrier.apply(
        hidden, weight, bias, grad_hidden.flatten(0, 1)[:n], grad_weight.to(weight.dtype), bias_grad
    )
    return VocabStats(*(t.flatten(0, 1)[:n] for t in stats)), carrier
