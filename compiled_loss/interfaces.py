"""Enums and the typed loss contract (ref §2): the `LossFunction` protocol and the
`InputSpec` a loss declares (what input preparation builds for it, what the step reads)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
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

    @property
    def teacher_payload(self) -> str: ...
    @property
    def chunk_size(self) -> int | None: ...
    @property
    def with_entropy(self) -> bool: ...
    @property
    def with_cross_entropy(self) -> bool: ...


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
    token_separable: bool = False
    """The loss is a sum over tokens of a function of each token's own inputs, every normaliser
    given up front (masks, `global_valid_toks` / `global_valid_seqs`): no token's input
    changes another token's gradient. From `LinearLogits`, LOGPROB inputs are then computed
    with the gradient in the forward (`compiled_loss.vocab.linear_vocab_gradient`: three
    matmuls, no recompute). False for coupled losses (GSPO's sequence ratios, a filter on the
    current log-probs, sequence sums)."""
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


@dataclasses.dataclass(frozen=True)
class DataKey:
    """One data key's contract (`DATA_KEYS`)."""

    shape: str
    """`B` rows, `S` positions, `V` the vocabulary; other letters as the meaning says."""
    dtype: str
    """`float` (any floating dtype) or `integer` (any integer dtype)."""
    meaning: str


DATA_KEYS: dict[str, DataKey] = {
    "input_ids": DataKey(
        "[B, S]",
        "integer",
        "Token ids in [0, V). The training step's model input; log-prob preparation reads each position's next "
        "token from it.",
    ),
    "input_lengths": DataKey(
        "[B]", "integer", "Each row's length (positions past it are padding); the training step packs rows by it."
    ),
    "token_mask": DataKey(
        "[B, S]", "float", "1 where token t is trained (the response), 0 elsewhere; entry 0 is never read."
    ),
    "sample_mask": DataKey("[B]", "float", "1 for a row that counts, 0 for one left out (padding, a filtered row)."),
    "advantages": DataKey("[B, S]", "float", "The advantage of token t."),
    "generation_logprobs": DataKey(
        "[B, S]",
        "float",
        "The log-prob of token t under the sampler that drew it; against `prev_logprobs` it gives the sampling "
        "importance ratio (TIS, ICEPOP) and the `gen_kl_error` metrics.",
    ),
    "prev_logprobs": DataKey(
        "[B, S]",
        "float",
        "The log-prob of token t under the policy before this step, recomputed by the trainer: the PPO ratio's "
        "denominator. Not read with `force_on_policy_ratio`.",
    ),
    "reference_policy_logprobs": DataKey(
        "[B, S]",
        "float",
        "The reference policy's log-prob of token t, for a reference KL (`reference_policy_kl_penalty` ≠ 0). "
        "DPO and MPO read it pre-rolled: entry t is token t+1's.",
    ),
    "rewards": DataKey(
        "[B]", "float", "The row's reward: with `positive_example_nll_weight` > 0, rows rewarded > 0 add their NLL."
    ),
    "curr_logprobs_unfiltered": DataKey(
        "[B, S-1]",
        "float",
        "NeMo-RL's key for the policy's next-token log-probs without the top-k / top-p filter (a reference KL "
        "under a filter); the ones preparation computes take precedence.",
    ),
    "opd_full_teacher_payload": DataKey(
        "[B, S, D]",
        "float",
        "With `opd_full`: the teacher's logits at each position (D = V), or its hidden states (D = its width, "
        '`teacher_payload="hidden_states"`).',
    ),
    "opd_full_teacher_index": DataKey(
        "[B]",
        "integer",
        "With `opd_full` hidden-state payloads: the teacher LM head that projects the row "
        "(a key of `teacher_output_layer_weight_by_index`).",
    ),
    "pair_index": DataKey(
        "[B]",
        "integer",
        "The preference pair a row belongs to; with `is_chosen`, rows may come in any order. Without the two, "
        "rows alternate chosen, rejected.",
    ),
    "is_chosen": DataKey(
        "[B]", "integer or bool", "1 (True) for the chosen row of its pair, 0 (False) for the rejected one."
    ),
    "reward_shift": DataKey(
        "[B]", "float", "MPO's running mean reward δ, the same in every row (the driver's `update_reward_shift`)."
    ),
    "teacher_topk_logits": DataKey("[B, S, k]", "float", "The teacher's k largest logits at each position."),
    "teacher_topk_indices": DataKey("[B, S, k]", "integer", "Their token ids, in [0, V)."),
    "teacher_{i}_logits": DataKey(
        "[B, S_t, V_t]",
        "float",
        "Teacher i's logits on its own tokenization of each row (entry a predicts its token a+1).",
    ),
    "teacher_{i}_alignment": DataKey(
        "[B, S]",
        "integer",
        "For student position t, teacher i's position whose next token starts at the same text offset; -1 where "
        "none (`compiled_loss.inputs.align_tokenizations` builds it).",
    ),
    "returns": DataKey("[B, S]", "float", "The value target (return) at each position."),
    "values": DataKey(
        "[B, S]", "float", "The rollout's values: with `cliprange`, new values are clipped to values ± cliprange."
    ),
    "student_logits": DataKey(
        "[B, S, V_d]",
        "float",
        "The drafter's logits over the draft vocabulary; position t is matched with the policy's logits at t+1 "
        "(draft id i is the policy's token i + d2t[i]).",
    ),
}
"""The glossary of data keys: every key of every loss's data `TypedDict` (`InputSpec.data`; a
teacher's keys with its index as `{i}`) and the training step's `input_ids` / `input_lengths`.
A `[B, S]` key follows NeMo-RL's alignment: entry t belongs to token t. `tools/data_keys.py`
prints the data-key tables of docs/library.md from it and the losses' `TypedDict`s."""


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
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        **loss_input: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@runtime_checkable
class DeclaresInputs(Protocol):
    """A loss that declares what it needs (every loss in `compiled_loss.losses` does)."""

    input_spec: InputSpec
