"""Config checks every config dataclass uses (DESIGN: "all validation of one object in one
place"): `ConfigError`, and the single-field type / finiteness checks.

`ConfigError` is both a `ValueError` and an `AssertionError`: the reference asserts (older
releases) or raises ValueError (newer), and code written against either still catches it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


class ConfigError(ValueError, AssertionError):
    """A refused loss configuration (a ValueError and an AssertionError)."""


def _type_error(name: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def check_value(name: str, value: Any, annotation: Any) -> None:
    """ConfigError unless `value` has type `annotation` (bool, int, float, str, Literal,
    optionally `| None`). Ints pass for floats, bools never pass for numbers, and a float
    must be finite (NaN and ±inf fail)."""
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
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(name, "a float", value)
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value}")
    elif annotation is str:
        if not isinstance(value, str):
            raise _type_error(name, "a str", value)


def check_fields(cfg: Any) -> None:
    """Type and finiteness of every field of a config dataclass (see `check_value`)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        check_value(f.name, getattr(cfg, f.name), hints[f.name])


def require(ok: bool, message: str) -> None:
    """ConfigError(message) unless `ok`. Write checks so that NaN fails them (`not (x > 0)`)."""
    if not ok:
        raise ConfigError(message)
