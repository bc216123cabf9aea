"""What the options of the `loss` and `draft` groups share. Each option class
(`compiled_loss.config.losses`, `compiled_loss.config.drafts`) subclasses the config
dataclass of its loss or drafter and `Option`: its keys are `name` and every field of that
config — the config class stays the one place that defines, documents and checks each of
them. An option redeclares only its config's closed string choices (`Literal`), as the
`enum.StrEnum`s written out beside it, because the Hydra application's structured configs
cannot hold a `Literal`; a `StrEnum` member equals its string, and `config_of` hands the
loss or drafter plain strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from typing import Any, TypeVar

from compiled_loss.checks import ConfigError

_C = TypeVar("_C")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """The first key of every `loss` and `draft` option (a base class, so it comes first)."""

    name: str = ""
    """The option's name: its YAML under `conf/<group>/`; options that only change defaults share a class
    (`grpo`, `dapo`, `gspo`, `cispo` and `reinforce` are `ClippedPgLossOption`s)."""


@contextlib.contextmanager
def named(key: str) -> Iterator[None]:
    """A ConfigError raised inside, with `key: ` in front (`loss=gspo: ratio_clip_c must be …`)."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def config_of(option: Any, cls: type[_C]) -> _C:
    """The `cls` config holding the option's values of `cls`'s fields (choices as plain strings)."""
    return cls(
        **{
            f.name: value.value if isinstance(value := getattr(option, f.name), enum.Enum) else value
            for f in dataclasses.fields(cls)
        }
    )
