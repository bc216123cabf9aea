"""The runner's command line around Hydra: `--help` from the configs' own field docstrings,
and configuration errors as one line (`error: …`, with a did-you-mean) and exit status 2.

Hydra composes the config after `check_overrides` has read the overrides against the
option files of each group (`conf/<group>/*.yaml`) and the fields of each group's schema,
so a typo never reaches Hydra's multi-line errors; `load_config` checks the values. With
`HYDRA_FULL_ERROR=1` an error propagates with its traceback instead.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from compiled_loss.app.store import GROUP_SCHEMAS
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


def _keys(group: str, argv: list[str]) -> list[str]:
    """The keys `group.key=` may set: the schema's fields; for `loss` / `draft`, those of the
    option chosen on the command line (or the default's)."""
    classes = _option_classes(group)
    if group in ("loss", "draft"):
        chosen = dict(_overrides(argv)).get(group, _DEFAULTS[group])
        if "," not in chosen and (cls := _schema_of(group, chosen, _config_dirs(argv))) is not None:
            classes = [cls]
    return sorted({f.name for cls in classes for f in dataclasses.fields(cls)} - {"name"})


_DEFAULTS = {"loss": "clipped_pg", "draft": "none"}  # conf/config.yaml's defaults list


def _suggest(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _overrides(argv: list[str]) -> Iterator[tuple[str, str]]:
    """`(key, value)` of each plain override (Hydra's own `hydra.*`, `+` / `~` / `++` forms and flags skipped)."""
    for arg in argv:
        if arg.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        yield key, value


def check_overrides(argv: list[str]) -> None:
    """ConfigError for an override that names no group, no option of its group or no key of
    its group's schema, with the closest valid name."""
    options = group_options(_config_dirs(argv))
    top = [f.name for f in dataclasses.fields(Config)]
    for key, value in _overrides(argv):
        group, _, field = key.partition(".")
        if group not in top:
            raise ConfigError(f"{key}={value}: no config group {group!r}{_suggest(group, top)} (groups: {top})")
        if not field:
            if group not in options:
                raise ConfigError(f"{key}={value}: {group} is set through its keys ({group}.<key>=…)")
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
    """Print `error: …` on stderr and exit with status 2 (re-raise under HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)
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
