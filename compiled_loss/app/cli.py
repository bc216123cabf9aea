"""The runner's command line around Hydra: `--help` from the configs' own field docstrings,
and configuration errors as one line (`error: …`, with a did-you-mean) and exit status 2.

Hydra composes the config after `check_overrides` has read the overrides against the
option files of each group (`conf/<group>/*.yaml`), the fields of each group's schema and
their types (parsed as Hydra parses them, checked as OmegaConf checks them), so neither a
typo nor a value of the wrong type reaches Hydra's multi-line errors; `load_config` checks
the values. With `HYDRA_FULL_ERROR=1` an error propagates with its traceback instead.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import os
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, RangeSweep
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from compiled_loss.app.store import GROUP_SCHEMAS, schema
from compiled_loss.checks import ConfigError
from compiled_loss.config import DRAFT_KINDS, LOSS_KINDS, Config

USAGE = "python -m compiled_loss.run [-m] [group=option ...] [group.key=value ...]"


def group_options(config_dirs: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Each config group's options: the YAML files under `conf/<group>/` (shipped in the
    package) and under `<dir>/<group>/` of each `--config-dir`."""
    options: dict[str, set[str]] = {}
    for conf in (resources.files("compiled_loss.conf"), *map(Path, config_dirs)):
        for d in conf.iterdir():
            if d.is_dir() and not d.name.startswith(("_", ".")):
                yamls = {f.name.removesuffix(".yaml") for f in d.iterdir() if f.name.endswith(".yaml")}
                options.setdefault(d.name, set()).update(yamls)
    return {group: sorted(names) for group, names in sorted(options.items())}


