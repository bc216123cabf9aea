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

from typing import Any, NamedTuple

import torch

from compiled_loss.parallel import group_rank, group_size
from compiled_loss.parallel.collectives import all_gather, all_reduce_max, all_reduce_sum

Tensor = torch.Tensor

# Eager-mode working set: rows per chunk = _CHUNK_ELEMENTS // V (fp32 tiles of ~4 MiB;
# tiles above glibc's 32 MiB mmap threshold page-fault on every allocation: 6x slower).
_CHUNK_ELEMENTS = 1 << 20


class VocabStats(NamedTuple):
    lse: Tensor
    picked: Tensor
    negent: Tensor
    cross: Tensor


def check_chunk_size(chunk_size: int | None, name: str = "chunk_size") -> None:
    """ValueError unless `chunk_size` is None or an int >= 1."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name} must be None or an int >= 1, got {chunk_size!r}")


def row_chunks(n_rows: int, vocab: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Eager-mode row ranges of `chunk_size` rows (default: ~4 MiB of fp32 per chunk)."""
    step = chunk_size or max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


def _row_chunks(n_rows: int, vocab: int, chunk_size: int | None) -> list[tuple[int, int]]:
    if torch.compiler.is_compiling() or n_rows == 0:
        return [(0, n_rows)]  # Inductor fuses the whole row sweep; no fp32 copy exists
    return row_chunks(n_rows, vocab, chunk_size)


def _filtered(x: Tensor, threshold: Tensor | None) -> Tensor:
    """Forward: entries below the row's threshold become `-inf`. Spelled with `<` while the
    backward tests `>=`, so AOTAutograd cannot share one `[N, V]` mask between them and
    save it for the backward: the backward recomputes it from the saved logits."""
    if threshold is None:
        return x
    return torch.where(x < threshold[:, None], float("-inf"), x)


def _xlogp_safe(p: Tensor, x: Tensor) -> Tensor:
    """`p * x` with `0 * -inf = 0` (filtered / masked vocabulary entries)."""
    return torch.where(p > 0, p * x, 0.0)


