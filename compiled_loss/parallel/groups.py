"""Process groups: sizes and ranks (1 and 0 without a group or without torch.distributed),
and the host-side agreement check that runs before shape-dependent collectives."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of `group` (1 for None or when torch.distributed is not initialised)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group` (0 for None or when torch.distributed is not initialised)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def check_agreement(what: str, value: Any, *groups: dist.ProcessGroup | None) -> None:
    """Host side, before a collective whose shapes depend on `value`: every rank of each group
    holds an equal `value`; otherwise a ValueError naming every rank's value, raised on every
    rank (the values travel in one small all-gather, whatever their shapes)."""
    for group in groups:
        size = group_size(group)
        if size == 1:
            continue
        values: list[Any] = [None] * size
        dist.all_gather_object(values, value, group=group)
        if any(v != values[0] for v in values):
            listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"the ranks of a process group disagree on {what}: {listed}")
