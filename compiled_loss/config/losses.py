"""The `loss` config group: one option class per loss kind, each its loss's config dataclass
plus `name` (`compiled_loss.config.options`), the Enums of the configs' closed choices, and
`build_loss`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

from compiled_loss.config.options import Option, config_of, named
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


# option class -> the data its loss trains on
LOSS_KINDS: dict[type, Family] = {
    ClippedPgLossOption: "policy_gradient",
    NllLossOption: "nll",
    DpoLossOption: "dpo",
    MpoLossOption: "dpo",
    DistillationLossOption: "distillation",
    CrossTokenizerLossOption: "cross_tokenizer",
    MseValueLossOption: "value",
    OpdFullLossOption: "opd_full",
}


def loss_family(option: Option) -> Family:
    """Which data a loss option trains on (policy-gradient rollouts, pairs, …)."""
    return LOSS_KINDS[type(option)]


def build_loss(option: Any) -> LossFunction:
    """The loss object a `loss` option (one of `LOSS_KINDS`) describes (ConfigError prefixed
    with `loss=<name>`)."""
    with named(f"loss={option.name}"):
        return option.build()
