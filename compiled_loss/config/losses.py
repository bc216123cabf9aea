"""The `loss` config group: one option class per loss kind, each its loss's config dataclass
plus `name` (`compiled_loss.config.options`), the Enums of the configs' closed choices,
`build_loss`, and the registry of kinds: `LOSS_KINDS` maps each option class to its
`LossKind` — everything the application, the memory estimate and the audit read of a loss
(its models, its data, the function that fills its batch's data keys), declared once here."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from compiled_loss.config.options import Option, config_of, named
from compiled_loss.inputs import OPD_FULL_TEACHER_PAYLOAD_FIELD
from compiled_loss.interfaces import LossFunction
from compiled_loss.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    CrossTokenizerDistillationLossConfig,
    CrossTokenizerDistillationLossFn,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    DPOLossFn,
    MPOLossConfig,
    MPOLossFn,
    MseValueLossConfig,
    MseValueLossFn,
    NLLLossFn,
    OPDFullConfig,
)

Family = Literal["policy_gradient", "nll", "dpo", "distillation", "value", "opd_full", "cross_tokenizer"]


class KlEstimator(enum.StrEnum):
    """`ClippedPGLossConfig.reference_policy_kl_type`."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


# `ClippedPGLossConfig.truncated_importance_sampling_type`: Hydra reads a choice by its member's name, and
# `seq-mask-tis` is no identifier, so the members are listed rather than written as a class body
TisType = enum.StrEnum(
    "TisType", [("tis", "tis"), ("icepop", "icepop"), ("seq-mask-tis", "seq-mask-tis")], module=__name__
)


class MetricsLevel(enum.StrEnum):
    """`ClippedPGLossConfig.metrics_level`."""

    full = "full"
    minimal = "minimal"


class KlType(enum.StrEnum):
    """`DistillationLossConfig.kl_type`."""

    forward = "forward"
    reverse = "reverse"
    mixed = "mixed"


class KdLossMode(enum.StrEnum):
    """`CrossTokenizerDistillationLossConfig.kd_loss_mode`."""

    sum = "sum"
    averaged_logits = "averaged_logits"
    select_teacher = "select_teacher"


class SumWeightsMetric(enum.StrEnum):
    """`CrossTokenizerDistillationLossConfig.sum_weights_metric`."""

    ce = "ce"
    entropy = "entropy"
    max_prob = "max_prob"


