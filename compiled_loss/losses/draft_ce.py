"""Draft soft cross-entropy: a drafter's logits against the (shifted) policy distribution
(ref §4.6, §7.7)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from compiled_loss.interfaces import LossInputType, LossType
from compiled_loss.losses.common import require_keys, require_shape
from compiled_loss.vocab import check_chunk_size, vocab_reduce

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


def soft_cross_entropy_sum(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, token_chunk_size: int | None,
    vocab_parallel_group: Any = None,
) -> Tensor:
    """`Σ_t mask_t · H(softmax(teacher_t), log_softmax(student_t))` over `[..., V]` rows
    (`[..., V / tp]` vocabulary shards with a tensor-parallel group).

    The teacher is detached; the gradient w.r.t. the student is `(q - p)·mask` per row.
    """
    vocab = student_logits.shape[-1]
    stats = vocab_reduce(
        student_logits.reshape(-1, vocab),
        teacher=teacher_logits.reshape(-1, vocab),
        chunk_size=token_chunk_size,
        group=vocab_parallel_group,
    )
    ce = stats.lse - stats.cross
    m = mask.reshape(-1).to(ce.dtype)
    return torch.where(m > 0, ce * m, 0.0).sum()


@dataclasses.dataclass(frozen=True)
class DraftCrossEntropyLossFn:
    """EAGLE draft soft cross-entropy against the (shifted) policy distribution (ref §4.6).

    `__call__` returns ONLY the scalar loss `Σ mask·CE / (G_t + 1e-8)`, where
    `mask = token_mask * sample_mask[:, None]` and `token_mask` is already aligned.
    """

    vocab_parallel_group: Any = None
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DRAFT

    def __post_init__(self) -> None:
        check_chunk_size(self.token_chunk_size, "token_chunk_size")

    def loss_stats(
        self,
        teacher_logits: Tensor,
        student_logits: Tensor,
        token_mask: Tensor,
        data: Mapping[str, Tensor],
    ) -> DraftLossStats:
        who = "DraftCrossEntropyLossFn"
        if teacher_logits.shape != student_logits.shape:
            raise ValueError(
                f"{who}: teacher_logits and student_logits must have the same shape, got "
                f"{tuple(teacher_logits.shape)} and {tuple(student_logits.shape)}"
            )
        require_shape(token_mask, tuple(student_logits.shape[:-1]), "token_mask", who)
        require_keys(data, ("sample_mask",), who)
        mask = token_mask * data["sample_mask"].reshape((-1,) + (1,) * (token_mask.dim() - 1))
        numerator = soft_cross_entropy_sum(
            student_logits, teacher_logits, mask, self.token_chunk_size, self.vocab_parallel_group
        )
        one = numerator.new_ones(1)
        return DraftLossStats(numerator.reshape(1), mask.sum().to(one.dtype).reshape(1), one)

    def __call__(
        self,
        teacher_logits: Tensor,
        student_logits: Tensor,
        token_mask: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> Tensor:
        if global_valid_toks is None:
            raise ValueError("DraftCrossEntropyLossFn: global_valid_toks must not be None")
        stats = self.loss_stats(teacher_logits, student_logits, token_mask, data)
        return stats.normalized(torch.as_tensor(global_valid_toks).reshape(1))
