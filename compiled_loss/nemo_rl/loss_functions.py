"""Seed module `nemo_rl.algorithms.loss.loss_functions` (ref §3–4): the loss families of
`compiled_loss.losses`, and the seed's draft soft cross-entropy with its signatures —
`DraftCrossEntropyLossFn` (the vocabulary sharded over `vocab_parallel_group`) and the
ref §7.7 kernels taking `tp_group` — over `compiled_loss.losses.draft_ce`'s statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypedDict

import torch
from torch.distributed import ProcessGroup

from compiled_loss.interfaces import InputSpec, LossInputType, LossType
from compiled_loss.losses import (
    APPROX_ENTROPY_KEY,
    DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    KL_PENALTY_KEY,
    ClippedPGLossConfig,
    ClippedPGLossFn,
    ConfigError,
    CrossTokenizerDistillationLossConfig,
    CrossTokenizerDistillationLossFn,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    DPOLossFn,
    DraftLossStats,
    MPOLossConfig,
    MPOLossFn,
    MseValueLossConfig,
    MseValueLossFn,
    NLLLossFn,
    OPDFullConfig,
    PreferenceLossFn,
    calculate_kl,
    masked_mean,
)
from compiled_loss.losses.common import require_keys, require_shape
from compiled_loss.losses.draft_ce import dflash_soft_ce_stats, projected_soft_ce_stats, soft_ce_stats
from compiled_loss.parallel import ParallelGroups
from compiled_loss.vocab import check_chunk_size

Tensor = torch.Tensor

__all__ = [
    "APPROX_ENTROPY_KEY",
    "DEFAULT_DRAFT_TOKEN_CHUNK_SIZE",
    "KL_PENALTY_KEY",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "ConfigError",
    "CrossTokenizerDistillationLossConfig",
    "CrossTokenizerDistillationLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "DraftCrossEntropyLossFn",
    "DraftLossStats",
    "MPOLossConfig",
    "MPOLossFn",
    "MseValueLossConfig",
    "MseValueLossFn",
    "NLLLossFn",
    "OPDFullConfig",
    "PreferenceLossFn",
    "calculate_kl",
    "dflash_projected_vocab_parallel_soft_ce",
    "masked_mean",
    "projected_streaming_vocab_parallel_soft_ce",
    "streaming_vocab_parallel_soft_ce",
]


def streaming_vocab_parallel_soft_ce(
    *,
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    tp_group: ProcessGroup | None = None,
    bin_ids: Tensor | None = None,
    weights: Tensor | None = None,
) -> DraftLossStats:
    """`soft_ce_stats` (ref §7.7) with the vocabulary sharded over `tp_group`."""
    return soft_ce_stats(
        student_logits=student_logits,
        teacher_logits=teacher_logits,
        mask=mask,
        token_chunk_size=token_chunk_size,
        parallel=ParallelGroups(tp=tp_group),
        bin_ids=bin_ids,
        weights=weights,
    )


def projected_streaming_vocab_parallel_soft_ce(
    *,
    student_hidden: Tensor,
    output_weight: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    tp_group: ProcessGroup | None = None,
    bin_ids: Tensor | None = None,
    weights: Tensor | None = None,
) -> DraftLossStats:
    """`projected_soft_ce_stats` (ref §7.7) with the vocabulary sharded over `tp_group`."""
    return projected_soft_ce_stats(
        student_hidden=student_hidden,
        output_weight=output_weight,
        teacher_logits=teacher_logits,
        mask=mask,
        token_chunk_size=token_chunk_size,
        parallel=ParallelGroups(tp=tp_group),
        bin_ids=bin_ids,
        weights=weights,
        who="projected_streaming_vocab_parallel_soft_ce",
    )


def dflash_projected_vocab_parallel_soft_ce(
    *,
    draft_hidden: Tensor,
    output_weight: Tensor,
    teacher_logits: Tensor,
    sample_rows: Tensor,
    label_positions: Tensor,
    loss_mask: Tensor,
    position_decay: float,
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
    tp_group: ProcessGroup | None = None,
) -> DraftLossStats:
    """`dflash_soft_ce_stats` (ref §7.7) with the vocabulary sharded over `tp_group`."""
    return dflash_soft_ce_stats(
        draft_hidden=draft_hidden,
        output_weight=output_weight,
        teacher_logits=teacher_logits,
        teacher_rows=(sample_rows, label_positions),
        loss_mask=loss_mask,
        position_decay=position_decay,
        token_chunk_size=token_chunk_size,
        parallel=ParallelGroups(tp=tp_group),
    )


class DraftCrossEntropyLossData(TypedDict):
    """The data `DraftCrossEntropyLossFn` reads, with DRAFT input preparation: `[B, S]` unless noted."""

    token_mask: Tensor
    sample_mask: Tensor  # [B]
    student_logits: Tensor  # [B, S, V_d]


@dataclasses.dataclass(frozen=True)
class DraftCrossEntropyLossFn:
    """EAGLE draft soft cross-entropy against the (shifted) policy distribution (ref §4.6).

    `__call__` returns ONLY the scalar loss `Σ mask·CE / (G_t + 1e-8)`, where
    `mask = token_mask * sample_mask[:, None]` and `token_mask` is already aligned.
    """

    vocab_parallel_group: ProcessGroup | None = None
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DRAFT
    input_spec = InputSpec(LossInputType.DRAFT, data=DraftCrossEntropyLossData)

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
        return soft_ce_stats(
            student_logits=student_logits,
            teacher_logits=teacher_logits,
            mask=mask,
            token_chunk_size=self.token_chunk_size,
            parallel=ParallelGroups(tp=self.vocab_parallel_group),
        )

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
