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
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    DPOLossFn,
    MseValueLossConfig,
    MseValueLossFn,
    NLLLossFn,
)

Family = Literal["policy_gradient", "nll", "dpo", "distillation", "value"]


def _loss_option(kind: str, config_cls: type | None, *extra: tuple[str, Any, Any]) -> type:
    return option_class(kind, config_cls, f"{kind.title().replace('_', '')}LossOption", __name__, *extra)


ClippedPgLossOption = _loss_option(
    "clipped_pg", ClippedPGLossConfig, ("seq_logprob_error_threshold", typing.Optional[float], None)
)
NllLossOption = _loss_option("nll", None)
DpoLossOption = _loss_option("dpo", DPOLossConfig)
DistillationLossOption = _loss_option("distillation", DistillationLossConfig)
MseValueLossOption = _loss_option("mse_value", MseValueLossConfig)

# option class -> (loss class, its config class, rollout family)
LOSS_KINDS: dict[type, tuple[type, type | None, Family]] = {
    ClippedPgLossOption: (ClippedPGLossFn, ClippedPGLossConfig, "policy_gradient"),
    NllLossOption: (NLLLossFn, None, "nll"),
    DpoLossOption: (DPOLossFn, DPOLossConfig, "dpo"),
    DistillationLossOption: (DistillationLossFn, DistillationLossConfig, "distillation"),
    MseValueLossOption: (MseValueLossFn, MseValueLossConfig, "value"),
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
        config_keys = {f.name for f in dataclasses.fields(config_cls)}
        extra = {k: values.pop(k) for k in list(values) if k not in config_keys}
        return loss_cls(config_cls(**values), **extra)
    except ConfigError as e:
        raise ConfigError(f"loss={name}: {e}") from None
