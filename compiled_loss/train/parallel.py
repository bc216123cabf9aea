"""Process groups of a training run: tensor (vocabulary), context (sequence) and data
parallel, from `torchrun` (one node or many; gloo on CPU, NCCL on CUDA).

Ranks are laid out as a `(dp, cp, tp)` device mesh: `rank = (dp_rank · cp + cp_rank) · tp
+ tp_rank`. TP and CP ranks of one data-parallel replica see the same rows; each DP replica
sees its own share of the global batch. `ParallelGroups` (defined in
`compiled_loss.parallel`) holds the three groups.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from compiled_loss.config import ParallelConfig
from compiled_loss.metrics import combine_metrics
from compiled_loss.parallel import ParallelGroups, group_size


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


def gradient_scale(sizes: tuple[int, int, int], *, vocab_sharded: bool) -> int:
    """What the step multiplies each micro-batch's loss by before its backward, so that
    `DistributedDataParallel`'s average over all `tp · cp · dp` ranks is the single-process
    gradient of every parameter. The one statement of how gradients add up across ranks:

    - DP: each replica's loss is its rows' share of the global loss (global normalisers),
      so the replicas' gradients sum to the gradient;
    - CP: each rank's gradient is cp × its positions' share (the all-gather's SUM backward,
      ref §10), so the CP ranks' gradients sum to cp × the gradient;
    - TP: a loss over vocabulary-sharded logits (`compiled_loss.interfaces.vocab_sharded`,
      dense or fused head) gives each rank its shard's share — they sum to the gradient; a
      replicated output (a value head) gives every rank the whole gradient — tp × it.

    The sum over all ranks is then `cp · (1 or tp)` × the gradient, and the scale turns
    DDP's average into it: `tp · dp` for vocabulary-sharded logits, `dp` for a value head."""
    tp, _, dp = sizes
    return (tp if vocab_sharded else 1) * dp


def all_reduce_host(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Host side (outside compiled code): the sum of `x` over `group` (identity without one)."""
    if group_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


def combine_over(parts: list[dict[str, float]], group: Any) -> dict[str, float]:
    """Host side: the metric fragments (Python floats, one dict per micro-batch) of every
    rank of `group`, combined as one list through the metric registry
    (`compiled_loss.metrics.combine_metrics`, in float64). Gathering the fragments, not each
    rank's combined values, keeps a mean exact when the ranks ran different numbers of
    micro-batches; an unregistered key fails alike on every rank, after the gather."""
    if group_size(group) > 1:
        gathered: list[Any] = [None] * group_size(group)
        dist.all_gather_object(gathered, parts, group=group)
        parts = [part for rank_parts in gathered for part in rank_parts]
    combined = combine_metrics([{k: torch.tensor(v, dtype=torch.float64) for k, v in p.items()} for p in parts])
    return {k: float(v) for k, v in combined.items()}
