"""Process groups of a training run: tensor (vocabulary), context (sequence) and data
parallel, from `torchrun` (one node or many; gloo on CPU, NCCL on CUDA).

Ranks are laid out as a `(dp, cp, tp)` device mesh: `rank = (dp_rank · cp + cp_rank) · tp
+ tp_rank`. TP and CP ranks of one data-parallel replica see the same rows; each DP replica
sees its own share of the global batch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from compiled_loss.config import ParallelConfig
from compiled_loss.metrics import combine_metrics
from compiled_loss.parallel import group_rank, group_size


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The three process groups (None when their size is 1, or without torch.distributed)."""

    tp: Any = None
    cp: Any = None
    dp: Any = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        return group_size(self.tp), group_size(self.cp), group_size(self.dp)

    @property
    def rank(self) -> int:
        """Global rank (0 for a single process)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def rank_count(self) -> int:
        """Processes in the run."""
        tp, cp, dp = self.sizes
        return tp * cp * dp

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(cfg: ParallelConfig) -> ParallelGroups:
    """Initialise torch.distributed from torchrun's environment when the run has more than
    one rank, check `tp · cp · dp == WORLD_SIZE` (on every rank, before any collective) and
    build the `(dp, cp, tp)` mesh. A single-process run returns groups of None."""
    world = world_size_from_env()
    product = cfg.tp * cfg.cp * cfg.dp
    if product != world:
        raise ValueError(
            f"parallel.tp × parallel.cp × parallel.dp = {cfg.tp} × {cfg.cp} × {cfg.dp} = {product} must equal the "
            f"number of processes, {world} (torchrun --nproc-per-node × --nnodes)"
        )
    if world == 1:
        return ParallelGroups()
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = dist.device_mesh.init_device_mesh(device, (cfg.dp, cfg.cp, cfg.tp), mesh_dim_names=("dp", "cp", "tp"))

    def group(name: str, size: int):
        return mesh[name].get_group() if size > 1 else None

    return ParallelGroups(tp=group("tp", cfg.tp), cp=group("cp", cfg.cp), dp=group("dp", cfg.dp))


def all_reduce_host(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Host side (outside compiled code): the sum of `x` over `group` (identity without one)."""
    if group_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


def combine_over(metrics: dict[str, float], group: Any) -> dict[str, float]:
    """Host side: Python-float metrics of every rank of `group` combined through the metric
    registry (sums; min / max for extrema)."""
    if group_size(group) == 1:
        return metrics
    parts: list[Any] = [None] * group_size(group)
    dist.all_gather_object(parts, metrics, group=group)
    combined = combine_metrics([{k: torch.tensor(v, dtype=torch.float64) for k, v in p.items()} for p in parts])
    return {k: float(v) for k, v in combined.items()}
