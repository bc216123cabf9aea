"""Process-group checks. compiled_loss computes over one rank's full vocabulary and full
sequence: a tensor- or context-parallel group must span a single rank."""

from __future__ import annotations

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


def require_single_process(group: dist.ProcessGroup | None, name: str) -> None:
    """Raise NotImplementedError for a process group spanning more than one rank."""
    size = group_size(group)
    if size > 1:
        raise NotImplementedError(
            f"{name} has world size {size}; compiled_loss computes over one rank's full vocabulary "
            f"and sequence; pass {name}=None or a single-rank group"
        )
