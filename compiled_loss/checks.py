"""Config checks every config dataclass uses (DESIGN: "all validation of one object in one
place"): `ConfigError`, the single-field type / range checks, and the bound on a factor an
option scales a loss by.

Options are checked in the dtype they are used in: a float must be representable in
float32, the dtype the losses and the model compute in (bfloat16 shares its exponent
range), an int in int64, the dtype of every size and id that reaches torch.

`ConfigError` is both a `ValueError` and an `AssertionError`: the reference asserts (older
releases) or raises ValueError (newer), and code written against either still catches it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import torch

FLOAT32 = torch.finfo(torch.float32)
INT64 = torch.iinfo(torch.int64)

FACTOR_MAX = 1e6
"""The largest factor an option may scale a loss's gradient by (a loss weight, β, the
reciprocal of a temperature, a lower clamp of importance weights) or the logits of a softmax
by; 1 / FACTOR_MAX is the smallest nonzero one. The gradient norm and AdamW's second moment
sum float32 squares, which overflow above sqrt(3.4e38) ≈ 1.8e19 and vanish below ≈ 1e-19.
Measured on the embedded model (grad_norm 11.7 at factor 1, proportional to the factor):
`loss.reference_policy_kl_penalty=1e30` or `logprob.temperature=1e-20` give grad_norm inf,
`logprob.temperature=1e30` or `loss.reference_policy_kl_penalty=1e-30` (DPO) a zero gradient —
no update either way, and no error. The range leaves a factor of 1e13 either way for the
gradient norm at factor 1; a nonzero factor below 1e-6 is also lost to float32 rounding
(2^-24 ≈ 6e-8) beside a term of factor 1."""


class ConfigError(ValueError, AssertionError):
    """A refused loss configuration (a ValueError and an AssertionError)."""


def _type_error(name: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def check_value(name: str, value: Any, annotation: Any) -> None:
    """ConfigError unless `value` has type `annotation` (bool, int, float, str, Literal,
    optionally `| None`). Ints pass for floats, bools never pass for numbers; a float must be
    finite (NaN and ±inf fail) and representable in float32 (0 or a magnitude in [1.18e-38,
    3.40e38]: a larger one overflows, a smaller one rounds to 0 or loses its precision), an
    int must fit in int64."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return
        annotation, origin = args[0], typing.get_origin(args[0])
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        if value not in choices or not isinstance(value, str):
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    elif annotation is bool:
        if not isinstance(value, bool):
            raise _type_error(name, "a bool", value)
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(name, "an int", value)
        if not INT64.min <= value <= INT64.max:
            raise ConfigError(f"{name} must fit in int64 (|x| < 2**63), got {value}")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(name, "a float", value)
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value}")
        if value != 0 and not FLOAT32.smallest_normal <= abs(value) <= FLOAT32.max:
            raise ConfigError(
                f"{name} must be 0 or of magnitude in [{FLOAT32.smallest_normal:.8g}, {FLOAT32.max:.8g}] (float32, "
                f"the dtype the losses and the model compute in), got {value}"
            )
    elif annotation is str:
        if not isinstance(value, str):
            raise _type_error(name, "a str", value)


def check_fields(cfg: Any) -> None:
    """Type and finiteness of every field of a config dataclass (see `check_value`)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        check_value(f.name, getattr(cfg, f.name), hints[f.name])


def check_factor(name: str, value: float | None, role: str = "it scales the loss's gradient") -> None:
    """ConfigError unless `value` (>= 0; None: unused) is 0 or within [1 / FACTOR_MAX,
    FACTOR_MAX] (the reason: `FACTOR_MAX`); `role` says what the value scales."""
    require(
        value is None or value == 0 or 1 / FACTOR_MAX <= value <= FACTOR_MAX,
        f"{name}={value} is outside [{1 / FACTOR_MAX:g}, {FACTOR_MAX:g}]: {role}, and float32 squares of the "
        "gradient overflow (grad_norm inf, no update) or vanish outside that range",
    )


def require(ok: bool, message: str) -> None:
    """ConfigError(message) unless `ok`. Write checks so that NaN fails them (`not (x > 0)`)."""
    if not ok:
        raise ConfigError(message)
