"""The pieces of the row statistics that the dense reduction (`reduce`) and the one from
hidden states (`fused`) share: one chunk's statistics, their merge over tensor-parallel
vocabulary shards, and the pointwise gradient of a chunk's logits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_loss.parallel.collectives import all_reduce_max, all_reduce_sum

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


def _shard_stats(
    x: Tensor, teacher: Tensor | None, local: Tensor, in_shard: Tensor, entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
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
    sums = all_reduce_sum(
        torch.stack(
            [stats[:, 1] * scale[:, 0], stats[:, 2] * scale[:, 0], stats[:, 4] * scale[:, 1], weighted * scale[:, 1]],
            -1,
        ),
        group,
    )
    total, weighted_x, teacher_total, teacher_x = sums.unbind(-1)
    lse = maxima[:, 0] + torch.log(total)
    negent = weighted_x / total - lse if entropy else torch.zeros_like(lse)
    teacher_lse = maxima[:, 1] + torch.log(teacher_total)
    cross = teacher_x / teacher_total if has_teacher else torch.zeros_like(lse)
    return lse, all_reduce_sum(picked, group), negent, cross, teacher_lse


class _RowGrad(NamedTuple):
    """What the gradient of a chunk's logits reads per row besides them (`_chunk_grad`)."""

    teacher: Tensor | None  # the teacher's logits, `[c, V]` like the chunk's
    lse: Tensor
    negent: Tensor
    teacher_lse: Tensor | None  # None without a teacher
    grads: tuple[Tensor, ...]  # the upstream gradients of lse, picked, negent and cross
    local: Tensor  # the indices within this shard (`_local_index`)
    in_shard: Tensor  # whether this shard holds each index
    live: Tensor  # rows some upstream gradient reaches (`_live`)


def _row_slice(rows: _RowGrad, s: int, e: int) -> _RowGrad:
    """Rows `s:e` of every per-row input."""
    teacher, lse, negent, teacher_lse, grads, local, in_shard, live = rows
    return _RowGrad(
        None if teacher is None else teacher[s:e],
        lse[s:e],
        negent[s:e],
        None if teacher_lse is None else teacher_lse[s:e],
        tuple(g[s:e] for g in grads),
        local[s:e],
        in_shard[s:e],
        live[s:e],
    )


def _chunk_grad(x: Tensor, kept: Tensor | None, rows: _RowGrad, entropy: bool) -> Tensor:
    """The fp32 gradient w.r.t. one row chunk of this shard's logits `x [c, V]` (already
    filtered; `kept` the filter's keep mask or None), pointwise: every statistic it needs
    is global. Rows no output gradient reaches (`live` False) get exactly 0."""
    teacher, lse, negent, teacher_lse, grads, local, in_shard, live = rows
    g_lse, g_picked, g_negent, g_cross = grads
    p = torch.exp(x - lse[:, None])
    coef = g_lse[:, None]
    if entropy:
        coef = coef + g_negent[:, None] * torch.where(p > 0, x - lse[:, None] - negent[:, None], 0.0)
    g = p * coef
    if teacher is not None and teacher_lse is not None:
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
