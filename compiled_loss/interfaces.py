"""Enums and the typed loss contract (ref §2): the `LossFunction` protocol and the
`InputSpec` a loss declares (what input preparation builds for it, what the step reads)."""

from __future__ import annotations

import dataclasses
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


class OpdFullOptions(Protocol):
    """What input preparation reads of an OPD_FULL loss's distillation config
    (`compiled_loss.losses.OPDFullConfig`)."""

    teacher_payload: str
    chunk_size: int | None
    with_entropy: bool
    with_cross_entropy: bool


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What a loss needs from input preparation and from the training step, declared as data
    (a loss's `input_spec`; `InputSpec.of` reads it)."""

    input_type: LossInputType
    """Which inputs preparation builds from the logits (`compiled_loss.inputs`, one preparer each)."""
    _: dataclasses.KW_ONLY
    unfiltered_logprobs: bool = False
    """The policy's next-token log-probs without top-k / top-p filtering are read beside the
    main input (a reference KL): LOGPROB inputs add `curr_logprobs_unfiltered` when a filter
    is active, OPD_FULL inputs add `next_token_logprobs`."""
    fused_linear_logprobs: bool = False
    """LOGPROB: the logits argument already holds next-token log-probs `[B, S']` (a fused
    linear-cross-entropy forward); they are cast and truncated, not computed."""
    zero_outside_topk: bool = False
    """DISTILLATION: the student's top-k values are full-vocabulary log-probs (otherwise
    log-probs renormalised over the k gathered logits)."""
    topk_entropy: bool = False
    """DISTILLATION: `H_all = Σ p log p` over the whole vocabulary is computed too."""
    opd_full: OpdFullOptions | None = None
    """OPD_FULL: the teacher payload and the diagnostics to compute."""
    pairs: bool = False
    """Rows are interleaved (chosen, rejected) pairs: micro-batches and packings keep them whole."""
    teacher_logits_keys: tuple[str, ...] = ()
    """Data keys indexed by a teacher's own positions (`[B, S_t, ...]`): packing pads their
    rows but never cuts them at the student's lengths."""
    teacher_alignment_keys: tuple[str, ...] = ()
    """DISTILLATION_CROSS_TOKENIZER: data keys of the student → teacher position alignments."""
    vocab_sharded: bool = True
    """The loss reads vocabulary-sharded logits under tensor parallelism, so each TP rank gets
    its shard's share of the gradient (a partial `dH`; the sum over the group is the
    gradient). False for a replicated output (a value head): every TP rank gets the whole
    gradient. The step's gradient scale follows it (`compiled_loss.train.parallel.gradient_scale`)."""
    data: type | None = None
    """The data keys the loss reads, as a `TypedDict` (None: not declared)."""

    @staticmethod
    def of(loss_fn: LossFunction) -> InputSpec:
        """`loss_fn.input_spec`, or — a NeMo-RL-style loss that declares only `loss_type` and
        `input_type` — the defaults for its input type. Called once where a loss enters the
        library (the seed functions and wrappers, the training step)."""
        if isinstance(loss_fn, DeclaresInputs):
            return loss_fn.input_spec
        return InputSpec(loss_fn.input_type)


@runtime_checkable
class LossFunction(Protocol):
    """A stateless loss: `loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)`.

    Returns `(loss, metrics)` where `loss` is a 0-d tensor (a fragment of the global loss
    when the denominators are global) and `metrics` maps NeMo-RL's metric keys to 0-d
    tensors. What it needs beyond its input type it declares as data (`DeclaresInputs`)."""

    loss_type: LossType
    input_type: LossInputType

    def __call__(
        self,
        data: dict[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        **loss_input: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@runtime_checkable
class DeclaresInputs(Protocol):
    """A loss that declares what it needs (every loss in `compiled_loss.losses` does)."""

    input_spec: InputSpec