def _local_index(index: Tensor, start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Global vocabulary ids → (position in this shard `[start, start + vocab)`, in-shard mask)."""
    local = index - start
    in_shard = (local >= 0) & (local < vocab)
    return torch.where(in_shard, local, 0), in_shard


def _shard_stats(x: Tensor, teacher: Tensor | None, local: Tensor, in_shard: Tensor, entropy: bool):
    """One row chunk of this shard's filtered fp32 logits `x [c, V]`: relative to its max
    `m`, `[c, 5]` = (m, Σe^(x-m), Σe^(x-m)·x, the teacher's max mt, Σe^(t-mt)), `[c]` =
    Σe^(t-mt)·x, and the logits at the indices this shard holds `[c, K]`."""
    f32 = torch.float32
    m = x.amax(-1).clamp(min=torch.finfo(f32).min)
    ex = torch.exp(x - m[:, None])
    zero = torch.zeros_like(m)
    negent = _xlogp_safe(ex, x).sum(-1) if entropy else zero
    mt, total_t, weighted = zero, zero, zero
    if teacher is not None:
        t = teacher.float()
        mt = t.amax(-1).clamp(min=torch.finfo(f32).min)
        et = torch.exp(t - mt[:, None])
        total_t, weighted = et.sum(-1), _xlogp_safe(et, x).sum(-1)
    picked = torch.where(in_shard, x.gather(-1, local), 0.0)
    return torch.stack([m, ex.sum(-1), negent, mt, total_t], -1), weighted, picked


def _merge_shards(stats: Tensor, weighted: Tensor, picked: Tensor, entropy: bool, has_teacher: bool, group):
    """The shards' statistics merged with one max and one sum all-reduce (no collective
    without a group): lse, picked, negent, cross and the teacher's lse, each `[N]` (`[N, K]`)."""
    maxima = all_reduce_max(stats[:, [0, 3]], group)  # global max of the row, of the teacher row
    scale = torch.exp(stats[:, [0, 3]] - maxima)  # each shard's sums, rescaled to the global max
    sums = all_reduce_sum(torch.stack([stats[:, 1] * scale[:, 0], stats[:, 2] * scale[:, 0],
                                       stats[:, 4] * scale[:, 1], weighted * scale[:, 1]], -1), group)
    total, weighted_x, teacher_total, teacher_x = sums.unbind(-1)
    lse = maxima[:, 0] + torch.log(total)
    negent = weighted_x / total - lse if entropy else torch.zeros_like(lse)
    teacher_lse = maxima[:, 1] + torch.log(teacher_total)
    cross = teacher_x / teacher_total if has_teacher else torch.zeros_like(lse)
    return lse, all_reduce_sum(picked, group), negent, cross, teacher_lse


def _chunk_grad(x, kept, teacher, lse, negent, teacher_lse, grads, local, in_shard, live, entropy):
    """The fp32 gradient w.r.t. one row chunk of this shard's logits `x [c, V]` (already
    filtered; `kept` the filter's keep mask or None), pointwise: every statistic it needs
    is global. Rows no output gradient reaches (`live` False) get exactly 0."""
    g_lse, g_picked, g_negent, g_cross = grads
    p = torch.exp(x - lse[:, None])
    coef = g_lse[:, None]
    if entropy:
        coef = coef + g_negent[:, None] * torch.where(p > 0, x - lse[:, None] - negent[:, None], 0.0)
    g = p * coef
    if teacher is not None:
        g = g + torch.exp(teacher.float() - teacher_lse[:, None]) * g_cross[:, None]
    g_picked = torch.where(in_shard & live[:, None], g_picked, 0.0)  # an index another shard holds
    if kept is not None:
        g_picked = torch.where(x.gather(-1, local) > float("-inf"), g_picked, 0.0)
    if local.shape[-1] == 1:
        g = g + (torch.arange(x.shape[-1], device=x.device)[None, :] == local).to(g.dtype) * g_picked
    keep = live[:, None] if kept is None else live[:, None] & kept
    g = torch.where(keep, g, 0.0)
    return g if local.shape[-1] == 1 else g.scatter_add(-1, local, g_picked)


def _live(grads) -> Tensor:
    """Rows that some output gradient reaches."""
    g_lse, g_picked, g_negent, g_cross = grads
    return (g_lse != 0) | (g_picked != 0).any(-1) | (g_negent != 0) | (g_cross != 0)


def _filtered_chunk(x: Tensor, threshold: Tensor | None, backward: bool) -> tuple[Tensor, Tensor | None]:
    """`x` with the entries below the row's threshold at `-inf`, and (backward) the keep mask."""
    if threshold is None:
        return x, None
    if not backward:
        return _filtered(x, threshold), None
    kept = x >= threshold[:, None]
    return torch.where(kept, x, float("-inf")), kept


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
            parts.append(_shard_stats(x, None if teacher is None else teacher[s:e], local[s:e], in_shard[s:e],
                                      entropy))
        stats, weighted, picked = (torch.cat(p) for p in zip(*parts))
        lse, picked, negent, cross, teacher_lse = _merge_shards(stats, weighted, picked, entropy,
                                                                teacher is not None, group)
        ctx.save_for_backward(logits, local, in_shard, threshold, teacher, lse, negent, teacher_lse)
        ctx.chunk_size, ctx.entropy = chunk_size, entropy
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, *grads):
        logits, local, in_shard, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        n, vocab = logits.shape
        live = _live(grads)
        grad = torch.empty_like(logits)
        for s, e in _row_chunks(n, vocab, ctx.chunk_size):
            x, kept = _filtered_chunk(logits[s:e].float(), None if threshold is None else threshold[s:e], True)
            grad[s:e] = _chunk_grad(
                x, kept, None if teacher is None else teacher[s:e], lse[s:e], negent[s:e], teacher_lse[s:e],
                tuple(g[s:e] for g in grads), local[s:e], in_shard[s:e], live[s:e], ctx.entropy,
            ).to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_reduce(
    logits: Tensor,
    index: Tensor | None = None,
    *,
    threshold: Tensor | None = None,
    teacher: Tensor | None = None,
    entropy: bool = False,
    chunk_size: int | None = None,
    group: Any = None,
) -> VocabStats:
    """Row statistics of `logits [N, V]`; see the module docstring.

    `index [N, K]` (long) selects `picked`; `threshold [N]` filters (top-k/top-p);
    `teacher [N, V]` (detached) gives `cross`; `entropy` computes `negent`.
    `chunk_size` (rows) bounds the eager-mode fp32 working set; ignored when compiling.
    With a tensor-parallel `group`, `logits` (and `teacher`) are this rank's vocabulary
    shard `[N, V / tp]` (rank `r` holds ids `[r·V/tp, (r+1)·V/tp)`), `index` holds GLOBAL
    ids, and every statistic is the full vocabulary's; the gradient is this shard's slice
    of the full one.
    """
    check_chunk_size(chunk_size)
    if index is None:
        index = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
    if teacher is not None:
        teacher = teacher.detach()
    if threshold is not None:
        threshold = threshold.detach().float()
    return VocabStats(
        *_VocabReduce.apply(logits, index, threshold, teacher, entropy, chunk_size, group)
    )


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    threshold: Tensor | None = None,
    chunk_size: int | None = None,
    group: Any = None,
) -> Tensor:
    """`log softmax(logits)[target]` per row, fp32 `[N]` (`-inf` for a filtered target);
    `group`: see `vocab_reduce`."""
    stats = vocab_reduce(logits, targets[:, None], threshold=threshold, chunk_size=chunk_size, group=group)
    return stats.picked[:, 0] - stats.lse


@torch.no_grad()
def vocab_topk(logits: Tensor, k: int, group: Any = None) -> tuple[Tensor, Tensor]:
    """The `min(k, V)` largest logits of each row and their GLOBAL vocabulary ids (ref §8.8),
    fp32 values in descending order; with a tensor-parallel `group`, over the full
    vocabulary of the row's shards."""
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
