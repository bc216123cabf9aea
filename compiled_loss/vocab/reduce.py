"""The one primitive for vocab work (DESIGN principle 5).

`vocab_reduce` reads a `[N, V]` logits tensor (any float dtype) once and returns the
per-row statistics every loss is built from:

- `lse`     `[N]`    log-sum-exp (log-partition) of the row,
- `picked`  `[N, K]` raw logits at `index` (selected tokens, top-k indices),
- `negent`  `[N]`    `Σ_v p_v log p_v` (negative entropy), when `entropy=True`,
- `cross`   `[N]`    `Σ_v p^teacher_v · x_v` for a detached teacher row, when `teacher` given.

so that e.g. `logprob = picked - lse` and `soft-CE = lse - cross`.

It is an `autograd.Function` that saves only the inputs and `[N]` statistics and
recomputes the softmax in a pointwise backward, so no fp32 `[N, V]` copy of the logits is
ever kept. Under torch.compile the forward and backward each fuse into one kernel; in eager
mode both loop over `chunk_size` rows so the fp32 working set stays `chunk_size × V`.

An optional per-row `threshold` implements top-k / top-p filtering: entries below it are
treated as `-inf` (and receive no gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

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
    if torch.compiler.is_compiling():
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


class _VocabReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, threshold, teacher, entropy, chunk_size):
        n, vocab = logits.shape
        dev = logits.device
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        picked = torch.empty(index.shape, dtype=torch.float32, device=dev)
        negent = torch.zeros(n, dtype=torch.float32, device=dev)
        cross = torch.zeros(n, dtype=torch.float32, device=dev)
        teacher_lse = torch.zeros(n if teacher is not None else 0, dtype=torch.float32, device=dev)
        for s, e in _row_chunks(n, vocab, chunk_size):
            x = _filtered(logits[s:e].float(), None if threshold is None else threshold[s:e])
            m = x.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
            row_lse = (m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))).squeeze(-1)
            lse[s:e] = row_lse
            picked[s:e] = x.gather(-1, index[s:e])
            if entropy:
                p = torch.exp(x - row_lse[:, None])
                negent[s:e] = _xlogp_safe(p, x).sum(-1) - row_lse
            if teacher is not None:
                t = teacher[s:e].float()
                t_lse = torch.logsumexp(t, -1)
                teacher_lse[s:e] = t_lse
                cross[s:e] = _xlogp_safe(torch.exp(t - t_lse[:, None]), x).sum(-1)
        ctx.save_for_backward(logits, index, threshold, teacher, lse, negent, teacher_lse)
        ctx.chunk_size, ctx.entropy = chunk_size, entropy
        return lse, picked, negent, cross

    @staticmethod
    def backward(ctx, g_lse, g_picked, g_negent, g_cross):
        logits, index, threshold, teacher, lse, negent, teacher_lse = ctx.saved_tensors
        n, vocab = logits.shape
        grad = torch.empty_like(logits)
        k = index.shape[-1]
        iota = torch.arange(vocab, device=logits.device)
        # rows that no output gradient reaches get exactly 0, whatever their logits hold
        live = (g_lse != 0) | (g_picked != 0).any(-1) | (g_negent != 0) | (g_cross != 0)
        for s, e in _row_chunks(n, vocab, ctx.chunk_size):
            x = logits[s:e].float()
            kept = None if threshold is None else x >= threshold[s:e, None]
            if kept is not None:
                x = torch.where(kept, x, float("-inf"))
            p = torch.exp(x - lse[s:e, None])
            coef = g_lse[s:e, None]
            if ctx.entropy:
                coef = coef + g_negent[s:e, None] * torch.where(p > 0, x - lse[s:e, None] - negent[s:e, None], 0.0)
            g = p * coef
            if teacher is not None:
                t = teacher[s:e].float()
                g = g + torch.exp(t - teacher_lse[s:e, None]) * g_cross[s:e, None]
            if k == 1:
                g = g + (iota[None, :] == index[s:e]).to(g.dtype) * g_picked[s:e]
            keep = live[s:e, None] if kept is None else live[s:e, None] & kept
            grad[s:e] = torch.where(keep, g, 0.0).to(grad.dtype)
            if k > 1:
                picked_grad = torch.where(live[s:e, None], g_picked[s:e], 0.0)
                if threshold is not None:
                    picked_grad = torch.where(
                        x.gather(-1, index[s:e]) > float("-inf"), picked_grad, 0.0
                    )
                grad[s:e] = grad[s:e].scatter_add(-1, index[s:e], picked_grad.to(grad.dtype))
        return grad, None, None, None, None, None


def vocab_reduce(
    logits: Tensor,
    index: Tensor | None = None,
    *,
    threshold: Tensor | None = None,
    teacher: Tensor | None = None,
    entropy: bool = False,
    chunk_size: int | None = None,
) -> VocabStats:
    """Row statistics of `logits [N, V]`; see the module docstring.

    `index [N, K]` (long) selects `picked`; `threshold [N]` filters (top-k/top-p);
    `teacher [N, V]` (detached) gives `cross`; `entropy` computes `negent`.
    `chunk_size` (rows) bounds the eager-mode fp32 working set; ignored when compiling.
    """
    check_chunk_size(chunk_size)
    if index is None:
        index = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)
    if teacher is not None:
        teacher = teacher.detach()
    if threshold is not None:
        threshold = threshold.detach().float()
    return VocabStats(
        *_VocabReduce.apply(logits, index, threshold, teacher, entropy, chunk_size)
    )


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    threshold: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """`log softmax(logits)[target]` per row, fp32 `[N]` (`-inf` for a filtered target)."""
    stats = vocab_reduce(logits, targets[:, None], threshold=threshold, chunk_size=chunk_size)
    return stats.picked[:, 0] - stats.lse
