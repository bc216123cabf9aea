"""Option dataclasses generated from a config dataclass: the options of the `loss` and
`draft` groups are `name` plus every field of the loss's / drafter's own config, so each
field is a key and the config class stays the one place that defines and checks it.

Closed string choices (`Literal`) become Enums, because the Hydra application's structured
configs cannot hold a `Literal`; `option_values` turns them back into strings.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Literal


def _option_type(annotation: Any, name: str, module: str) -> Any:
    """`Literal[...]` (optionally `| None`) → an Enum of its values (`Optional[Enum]`)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return enum.Enum(name, {v: v for v in args}, module=module)
    if type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        if typing.get_origin(inner) is Literal:
            return typing.Optional[_option_type(inner, name, module)]
    return annotation


def option_class(
    kind: str, config_cls: type | tuple[type, ...] | None, class_name: str, module: str, *extra: tuple[str, Any, Any]
) -> type:
    """The option dataclass `class_name` (defined in `module`) of a kind: `name` (= `kind`),
    every field of `config_cls` (of each class, when a tuple) with its default, then the
    `extra` (name, type, default)."""
    fields: list[tuple[str, Any, Any]] = [("name", str, dataclasses.field(default=kind))]
    classes = config_cls if isinstance(config_cls, tuple) else (config_cls,) if config_cls is not None else ()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            option_type = _option_type(hints[f.name], f"{cls.__name__}_{f.name}", module)
            enum_cls = next(
                (
                    a
                    for a in (option_type, *typing.get_args(option_type))
                    if isinstance(a, type) and issubclass(a, enum.Enum)
                ),
                None,
            )
            default = enum_cls(f.default) if enum_cls is not None and f.default is not None else f.default
            fields.append((f.name, option_type, dataclasses.field(default=default)))
    fields += [(n, t, dataclasses.field(default=d)) for n, t, d in extra]
    option = dataclasses.make_dataclass(class_name, fields, kw_only=True)
    option.__module__ = module
    return option


def option_values(option: Any) -> dict[str, Any]:
    """An option's fields as plain values (Enums back to their strings)."""
    return {
        f.name: value.value if isinstance(value := getattr(option, f.name), enum.Enum) else value
        for f in dataclasses.fields(option)
    }
