"""The `loss` config group: one option dataclass per loss kind, generated from the loss's
own config dataclass (every field of it is a key), and `build_loss`.

Closed string choices (`Literal`) become Enums here, because the Hydra application's
structured configs cannot hold a `Literal`; `build_loss` turns them back into strings.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Literal

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


def _option_type(annotation: Any, name: str) -> Any:
    """`Literal[...]` (optionally `| None`) → an Enum of its values (`Optional[Enum]`)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return enum.Enum(name, {v: v for v in args}, module=__name__)
    if type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        if typing.get_origin(inner) is Literal:
            return typing.Optional[_option_type(inner, name)]
    return annotation


def _loss_option(kind: str, config_cls: type | None, *extra: tuple[str, Any, Any]) -> type:
    """Option dataclass of a loss kind: `name` plus every field of its config."""
    fields: list[tuple[str, Any, Any]] = [("name", str, dataclasses.field(default=kind))]
    if config_cls is not None:
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            option_type = _option_type(hints[f.name], f"{config_cls.__name__}_{f.name}")
            enum_cls = next((a for a in (option_type, *typing.get_args(option_type))
                             if isinstance(a, type) and issubclass(a, enum.Enum)), None)
            default = enum_cls(f.default) if enum_cls is not None and f.default is not None else f.default
            fields.append((f.name, option_type, dataclasses.field(default=default)))
    fields += [(n, t, dataclasses.field(default=d)) for n, t, d in extra]
    name = f"{kind.title().replace('_', '')}LossOption"
    option = dataclasses.make_dataclass(name, fields, kw_only=True)
    option.__module__ = __name__
    return option


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
    values = {
        f.name: value.value if isinstance(value := getattr(option, f.name), enum.Enum) else value
        for f in dataclasses.fields(option)
    }
    name = values.pop("name")
    try:
        if config_cls is None:
            return loss_cls()
        config_keys = {f.name for f in dataclasses.fields(config_cls)}
        extra = {k: values.pop(k) for k in list(values) if k not in config_keys}
        return loss_cls(config_cls(**values), **extra)
    except ConfigError as e:
        raise ConfigError(f"loss={name}: {e}") from None
