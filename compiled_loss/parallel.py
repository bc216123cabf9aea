"""Process groups. Tensor/context parallelism (world size > 1) is not implemented yet."""

from __future__ import annotations

import torch.distributed as dist


def require_single_process(group: dist.ProcessGroup | None, name: str) -> None:
    """Raise NotImplementedError for a process group spanning more than one rank."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    if size > 1:
        raise NotImplementedError(
            f"{name} has world size {size}; tensor/context parallelism (world size > 1) is "
            f"not implemented yet — pass {name}=None or a single-rank group"
        )
