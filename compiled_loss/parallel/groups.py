"""Process groups: sizes and ranks (1 and 0 without a group or without torch.distributed),
`ParallelGroups` (the one object that carries a run's tensor-, context- and data-parallel
groups from the step down to the collectives), and the host-side agreement check that runs
before shape-dependent collectives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def same_group(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether `a` and `b` hold the same ranks (None, or a group of one rank: no group); the
    same object is (no call)."""
    if a is b:
        return True
    a, b = (g if group_size(g) > 1 else None for g in (a, b))
    if a is None or b is None:
        return a is b
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def group_size(group: ProcessGroup | None) -> int:
    """World size of `group` (1 for None or when torch.distributed is not initialised)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in `group` (0 for None or when torch.distributed is not initialised)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The tensor- (vocabulary), context- (sequence) and data-parallel process groups; None
    where a size is 1 or without torch.distributed. Passed as one argument from the training
    step and the wrappers down to the collectives: `tp` is the vocabulary group the vocab
    primitive reduces over, `cp` the context group the token view shards positions over,
    `dp` the group the normalisers and metrics are summed over (every rank that reads rows of
    its own: the replicas and the FSDP shards together). `mesh`: the run's `DeviceMesh`
    (dimensions `dp`, `dp_shard_cp`, `tp`) the model is sharded on; None for a single
    process or for groups that do not come from a training run's mesh."""

    tp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    mesh: DeviceMesh | None = None
    vocab_size: int | None = None
    """The vocabulary's size where its `tp` shards were padded to equal widths (uneven DTensor
    shards, `compiled_loss.vocab.shards`); None: `V_local · tp`."""

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


def _signature(value: Any) -> Any:
    """A tensor as `dtype[shape]` (what a collective over it depends on); anything else as is."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return value


def check_agreement(what: str, value: Any, *groups: ProcessGroup | None) -> None:
    """Host side, before a collective whose shapes depend on `value`: every rank of each group
    holds an equal `value`; otherwise a ValueError naming every rank's value, raised on every
    rank of the groups (the values travel in one small all-gather per group, whatever their
    shapes).

    `value` may be a dict of named items, each compared on its own (a tensor by its dtype and
    shape); the error then lists only the items the ranks disagree on. Several groups (the
    tensor- and the context-parallel group of a grid) are gathered one after the other, each
    passing on what the previous gathered, so every rank of the grid sees every rank's value
    and raises the same error. Skipped while torch.compile traces (it is a host-side check:
    compiled code gets its inputs from a caller that checked them)."""
    if torch.compiler.is_compiling():
        return
    groups = tuple(g for g in groups if group_size(g) > 1)
    if not groups:
        return
    if isinstance(value, dict):
        value = {name: _signature(item) for name, item in value.items()}
    seen: dict[int, Any] = {dist.get_rank(): value}  # global rank -> value
    for group in groups:
        gathered: list[Any] = [None] * group_size(group)
        dist.all_gather_object(gathered, seen, group=group)
        seen = {rank: v for part in gathered for rank, v in part.items()}
    values = [seen[rank] for rank in sorted(seen)]
    if all(v == values[0] for v in values):
        return
    if all(isinstance(v, dict) for v in values):  # only the items that differ
        names = dict.fromkeys(name for v in values for name in v)
        differ = [n for n in names if any(v.get(n, "absent") != values[0].get(n, "absent") for v in values)]
        seen = {rank: ", ".join(f"{n}={v.get(n, 'absent')}" for n in differ) for rank, v in seen.items()}
    listed = "; ".join(f"rank {rank}: {seen[rank]}" for rank in sorted(seen))
    raise ValueError(f"the ranks of a process group disagree on {what}: {listed}")
