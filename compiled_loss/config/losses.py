"""The `loss` config group: one option dataclass per loss kind, generated from the loss's
own config dataclass (every field of it is a key, `compiled_loss.config.options`), and
`build_loss`."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from compiled_loss.config.options import option_class, option_values
from compiled_loss.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    ConfigError,
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


def _loss_option(kind: str, config_cls: type | tuple[type, ...] | None, *extra: tuple[str, Any, Any]) -> type:
    return option_class(kind, config_cls, f"{kind.title().replace('_', '')}LossOption", __name__, *extra)


ClippedPgLossOption = _loss_option(
    "clipped_pg", ClippedPGLossConfig, ("seq_logprob_error_threshold", typing.Optional[float], None)
)
NllLossOption = _loss_option("nll", None)
DpoLossOption = _loss_option("dpo", DPOLossConfig)
MpoLossOption = _loss_option("mpo", MPOLossConfig)
DistillationLossOption = _loss_option("distillation", DistillationLossConfig)
CrossTokenizerLossOption = _loss_option("cross_tokenizer", CrossTokenizerDistillationLossConfig)
MseValueLossOption = _loss_option("mse_value", MseValueLossConfig)
OpdFullLossOption = _loss_option("opd_full", (ClippedPGLossConfig, OPDFullConfig))

# option class -> (keyword, config class) of a second config its loss takes (its fields are keys of the option)
_KEYWORD_CONFIGS: dict[type, tuple[str, type]] = {OpdFullLossOption: ("opd_full", OPDFullConfig)}

# option class -> (loss class, its config class, rollout family)
LOSS_KINDS: dict[type, tuple[type, type | None, Family]] = {
    ClippedPgLossOption: (ClippedPGLossFn, ClippedPGLossConfig, "policy_gradient"),
    NllLossOption: (NLLLossFn, None, "nll"),
    DpoLossOption: (DPOLossFn, DPOLossConfig, "dpo"),
    MpoLossOption: (MPOLossFn, MPOLossConfig, "dpo"),
    DistillationLossOption: (DistillationLossFn, DistillationLossConfig, "distillation"),
    CrossTokenizerLossOption: (
        CrossTokenizerDistillationLossFn,
        CrossTokenizerDistillationLossConfig,
        "cross_tokenizer",
    ),
    MseValueLossOption: (MseValueLossFn, MseValueLossConfig, "value"),
    OpdFullLossOption: (ClippedPGLossFn, ClippedPGLossConfig, "opd_full"),
}


def loss_family(option: Any) -> Family:
    """Which data a loss option trains on (policy-gradient rollouts, pairs, …)."""
    return LOSS_KINDS[type(option)][2]


def build_loss(option: Any) -> Any:
    """The loss object a `loss` option describes (ConfigError prefixed with `loss=<name>`)."""
    loss_cls, config_cls, _ = LOSS_KINDS[type(option)]
    values = option_values(option)
    name = values.pop("name")
    try:
        if config_cls is None:
            return loss_cls()
        if type(option) in _KEYWORD_CONFIGS:
            keyword, second = _KEYWORD_CONFIGS[type(option)]
            second_keys = {f.name for f in dataclasses.fields(second)}
            extra = {keyword: second(**{k: values.pop(k) for k in list(values) if k in second_keys})}
        else:
            extra = {}
        config_keys = {f.name for f in dataclasses.fields(config_cls)}
        extra.update({k: values.pop(k) for k in list(values) if k not in config_keys})
        return loss_cls(config_cls(**values), **extra)
    except ConfigError as e:
        raise ConfigError(f"loss={name}: {e}") from None