class TeacherPayload(enum.StrEnum):
    """`OPDFullConfig.teacher_payload`."""

    logits = "logits"
    hidden_states = "hidden_states"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ClippedPgChoices(ClippedPGLossConfig):
    """`ClippedPGLossConfig` with its closed choices as Enums: the fields of the `clipped_pg` and
    `opd_full` options."""

    reference_policy_kl_type: KlEstimator = KlEstimator.k3
    truncated_importance_sampling_type: TisType | None = None
    metrics_level: MetricsLevel = MetricsLevel.full


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClippedPgLossOption(_ClippedPgChoices, Option):
    """`loss=clipped_pg` (and `grpo`, `dapo`, `gspo`, `cispo`, `reinforce`): `ClippedPGLossFn`; every field of
    `ClippedPGLossConfig` is a key."""

    name: str = "clipped_pg"
    seq_logprob_error_threshold: float | None = None
    """Mean exp|lp - lp_gen| above which `seq_logprob_error_in_loss` drops a sequence (>= 0); None: no filter."""

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> ClippedPGLossFn:
        """The loss this option describes."""
        return ClippedPGLossFn(
            config_of(self, ClippedPGLossConfig), seq_logprob_error_threshold=self.seq_logprob_error_threshold
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class NllLossOption(Option):
    """`loss=nll`: `NLLLossFn` (SFT on the rollouts; no keys of its own)."""

    name: str = "nll"

    def build(self) -> NLLLossFn:
        """The loss this option describes."""
        return NLLLossFn()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoLossOption(DPOLossConfig, Option):
    """`loss=dpo`: `DPOLossFn`; every field of `DPOLossConfig` is a key."""

    name: str = "dpo"

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> DPOLossFn:
        """The loss this option describes."""
        return DPOLossFn(config_of(self, DPOLossConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MpoLossOption(MPOLossConfig, Option):
    """`loss=mpo`: `MPOLossFn`; every field of `MPOLossConfig` is a key."""

    name: str = "mpo"

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> MPOLossFn:
        """The loss this option describes."""
        return MPOLossFn(config_of(self, MPOLossConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillationLossOption(DistillationLossConfig, Option):
    """`loss=distillation`: `DistillationLossFn`; every field of `DistillationLossConfig` is a key."""

    name: str = "distillation"
    kl_type: KlType = KlType.mixed

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> DistillationLossFn:
        """The loss this option describes."""
        return DistillationLossFn(config_of(self, DistillationLossConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossTokenizerLossOption(CrossTokenizerDistillationLossConfig, Option):
    """`loss=cross_tokenizer`: `CrossTokenizerDistillationLossFn`; every field of
    `CrossTokenizerDistillationLossConfig` is a key."""

    name: str = "cross_tokenizer"
    kd_loss_mode: KdLossMode = KdLossMode.sum
    sum_weights_metric: SumWeightsMetric | None = None

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> CrossTokenizerDistillationLossFn:
        """The loss this option describes."""
        return CrossTokenizerDistillationLossFn(config_of(self, CrossTokenizerDistillationLossConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MseValueLossOption(MseValueLossConfig, Option):
    """`loss=mse_value`: `MseValueLossFn`; every field of `MseValueLossConfig` is a key."""

    name: str = "mse_value"

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            super().__post_init__()

    def build(self) -> MseValueLossFn:
        """The loss this option describes."""
        return MseValueLossFn(config_of(self, MseValueLossConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpdFullLossOption(OPDFullConfig, _ClippedPgChoices, Option):
    """`loss=opd_full`: `ClippedPGLossFn` with its full-vocabulary distillation branch; every field
    of `ClippedPGLossConfig` and of `OPDFullConfig` is a key."""

    name: str = "opd_full"
    teacher_payload: TeacherPayload = TeacherPayload.logits

    def __post_init__(self) -> None:
        with named(f"loss={self.name}"):
            ClippedPGLossConfig.__post_init__(self)
            OPDFullConfig.__post_init__(self)

    def build(self) -> ClippedPGLossFn:
        """The loss this option describes."""
        return ClippedPGLossFn(config_of(self, ClippedPGLossConfig), opd_full=config_of(self, OPDFullConfig))


class Teacher(enum.Enum):
    """The teacher a loss kind reads: none, a model of the policy's tokenizer (`distillation`,
    `opd_full`) or the digit teachers of another tokenizer (`cross_tokenizer`)."""

    none = "none"
    same_tokenizer = "same_tokenizer"
    cross_tokenizer = "cross_tokenizer"


class ModelOutputs(Protocol):
    """What a `LossKind.fill` reads of the models for one batch (no gradients); the
    application makes it (`compiled_loss.app.batches.rollout`)."""

    topk: int
    """The teacher's top-k logits a distillation batch carries (`data.teacher_topk`)."""

    def policy_logprobs(self) -> torch.Tensor:
        """`[B, S]`: the policy's log-probs as the loss takes them (0 in column 0)."""
        ...

    def reference_logprobs(self) -> torch.Tensor:
        """`[B, S]`: the frozen reference's unfiltered log-probs (0 in column 0)."""
        ...

    def teacher_logits(self) -> torch.Tensor:
        """`[B, S, V]`: the teacher's logits (ValueError without a teacher)."""
        ...

    def policy_outputs(self) -> torch.Tensor:
        """`[B, S, V]`: the policy's raw outputs (a value head's values `[B, S, 1]`)."""
        ...


Batch = dict[str, torch.Tensor]


def _fill_policy_gradient(batch: Batch, models: ModelOutputs) -> Batch:
    """The previous policy's log-probs, the reference's (also the generation log-probs where
    the batch has none of its own)."""
    out = dict(batch)
    out["prev_logprobs"] = models.policy_logprobs()
    reference = models.reference_logprobs()
    out.setdefault("generation_logprobs", reference)
    out["reference_policy_logprobs"] = reference
    return out


def _fill_pairs(batch: Batch, models: ModelOutputs) -> Batch:
    """The reference's log-probs, pre-rolled left by one (ref §1.2)."""
    return {**batch, "reference_policy_logprobs": torch.roll(models.reference_logprobs(), -1, 1)}


def _fill_distillation(batch: Batch, models: ModelOutputs) -> Batch:
    """The teacher's top-k logits and their token ids."""
    top = torch.topk(models.teacher_logits(), models.topk, dim=-1)
    return {**batch, "teacher_topk_logits": top.values, "teacher_topk_indices": top.indices}


def _fill_opd_full(batch: Batch, models: ModelOutputs) -> Batch:
    """On-policy distillation: the teacher's full logits; the reference for β != 0."""
    out = {**batch, OPD_FULL_TEACHER_PAYLOAD_FIELD: models.teacher_logits()}
    out["reference_policy_logprobs"] = models.reference_logprobs()
    return out


def _fill_value(batch: Batch, models: ModelOutputs) -> Batch:
    """The value head's values and the Monte-Carlo returns (the reward at every response token)."""
    return {
        **batch,
        "values": models.policy_outputs().squeeze(-1),
        "returns": batch["rewards"][:, None] * batch["token_mask"],
    }


def _fill_nothing(batch: Batch, models: ModelOutputs) -> Batch:
    """No model outputs (NLL; the cross-tokenizer teachers annotate apart: `Teacher.cross_tokenizer`)."""
    return dict(batch)


@dataclasses.dataclass(frozen=True)
class LossKind:
    """What the application, the memory estimate and the audit know of a loss: one per family
    of the data it trains on, `LOSS_KINDS` maps each option class to its kind."""

    family: Family
    """The data it trains on (the `rollout` family)."""
    fill: Callable[[Batch, ModelOutputs], Batch]
    """`fill(batch, models) -> batch`: the batch with the model-made data keys the loss's
    `InputSpec` names (the rows' own keys come with the batch)."""
    value_head: bool = False
    """The policy is a value head (no LM head: no warm start, no sampling, no drafter)."""
    teacher: Teacher = Teacher.none
    """The teacher models the run builds."""
    pairs: bool = False
    """It trains on (chosen, rejected) pairs: each sampled group's best and worst response."""
    samples: bool = True
    """The policy samples its rows (a value head trains on pre-made rows)."""
    clean: bool = False
    """It trains on the correct responses (the warm start's data), not on samples."""
    state_copies: int = 7
    """The policy-sized tensors the memory estimate counts: the policy, its gradient, the KL
    reference, two AdamW (the warm start's, the loss's) × two moments, and a teacher."""
    fused_head: bool = True
    """The fused LM head (`logprob.fused_linear`) can serve it (no value head, no full logits)."""
    reward_shift: bool = False
    """The driver carries a running reward shift δ in its batches (MPO)."""
    key_metrics: tuple[str, ...] = ()
    """The metrics shown on a step's line (when present)."""


POLICY_GRADIENT = LossKind(
    "policy_gradient",
    _fill_policy_gradient,
    key_metrics=("probs_ratio", "kl_penalty", "sampling_importance_ratio"),
)
NLL = LossKind("nll", _fill_nothing, clean=True)
DPO = LossKind("dpo", _fill_pairs, pairs=True, key_metrics=("accuracy", "rewards_chosen_mean", "rewards_rejected_mean"))
MPO = dataclasses.replace(DPO, reward_shift=True)
DISTILLATION = LossKind("distillation", _fill_distillation, teacher=Teacher.same_tokenizer, state_copies=8)
CROSS_TOKENIZER = LossKind(
    "cross_tokenizer",
    _fill_nothing,
    teacher=Teacher.cross_tokenizer,
    fused_head=False,
    key_metrics=("kl_loss", "ce_loss", "accuracy"),
)
VALUE = LossKind(
    "value", _fill_value, value_head=True, samples=False, fused_head=False, key_metrics=("values_mean", "vf_clipfrac")
)
OPD_FULL = LossKind(
    "opd_full",
    _fill_opd_full,
    teacher=Teacher.same_tokenizer,
    state_copies=8,
    fused_head=False,
    key_metrics=("opd_full_reverse_kl",),
)

LossOption = (
    ClippedPgLossOption
    | OpdFullLossOption
    | NllLossOption
    | DpoLossOption
    | MpoLossOption
    | DistillationLossOption
    | CrossTokenizerLossOption
    | MseValueLossOption
)
"""A `loss` option: one of the keys of `LOSS_KINDS`."""

# option class -> its kind
LOSS_KINDS: dict[type, LossKind] = {
    ClippedPgLossOption: POLICY_GRADIENT,
    OpdFullLossOption: OPD_FULL,
    NllLossOption: NLL,
    DpoLossOption: DPO,
    MpoLossOption: MPO,
    DistillationLossOption: DISTILLATION,
    CrossTokenizerLossOption: CROSS_TOKENIZER,
    MseValueLossOption: VALUE,
}

# family -> its kind (the pairs: DPO's)
LOSS_FAMILIES: dict[str, LossKind] = {
    kind.family: kind for kind in (POLICY_GRADIENT, NLL, DPO, DISTILLATION, CROSS_TOKENIZER, VALUE, OPD_FULL)
}

# option class -> the other `loss` options of the class (conf/loss/<name>.yaml) whose defaults give
# graphs of their own (sequence-level ratios, other surrogates): the audit audits each apart
LOSS_PRESETS: dict[type, tuple[str, ...]] = {ClippedPgLossOption: ("gspo", "cispo", "reinforce")}


def loss_kind(option: Option) -> LossKind:
    """The kind of a loss option: what the run builds and feeds it."""
    return LOSS_KINDS[type(option)]


def loss_family(option: Option) -> Family:
    """Which data a loss option trains on (policy-gradient rollouts, pairs, …)."""
    return loss_kind(option).family


def loss_names() -> dict[str, type]:
    """Every `loss` option name that builds a graph of its own -> its option class: each class's
    own name and its presets (`LOSS_PRESETS`)."""
    return {name: cls for cls in LOSS_KINDS for name in (cls().name, *LOSS_PRESETS.get(cls, ()))}


def build_loss(option: Any) -> LossFunction:
    """The loss object a `loss` option (one of `LOSS_KINDS`) describes (ConfigError prefixed
    with `loss=<name>`)."""
    with named(f"loss={option.name}"):
        return option.build()