def _config_dirs(argv: list[str]) -> tuple[str, ...]:
    """The `--config-dir` / `-cd` directories of the command line."""
    dirs = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
    return tuple(dirs)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls` and its bases (first line each)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # no source (a class built at run time)
            continue
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _option_classes(group: str) -> list[type]:
    return list(LOSS_KINDS if group == "loss" else DRAFT_KINDS if group == "draft" else [GROUP_SCHEMAS[group]])


def _schema_of(group: str, option: str, config_dirs: tuple[str, ...]) -> type | None:
    """The option class a `loss` / `draft` option's YAML names (`/schema_<group>_<kind>`;
    None for an option that extends another one: every option's keys are then accepted)."""
    for conf in (resources.files("compiled_loss.conf"), *map(Path, config_dirs)):
        file = conf / group / f"{option}.yaml"
        if file.is_file():
            kind = re.search(rf"/schema_{group}_(\w+)@", file.read_text())
            return next((cls for cls in _option_classes(group) if kind and cls().name == kind[1]), None)
    return None


def _chosen_classes(group: str, argv: list[str]) -> list[type]:
    """The option classes whose fields `group.key=` sets: the schema; for `loss` / `draft`,
    the class of each option chosen on the command line (or the default's), every option
    class when one of them extends another option (its class is not named)."""
    if group not in ("loss", "draft"):
        return _option_classes(group)
    chosen = dict(_overrides(argv)).get(group, _DEFAULTS[group])
    classes = [_schema_of(group, option, _config_dirs(argv)) for option in chosen.split(",")]
    return _option_classes(group) if None in classes else list(dict.fromkeys(classes))


def _keys(group: str, argv: list[str]) -> list[str]:
    """The keys `group.key=` may set: the schema's fields; for `loss` / `draft`, those of the
    option chosen on the command line (or the default's; of every option for a sweep)."""
    classes = _chosen_classes(group, argv)
    if group in ("loss", "draft") and len(classes) > 1:
        classes = _option_classes(group)
    return sorted({f.name for cls in classes for f in dataclasses.fields(cls)} - {"name"})


def _describe(hint: Any) -> tuple[str, str, bool]:
    """(the name of a value of the type `hint`, what one looks like on the command line,
    whether null is one too)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = (arg for arg in args if arg is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        item, _, _ = _describe(typing.get_args(hint)[0])
        return f"list of {item}s", f"a list of {item}s in brackets", optional
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint.__name__, f"one of {', '.join(member.name for member in hint)}", optional
    kind, looks = {
        bool: ("bool", "true or false"),
        int: ("int", "a whole number"),
        float: ("float", "a number, like 0.5 or 1e-3"),
        str: ("string", "text; quote one that holds brackets, braces or commas"),
    }[hint]
    return kind, looks, optional


def _value_error(key: str, given: str, value: Any, hint: Any) -> str:
    """The one line that refuses `key=given` (Hydra's parse: `value`) for a field of type `hint`."""
    type_name, looks, optional = _describe(hint)
    if value is None and not optional:
        return f"{key}: null is not a valid {type_name} ({key} cannot be null; {looks})"
    if type_name.startswith("list") and not isinstance(value, (list, tuple)):
        looks = f"{looks}: {key}=[{given}]"
    elif type_name == "int" and isinstance(value, float) and value.is_integer():
        looks = f"{looks}: {key}={int(value)}"
    return f"{key}: {given} is not a valid {type_name}{' or null' if optional else ''} ({looks})"


def _takes(cls: type, field: str, value: Any) -> bool:
    """Whether Hydra's merge of `value` into the field `field` of the option class `cls`
    passes OmegaConf's type check (which converts `'7'` to 7 for an int and refuses `1e3`)."""
    node = schema(cls)
    try:
        node[field] = value
    except OmegaConfBaseException:
        return False
    return True


def check_value(key: str, given: str, classes: list[type], field: str, multirun: bool = False) -> None:
    """ConfigError, one line naming the key, for the override `key=given` (`group.field=…`)
    whose value — or a value of its sweep — is not of the type of `field` in any option class
    of `classes` that has it: parsed as Hydra parses it, checked as its merge checks it; also
    for a sweep outside a `multirun` (-m), which Hydra refuses as ambiguous."""
    try:
        override = OverridesParser.create().parse_override(f"{key}={given}")
    except HydraException as e:  # the override grammar's: one line each
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise ConfigError(f"{key}: {given} is not a valid value (Hydra's override grammar: {reason})") from None
    if override.is_sweep_override() and not multirun:
        raise ConfigError(
            f"{key}: {given} is a sweep, which runs with -m (--multirun); a list is written {key}=[{given}], "
            f"text quoted: {key}='{given}'"
        )
    if isinstance(override.value(), (ChoiceSweep, RangeSweep)):
        values = list(override.sweep_iterator())
    elif override.is_sweep_override():
        return  # a sweep a sweeper plugin draws (interval, glob): its values are the plugin's
    else:
        values = [override.value()]
    refusals = []
    for cls in (cls for cls in classes if field in {f.name for f in dataclasses.fields(cls)}):
        bad = [value for value in values if not _takes(cls, field, value)]
        if not bad:
            return
        shown = (given or "''") if len(values) == 1 else "null" if bad[0] is None else str(bad[0])
        refusals.append(_value_error(key, shown, bad[0], typing.get_type_hints(cls)[field]))
    if refusals:
        raise ConfigError(refusals[0])


_DEFAULTS = {"loss": "clipped_pg", "draft": "none"}  # conf/config.yaml's defaults list


def _suggest(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _overrides(argv: list[str]) -> Iterator[tuple[str, str]]:
    """`(key, value)` of each plain override and of each `++` one (Hydra's own `hydra.*`, the
    `+` / `~` forms and flags skipped)."""
    for arg in argv:
        arg = arg.removeprefix("++")
        if arg.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        yield key, value


def check_overrides(argv: list[str]) -> None:
    """ConfigError for an override that names no group, no option of its group or no key of
    its group's schema, with the closest valid name, or whose value is not of the key's type
    (`check_value`)."""
    options = group_options(_config_dirs(argv))
    top = [f.name for f in dataclasses.fields(Config)]
    multirun = bool({"-m", "--multirun", "hydra.mode=MULTIRUN"} & set(argv))
    for key, value in _overrides(argv):
        group, _, field = key.partition(".")
        if group not in top:
            raise ConfigError(f"{key}={value}: no config group {group!r}{_suggest(group, top)} (groups: {top})")
        if not field:
            if group not in options:
                raise ConfigError(f"{key}={value}: {group} is set through its keys ({group}.<key>=…)")
            if "," in value and not multirun:
                raise ConfigError(f"{key}={value}: a sweep over {group} options runs with -m (--multirun)")
            for choice in value.split(","):  # a sweep (-m) lists several
                if choice not in options[group]:
                    raise ConfigError(
                        f"{key}={choice}: no such {group} option{_suggest(choice, options[group])} "
                        f"(options: {', '.join(options[group])})"
                    )
            continue
        keys = _keys(group, argv)
        if field not in keys:
            raise ConfigError(f"{key}: unknown key{_suggest(field, keys)} (keys of {group}: {', '.join(keys)})")
        check_value(key, value, _chosen_classes(group, argv), field, multirun=multirun)


def help_text() -> str:
    """`--help`: usage, each group's options, and each key with its default and docstring."""
    lines = [f"usage: {USAGE}", "", "== Configuration groups ==", "Compose your configuration from those groups:", ""]
    lines += [f"{group}: {', '.join(names)}" for group, names in group_options().items()]
    lines += ["", "== Config ==", "Each key, its default (of the default option) and what it does:"]
    for group in [f.name for f in dataclasses.fields(Config)]:
        lines += ["", f"{group}:"]
        for cls in _option_classes(group):
            docs, prefix = field_docs(cls), ""
            if group in ("loss", "draft"):
                lines.append(f"  [{cls().name}] {' '.join((cls.__doc__ or '').split(chr(10) * 2)[0].split())}")
                prefix = "  "
            for f in dataclasses.fields(cls):
                if f.name == "name":
                    continue
                default = f.default if f.default is not dataclasses.MISSING else "…"
                lines.append(f"{prefix}  {group}.{f.name}={default}  {docs.get(f.name, '')}".rstrip())
    lines += ["", "Errors in the configuration print one line and exit with status 2 (HYDRA_FULL_ERROR=1: traceback)."]
    return "\n".join(lines)


def fail(error: Exception) -> None:
    """Print `error: …` on stderr, one line (a message's line breaks joined with `; `), and exit
    with status 2 (re-raise under HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    line = re.sub(r"\s*\n\s*", "; ", str(error).strip())  # one line, always
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


def run(main: Callable[[], Any], argv: list[str]) -> Any:
    """`main` (the Hydra entry point) behind the help and the override checks."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        check_overrides(argv)
    except ConfigError as e:
        fail(e)
    return main()
