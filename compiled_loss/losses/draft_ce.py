"""Draft soft cross-entropy: a drafter's logits against the (shifted) policy distribution
(ref §4.6, §7.7), as per-bin statistics (`DraftLossStats`) over full or tensor-parallel
(`parallel.tp`) vocabulary rows: `soft_ce_stats` of logits, `projected_soft_ce_stats` fused
with the LM-head projection, `dflash_soft_ce_stats` over DFlash blocks. The seed's
signatures over them (the `*_vocab_parallel_soft_ce` functions, `DraftCrossEntropyLossFn`)
are `compiled_loss.nemo_rl.loss_functions`'."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from compiled_loss.losses.common import require_shape
from compiled_loss.parallel import ParallelGroups, check_agreement, group_size
from compiled_loss.vocab import LinearLogits, check_chunk_size, vocab_reduce

Tensor = torch.Tensor

DEFAULT_DRAFT_TOKEN_CHUNK_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class DraftLossStats:
    """Raw per-bin numerators, counts and weights of a draft loss (ref §7.7)."""

    numerators: Tensor
    counts: Tensor
    weights: Tensor

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.numerators, self.counts, self.weights)}
        if len(shapes) != 1 or self.numerators.dim() != 1:
            raise ValueError(
                "DraftLossStats: numerators, counts and weights must be 1-D of one shape, got "
                f"{[tuple(t.shape) for t in (self.numerators, self.counts, self.weights)]}"
            )

    def normalized(self, normalization_counts: Tensor) -> Tensor:
        """`Σ(num·w) / (Σ(counts·w) + 1e-8)` with the given (detached, fp32) counts."""
        counts = normalization_counts.detach().float()
        if tuple(counts.shape) != tuple(self.counts.shape):
            raise ValueError(
                f"DraftLossStats.normalized: normalization_counts must have shape "
                f"{tuple(self.counts.shape)}, got {tuple(counts.shape)}"
            )
        return (self.numerators * self.weights).sum() / ((counts * self.weights).sum() + 1e-8)


def _bins(mask: Tensor, bin_ids: Tensor | None, weights: Tensor | None, who: str) -> tuple[Tensor, Tensor]:
    """`(bin_ids, weights)` checked against `mask`; by default one bin of weight 1."""
    if weights is None:
        weights = torch.ones(1, device=mask.device)
    if weights.dim() != 1 or weights.numel() == 0:
        raise ValueError(f"{who}: weights must be 1-D and non-empty, got shape {tuple(weights.shape)}")
    n_bins = weights.numel()
    if bin_ids is None:
        if n_bins > 1:
            raise ValueError(f"{who}: bin_ids is required with {n_bins} bins (weights of shape ({n_bins},))")
        return torch.zeros(mask.shape, dtype=torch.long, device=mask.device), weights.float()
    if bin_ids.dtype != torch.long or bin_ids.shape != mask.shape or bin_ids.device != mask.device:
        raise ValueError(
            f"{who}: bin_ids must be a long tensor of the mask's shape {tuple(mask.shape)} on {mask.device}, got "
            f"{bin_ids.dtype} {tuple(bin_ids.shape)} on {bin_ids.device}"
        )
    if (
        not torch.compiler.is_compiling()
        and bin_ids.numel()
        and not (
            0 <= int(bin_ids.min()) and int(bin_ids.max()) < n_bins  # host
        )
    ):
        raise ValueError(f"{who}: bin_ids must lie in [0, {n_bins}), got [{int(bin_ids.min())}, {int(bin_ids.max())}]")
    return bin_ids, weights.float()


def _binned(ce: Tensor, mask: Tensor, bin_ids: Tensor, weights: Tensor) -> DraftLossStats:
    """Per-bin `Σ mask·CE` and `Σ mask` (rows outside the mask contribute exactly 0)."""
    m = mask.reshape(-1).float()
    bins = bin_ids.reshape(-1)
    zeros = torch.zeros(weights.shape, dtype=torch.float32, device=ce.device)
    numerators = zeros.scatter_add(0, bins, torch.where(m > 0, ce * m, 0.0))
    return DraftLossStats(numerators, zeros.scatter_add(0, bins, m), weights)


def _check_draft_inputs(student: Tensor, student_vocab: int, teacher: Tensor, mask: Tensor, chunk: int, who: str):
    """The student (`[..., V]` logits or `[..., H]` hidden states with `student_vocab` = V),
    teacher `[..., V]` and mask `[...]` agree; one device; a valid chunk size."""
    rows = tuple(teacher.shape[:-1])
    if teacher.dim() < 2 or tuple(student.shape[:-1]) != rows or student_vocab != teacher.shape[-1]:
        raise ValueError(
            f"{who}: the student and teacher_logits must have matching [..., V] shapes, got "
            f"student {tuple(student.shape[:-1])} × V={student_vocab} and teacher "
            f"{tuple(teacher.shape)}"
        )
    if teacher.numel() == 0:
        raise ValueError(f"{who}: needs at least one token and one vocabulary entry, got {tuple(teacher.shape)}")
    if tuple(mask.shape) != rows:
        raise ValueError(f"{who}: mask must have shape {rows} (the logits' without V), got {tuple(mask.shape)}")
    devices = {student.device, teacher.device, mask.device}
    if len(devices) != 1:
        raise ValueError(f"{who}: every tensor must be on one device, got {sorted(map(str, devices))}")
    check_chunk_size(chunk, "token_chunk_size")


def _fingerprint(t: Tensor) -> tuple[Any, ...]:
    """Host side: shape, dtype and exact values of a tensor (a digest of its bytes)."""
    data = t.detach().cpu().contiguous()  # host
    return tuple(t.shape), str(t.dtype), hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()  # host


def soft_ce_stats(
    *,
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    parallel: ParallelGroups = ParallelGroups(),
    bin_ids: Tensor | None = None,
    weights: Tensor | None = None,
) -> DraftLossStats:
    """Per-bin `Σ mask·H(softmax(teacher), log_softmax(student))` and `Σ mask` over `[..., V]`
    rows (`[..., V / tp]` vocabulary shards over `parallel.tp`), ref §7.7. The teacher is
    detached; the student's gradient is `(q - p)·mask·∂numerators[bin]`, with no collective
    in the backward. `token_chunk_size` rows at a time in eager mode."""
    who = "soft_ce_stats"
    _check_draft_inputs(student_logits, student_logits.shape[-1], teacher_logits, mask, token_chunk_size, who)
    bin_ids, weights = _bins(mask, bin_ids, weights, who)
    vocab = student_logits.shape[-1]
    stats = vocab_reduce(
        student_logits.reshape(-1, vocab),
        teacher=teacher_logits.reshape(-1, vocab),
        chunk_size=token_chunk_size,
        group=parallel.tp,
    )
    return _binned(stats.lse - stats.cross, mask, bin_ids, weights)


def projected_soft_ce_stats(
    *,
    student_hidden: Tensor,
    output_weight: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    parallel: ParallelGroups = ParallelGroups(),
    bin_ids: Tensor | None = None,
    weights: Tensor | None = None,
    who: str = "projected_soft_ce_stats",
) -> DraftLossStats:
    """`soft_ce_stats` of the student logits `student_hidden [..., H] @
    output_weight [V(/tp), H]ᵀ`, fused with the LM-head projection (`vocab_reduce` of `LinearLogits`):
    no `[T, V]` student logits exist; under TP the hidden state's gradient is this shard's share,
    as the dense logits `student_hidden @ output_weightᵀ` give it (summed by whoever replicated
    the hidden states). In eager mode with a TP group, every rank must hold the same shapes,
    dtypes, chunk size and exactly equal mask, bin ids and weights (a ValueError on every rank,
    naming `who`, otherwise)."""
    if output_weight.dim() != 2 or output_weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(
            f"{who}: output_weight must be [V, H] with H = student_hidden's last dim "
            f"{student_hidden.shape[-1]}, got {tuple(output_weight.shape)}"
        )
    _check_draft_inputs(student_hidden, output_weight.shape[0], teacher_logits, mask, token_chunk_size, who)
    bin_ids, weights = _bins(mask, bin_ids, weights, who)
    if group_size(parallel.tp) > 1 and not torch.compiler.is_compiling():
        check_agreement(
            f"{who}'s inputs (shapes, dtypes, token_chunk_size; mask, bin_ids and weights exactly)",
            (
                tuple(student_hidden.shape),
                str(student_hidden.dtype),
                tuple(output_weight.shape),
                str(output_weight.dtype),
                tuple(teacher_logits.shape),
                token_chunk_size,
                _fingerprint(mask),
                _fingerprint(bin_ids),
                _fingerprint(weights),
            ),
            parallel.tp,
        )
    hidden = student_hidden.reshape(-1, student_hidden.shape[-1])
    stats = vocab_reduce(
        LinearLogits(hidden, output_weight),
        teacher=teacher_logits.reshape(hidden.shape[0], -1),
        chunk_size=token_chunk_size,
        group=parallel.tp,
    )
    return _binned(stats.lse - stats.cross, mask, bin_ids, weights)


def dflash_soft_ce_stats(
    *,
    draft_hidden: Tensor,
    output_weight: Tensor,
    teacher_logits: Tensor,
    teacher_rows: tuple[Tensor, Tensor],
    loss_mask: Tensor,
    position_decay: float,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    parallel: ParallelGroups = ParallelGroups(),
) -> DraftLossStats:
    """The DFlash block soft-CE (ref §7.7): block `b`'s slot `j` (hidden `draft_hidden [N,
    γ+1, H]`, projected by `output_weight [V(/tp), H]`, the vocabulary sharded over
    `parallel.tp`) against the teacher row `teacher_logits [B, S, V(/tp)][sample_rows[b],
    label_positions[b, j] - 1]` (`teacher_rows = (sample_rows, label_positions)`), under
    `loss_mask [N, γ+1]`. Slot 0 (the verified anchor) is never supervised; a slot whose
    teacher position lies outside `[0, S)` is masked; masked slots read teacher row 0. Bin
    `k = j - 1` carries weight `position_decay^k`. The counts are this rank's `(γ,)`: sum them
    over the data- / context-parallel ranks before `normalized`."""
    who = "dflash_soft_ce_stats"
    sample_rows, label_positions = teacher_rows
    if draft_hidden.dim() != 3 or draft_hidden.shape[1] < 2:
        raise ValueError(f"{who}: draft_hidden must be [blocks, γ+1 >= 2, H], got {tuple(draft_hidden.shape)}")
    blocks, slots = draft_hidden.shape[:2]
    if teacher_logits.dim() != 3:
        raise ValueError(f"{who}: teacher_logits must be [B, S, V], got {tuple(teacher_logits.shape)}")
    require_shape(sample_rows, (blocks,), "sample_rows ([blocks])", who)
    require_shape(label_positions, (blocks, slots), "label_positions ([blocks, γ+1])", who)
    require_shape(loss_mask, (blocks, slots), "loss_mask ([blocks, γ+1])", who)
    if not 0 < position_decay <= 1:
        raise ValueError(f"{who}: position_decay must be in (0, 1], got {position_decay}")
    rows, length, _ = teacher_logits.shape
    position = label_positions - 1
    inside = (position >= 0) & (position < length) & (sample_rows[:, None] >= 0) & (sample_rows[:, None] < rows)
    slot = torch.arange(slots, device=draft_hidden.device)
    mask = (loss_mask.bool() & inside & (slot > 0))[:, 1:]
    flat = torch.where(mask, sample_rows[:, None] * length + position[:, 1:], 0)
    teacher = teacher_logits.flatten(0, 1).index_select(0, flat.flatten()).view(blocks, slots - 1, -1)
    gamma = slots - 1
    weights = position_decay ** torch.arange(gamma, dtype=torch.float32, device=draft_hidden.device)
    if blocks == 0:  # nothing to score; the sum keeps the drafter in the graph
        zeros = torch.zeros(gamma, device=draft_hidden.device)
        return DraftLossStats(zeros + 0 * draft_hidden.float().sum(), zeros, weights)
    return projected_soft_ce_stats(
        student_hidden=draft_hidden[:, 1:],
        output_weight=output_weight,
        teacher_logits=teacher,
        mask=mask.float(),
        token_chunk_size=token_chunk_size,
        parallel=parallel,
        bin_ids=slot[:gamma].expand(blocks, gamma).contiguous(),
        weights=weights,
    )
