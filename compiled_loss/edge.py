"""The package-level names of `inputs`, `packing`, `vocab` and `losses` whose code has the
seed's signatures and so lives in the edge room `compiled_loss.nemo_rl`: each of those
packages resolves them on first access (a module `__getattr__`, PEP 562), once both rooms
are loaded, so the name keeps working where it was exported and no import points up the
layers (`tests/test_architecture.py` checks that every one resolves to the edge's object)."""

from __future__ import annotations

import importlib


def edge_attribute(package: str, name: str, names: dict[str, str]) -> object:
    """`name` of the edge module `names[name]` (`compiled_loss.nemo_rl.<module>`);
    AttributeError, as for any missing attribute of `package`, for a name not in `names`."""
    module = names.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"compiled_loss.nemo_rl.{module}"), name)
