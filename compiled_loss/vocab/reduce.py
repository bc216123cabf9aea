"""The one primitive for vocab work (DESIGN principle 5).

`vocab_reduce` reads a `[N, V]` logits tensor (any float dtype) once and returns the
per-row statistics every loss is built from:

- `lse`     `[N]`    log-sum-exp (log-partition) of the row,
- `picked`  `[N, K]` raw logits at `index` (selected tokens, top-k indices),
- `negent`  `[N]`    `Σ_v p_v log p_v` (negative entropy), when `entropy=True`,
- `cross`   `[N]`    `Σ_v p^teacher_v · x_v` for a detached teacher row, when `teacher` given.

so that e.g. `logprob = picked - lse` and `soft-CE = lse - cross`.

Under tensor parallelism each rank holds a vocabulary shard and the statistics are those of
the full vocabulary (two all-reduces of `[N]`-sized vectors, `group=`).

It is an `autograd.Function` that saves only the inputs and `[N]` statistics and
recomputes the softmax in a pointwise backward, so no fp32 `[N, V]` copy of the logits is
ever kept. Under torch.compile the forward and backward each fuse into one kernel; in eager
mode both loop over `chunk_size` rows so the fp32 working set stays `chunk_size × V`.

An optional per-row `threshold` implements top-k / top-p filtering: entries below it are
treated as `-inf` (and receive no gradient).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from compiled_loss.parallel import check_agreement, group_rank, group_size
from compiled_loss.parallel.collectives import all_gather, all_reduce_max, all_reduce_sum
from compiled_loss.vocab.fused import LinearLogits, linear_vocab_reduce
from compiled_loss.vocab.sampling import _thresholds
from compiled_loss.vocab.stats import (
    VocabStats,
    _chunk_grad,
    _filtered_chunk,
    _live,
    _local_index,
    _merge_shards,
    _row_chunks,
    _row_slice,
    _RowGrad,
    _shard_stats,
    _xlogp_safe,
    check_chunk_size,
)

Tensor = torch.Tensor


class _VocabReduce(torch.autograd.Function):
    """Per row: a pass over this rank's vocabulary shard gives its max `m` and, relative to
    it, `Σ e^(x-m)`, `Σ e^(x-m)·x`, the teacher's max and `Σ e^(t-mt)`, `Σ e^(t-mt)·x`, and
    the logits at the indices it holds; the shards merge with one max and one sum
    all-reduce of `[N]`-sized statistics (no collective at all without a group). The
    backward is pointwise on the shard: every statistic it needs is global."""

    @staticmethod
    def forward(ctx, logits, index, threshold, teacher, entropy, chunk_size, group):
        n, vocab = logits.shape
        local, in_shard = _local_index(index, group_rank(group) * vocab, vocab)
        parts = []
        for s, e in _row_chunks(n, vocab, chunk_size):
            x, _ = _filtered_chunk(logits[s:e].float(), None if threshold is None else threshold[s:e], False)
            parts.append(_shard_stats(x, None if teacher is None else teacher[s:e], local[s:e], in_shard[s:e], entropy))
        stats, weighted, picked = (torch.cat(p) for p in zip(*parts))
        lse, picked, negent, cross, teacher_lse = _merge_shards(
            stats, weighted, picked, entropy, teacher is not None, group
        )
        ctx.save_for_backward(logits, local, in_shard, threshold, teacher, lse, negent, teacher_lse)
        ctx.chunk_size, ctx.entropy = chunk_size, entropy
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, *grads):
        logits, local, in_shard, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        n, vocab = logits.shape
        rows = _RowGrad(teacher, lse, negent, teacher_lse, grads, local, in_shard, _live(grads))
        grad = torch.empty_like(logits)
        for s, e in _row_chunks(n, vocab, ctx.chunk_size):
            x, kept = _filtered_chunk(logits[s:e].float(), None if threshold is None else threshold[s:e], True)
            grad[s:e] = _chunk_grad(x, kept, _row_slice(rows, s, e), ctx.entropy).to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_reduce(
    logits: Tensor | LinearLogits,
    index: Tensor | None = None,
    *,
    threshold: Tensor | None = None,
    top_k_top_p: tuple[int | None, float | None] | None = None,
    teacher: Tensor | None = None,
    entropy: bool = False,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
) -> VocabStats:
    """Row statistics of `logits [N, V]`; see the module docstring.

    `index [N, K]` (long) selects `picked`; `threshold [N]` filters (top-k/top-p);
    `teacher [N, V]` (detached) gives `cross`; `entropy` computes `negent`.
    `chunk_size` (rows) bounds the eager-mode fp32 working set; ignored when compiling.
    With a tensor-parallel `group`, `logits` (and `teacher`) are this rank's vocabulary
    shard `[N, V / tp]` (rank `r` holds ids `[r·V/tp, (r+1)·V/tp)`: every shard equally
    wide), `index` holds GLOBAL ids, and every statistic is the full vocabulary's; the
    gradient is this shard's slice of the full one.

    An eager call checks, on the host and before any collective, that every id of `index`
    lies in `[0, V)` and that every rank of `group` holds an equally wide shard of as many
    rows, in the same dtype, with the same other inputs — a ValueError (the same on every
    rank) otherwise. Compiled code skips these checks: its caller checks on the host.

    `top_k_top_p = (top_k, top_p)` filters with `sampling_threshold`'s thresholds instead of
    a given `threshold`.

    `logits` may be a `LinearLogits` (`[N, H]` hidden states and the LM head): the same
    statistics without the `[N, V]` logits, `chunk_size` rows at a time compiled or not
    (raised to `N / 16` rows where it would make more than 16 chunks; the values do not
    depend on the chunking), with the
    gradients of the hidden states, weight and bias (`linear_vocab_reduce`); its filter is
    `top_k_top_p` (thresholds taken from each chunk's logits in the same pass).
    """
    if threshold is not None and top_k_top_p is not None:
        raise ValueError("vocab_reduce: pass threshold or top_k_top_p, not both")
    check_chunk_size(chunk_size)
    if isinstance(logits, LinearLogits) and threshold is not None:
        raise ValueError(
            "vocab_reduce: LinearLogits filter with top_k_top_p=(top_k, top_p), not a threshold: the logits "
            "each chunk recomputes may differ in the last bit from those a threshold was taken from"
        )
    if not torch.compiler.is_compiling():
        _check_shards(
            logits, index, group, threshold=threshold, teacher=teacher, top_k_top_p=top_k_top_p, chunk_size=chunk_size
        )
    if index is None:
        index = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
    if teacher is not None:
        teacher = teacher.detach()
    if isinstance(logits, LinearLogits):
        return linear_vocab_reduce(logits, index, top_k_top_p, teacher, entropy, chunk_size, group)
    if top_k_top_p is not None:
        threshold = _thresholds(logits, *top_k_top_p, group=group)
    if threshold is not None:
        threshold = threshold.detach().float()
    return VocabStats(*_VocabReduce.apply(logits, index, threshold, teacher, entropy, chunk_size, group))


def _check_shards(
    logits: Tensor | LinearLogits, index: Tensor | None, group: ProcessGroup | None, **inputs: Any
) -> None:
    """Eager, host side (one device sync): `vocab_reduce`'s preconditions. Every rank of a
    tensor-parallel `group` holds an equally wide vocabulary shard — rank `r` holds ids
    `[r·V/tp, (r+1)·V/tp)` — of as many rows, in the same dtype, with the same other inputs
    (the collectives' shapes follow them); and every id of `index` lies in the full
    vocabulary `[0, V)`. A ValueError on every rank otherwise, before any collective."""
    factors = (
        {"logits.hidden": logits.hidden, "logits.weight": logits.weight, "logits.bias": logits.bias}
        if isinstance(logits, LinearLogits)
        else {"logits": logits}
    )
    vocab = logits.shape[-1] * group_size(group)
    outside = 0 if index is None else int(((index < 0) | (index >= vocab)).sum())  # host
    check_agreement(
        "vocab_reduce's inputs (each rank's logits are its vocabulary shard [N, V / tp]: equally wide, with the "
        "same rows, dtype and other inputs on every rank)",
        {**factors, "index": index, **inputs, "ids outside the vocabulary": outside},
        group,
    )
    if outside:
        shards = f", {group_size(group)} tensor-parallel shards of {logits.shape[-1]}" if group_size(group) > 1 else ""
        raise ValueError(
            f"vocab_reduce: index holds ids outside the vocabulary [0, {vocab}) ({outside} of "
            f"{0 if index is None else index.numel()}{shards})"
        )


def token_logprobs(
    logits: Tensor | LinearLogits,
    targets: Tensor,
    *,
    threshold: Tensor | None = None,
    top_k_top_p: tuple[int | None, float | None] | None = None,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
) -> Tensor:
    """`log softmax(logits)[target]` per row, fp32 `[N]` (`-inf` for a filtered target);
    filters and `group`: see `vocab_reduce`."""
    stats = vocab_reduce(
        logits, targets[:, None], threshold=threshold, top_k_top_p=top_k_top_p, chunk_size=chunk_size, group=group
    )
    return stats.picked[:, 0] - stats.lse


@torch.no_grad()
def vocab_topk(logits: Tensor, k: int, group: ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
    """The `min(k, V)` largest logits of each row and their GLOBAL vocabulary ids (ref §8.8),
    fp32 values in descending order; with a tensor-parallel `group`, over the full
    vocabulary of the row's shards (an eager call first checks that every rank holds an
    equally wide shard of as many rows: a ValueError on every rank otherwise)."""
    check_agreement(
        "vocab_topk's inputs (each rank's logits are its vocabulary shard [..., V / tp]: equally wide, with the same "
        "rows, dtype and k on every rank)",
        {"logits": logits, "k": k},
        group,
    )
    vocab = logits.shape[-1]
    values, ids = torch.topk(logits.float(), min(k, vocab), -1)
    shards = group_size(group)
    if shards == 1:
        return values, ids
    ids = ids + group_rank(group) * vocab
    values = all_gather(values, group).movedim(0, -2).flatten(-2)  # [..., tp·k]
    ids = all_gather(ids, group).movedim(0, -2).flatten(-2)
    top, where = torch.topk(values, min(k, vocab * shards), -1)
    return top, ids.gather(-1, where)


class _TotalVariation(torch.autograd.Function):
    """`Σ_v |softmax(x)_v - softmax(t)_v|` per row, `t` detached. Saves the inputs and two
    `[N]` log-partitions; the backward recomputes both softmaxes per row chunk:
    `∂/∂x_i = p_i·(s_i - Σ_v s_v p_v)` with `s = sign(p - q)`."""

    @staticmethod
    def forward(ctx, logits, teacher, chunk_size):
        n, vocab = logits.shape
        tv, lse, teacher_lse = [], [], []
        for s, e in _row_chunks(n, vocab, chunk_size):
            x, t = logits[s:e].float(), teacher[s:e].float()
            lx, lt = torch.logsumexp(x, -1), torch.logsumexp(t, -1)
            tv.append((torch.exp(x - lx[:, None]) - torch.exp(t - lt[:, None])).abs().sum(-1))
            lse.append(lx)
            teacher_lse.append(lt)
        lse, teacher_lse = torch.cat(lse), torch.cat(teacher_lse)
        ctx.save_for_backward(logits, teacher, lse, teacher_lse)
        ctx.chunk_size = chunk_size
        return torch.cat(tv)

    @staticmethod
    def backward(ctx, grad_tv):
        logits, teacher, lse, teacher_lse = ctx.saved_tensors
        n, vocab = logits.shape
        grads = []
        for s, e in _row_chunks(n, vocab, ctx.chunk_size):
            p = torch.exp(logits[s:e].float() - lse[s:e, None])
            q = torch.exp(teacher[s:e].float() - teacher_lse[s:e, None])
            sign = torch.sign(p - q)
            g = grad_tv[s:e, None] * p * (sign - (sign * p).sum(-1, keepdim=True))
            grads.append(torch.where(grad_tv[s:e, None] != 0, g, 0.0).to(logits.dtype))
        return torch.cat(grads), None, None


def total_variation(logits: Tensor, teacher: Tensor, chunk_size: int | None = None) -> Tensor:
    """`Σ_v |softmax(logits) - softmax(teacher)|` per row of `[N, V]` (fp32 `[N]`, in [0, 2]);
    gradient to `logits` only; eager mode works in `chunk_size` row tiles."""
    check_chunk_size(chunk_size)
    return _TotalVariation.apply(logits, teacher.detach(), chunk_size)


class _ReverseKL(torch.autograd.Function):
    """Per row, `KL(softmax(x) ‖ softmax(t))` for a fixed teacher `t`, with the negative
    entropy `Σ p log p` and the cross-entropy `-Σ p log q` as gradient-free diagnostics.
    One pass over this rank's vocabulary shard gives, relative to the shard's maxima,
    `Σe^(x-m)`, `Σe^(x-m)·(x-t)`, `Σe^(x-m)·x`, `Σe^(x-m)·t` and `Σe^(t-mt)`; the shards merge
    with one max and one sum all-reduce. The KL's own sum `Σ p (x - t)` is accumulated
    apart from the entropy and cross-entropy sums, so `negent + CE - KL` measures their
    numerical agreement. The backward recomputes `p` per row chunk:
    `∂KL/∂x = p ⊙ (log p - log q - KL)`."""

    @staticmethod
    def forward(ctx, logits, teacher, chunk_size, group):
        n, vocab = logits.shape
        parts = []
        for s, e in _row_chunks(n, vocab, chunk_size):
            x, t = logits[s:e].float(), teacher[s:e].float()
            m = x.amax(-1).clamp(min=torch.finfo(torch.float32).min)
            mt = t.amax(-1).clamp(min=torch.finfo(torch.float32).min)
            ex = torch.exp(x - m[:, None])
            sums = [ex.sum(-1), _xlogp_safe(ex, x - t).sum(-1), _xlogp_safe(ex, x).sum(-1), _xlogp_safe(ex, t).sum(-1)]
            parts.append((torch.stack([m, mt], -1), torch.stack(sums, -1), torch.exp(t - mt[:, None]).sum(-1)))
        maxima, sums, teacher_sum = (torch.cat(p) for p in zip(*parts))
        merged = all_reduce_max(maxima, group)
        scale = torch.exp(maxima - merged)
        total = all_reduce_sum(torch.cat([sums * scale[:, :1], (teacher_sum * scale[:, 1])[:, None]], -1), group)
        lse, teacher_lse = merged[:, 0] + torch.log(total[:, 0]), merged[:, 1] + torch.log(total[:, 4])
        kl = total[:, 1] / total[:, 0] - lse + teacher_lse
        negent = total[:, 2] / total[:, 0] - lse
        cross_entropy = teacher_lse - total[:, 3] / total[:, 0]
        ctx.save_for_backward(logits, teacher, lse, teacher_lse, kl)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(negent, cross_entropy)
        return kl, negent, cross_entropy

    @staticmethod
    def backward(ctx, grad_kl, _negent, _cross):
        logits, teacher, lse, teacher_lse, kl = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty_like(logits)
        for s, e in _row_chunks(n, vocab, ctx.chunk_size):
            x, t = logits[s:e].float(), teacher[s:e].float()
            p = torch.exp(x - lse[s:e, None])
            log_ratio = (x - lse[s:e, None]) - (t - teacher_lse[s:e, None]) - kl[s:e, None]
            g = _xlogp_safe(p, log_ratio) * grad_kl[s:e, None]
            grad[s:e] = torch.where(grad_kl[s:e, None] != 0, g, 0.0).to(grad.dtype)
        return grad, None, None, None


def reverse_kl(
    logits: Tensor, teacher: Tensor, *, chunk_size: int | None = None, group: ProcessGroup | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of `[N, V]`, `KL(p ‖ q)` between the distributions of `logits` (`p`) and of a
    fixed `teacher` (`q`, detached), and two diagnostics without gradient: the negative
    entropy `Σ p log p` and the cross-entropy `-Σ p log q` (so `KL = negent + CE`); each
    fp32 `[N]`. Gradient to `logits` only; eager mode works in `chunk_size` row tiles.
    With a tensor-parallel `group` both are this rank's vocabulary shard and the results
    are the full vocabulary's (an eager call first checks that every rank holds an equally
    wide shard of as many rows: a ValueError on every rank otherwise)."""
    check_chunk_size(chunk_size)
    if isinstance(logits, LinearLogits):
        raise ValueError("reverse_kl: pass the student's logits tensor, not LinearLogits")
    if teacher.shape != logits.shape:
        raise ValueError(
            f"reverse_kl: teacher logits must match the logits' shape {tuple(logits.shape)}, got {tuple(teacher.shape)}"
        )
    check_agreement(
        "reverse_kl's inputs (each rank's logits are its vocabulary shard [N, V / tp]: equally wide, with the same "
        "rows and dtypes on every rank)",
        {"logits": logits, "teacher": teacher},
        group,
    )
    return _ReverseKL.apply(logits, teacher.detach(), chunk_size, group)
