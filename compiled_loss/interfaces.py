"""Enums and the loss-function protocol (ref §2)."""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import torch

Tensor = torch.Tensor


class LossType(enum.Enum):
    """Which global denominator normalises the gradient term."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class MetricNormalizer(enum.Enum):
    """How a metric's denominator is chosen: global tokens, global sequences, or raw."""

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


class LossInputType(enum.Enum):
    """What `prepare_loss_input` must build from the logits for a loss."""

    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
    DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
    DRAFT = "draft"
    OPD_FULL = "opd_full"


@runtime_checkable
class LossFunction(Protocol):
    """A stateless loss: `loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)`.

    Returns `(loss, metrics)` where `loss` is a 0-d tensor (a fragment of the global loss
    when the denominators are global) and `metrics` maps NeMo-RL's metric keys to 0-d
    tensors. Optional attributes read by input preparation: `metric_normalizations`,
    `use_fused_linear_logprobs`, `reference_policy_kl_penalty`; read by the training step:
    `vocab_sharded` (see `vocab_sharded`).
    """

    loss_type: LossType
    input_type: LossInputType

    def __call__(
        self,
        data: dict[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        **loss_input: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def vocab_sharded(loss_fn: Any) -> bool:
    """Whether `loss_fn` reads vocabulary-sharded logits under tensor parallelism (its
    `vocab_sharded` attribute; True when it declares nothing, as every loss over logits).

    This decides how its gradient is split over a tensor-parallel group. Vocabulary-sharded
    logits — dense, or `LinearLogits` over a vocabulary shard of the LM head — give each TP
    rank its shard's share of the gradient of whatever produced them (a partial `dH`; the
    sum over the group is the gradient). A replicated output (a value head, False) gives
    every TP rank the whole gradient."""
    return bool(getattr(loss_fn, "vocab_sharded", True))
