"""Process groups and model sharding of a training run: tensor, context and data parallel
(replicated and sharded), from `torchrun` (one node or many; gloo on CPU, NCCL on CUDA).

Ranks are laid out as a `(dp, dp_shard, cp, tp)` device mesh: `rank = ((dp_rank · dp_shard
+ shard_rank) · cp + cp_rank) · tp + tp_rank`. The TP and CP ranks of one data-parallel
rank see the same rows; each data-parallel rank (`dp × dp_shard`) sees its own share of the
global batch. `ParallelGroups` (defined in `compiled_loss.parallel`) holds the groups and
the mesh; `shard_model` shards a model on it with FSDP2 and a DTensor TP plan.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_loss.compile import compile_loss
from compiled_loss.config import ParallelConfig
from compiled_loss.metrics import combine_metrics
from compiled_loss.parallel import ParallelGroups, group_size


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(cfg: ParallelConfig) -> ParallelGroups:
    """Initialise torch.distributed from torchrun's environment when the run has more than
    one rank, check `dp · dp_shard · cp · tp == WORLD_SIZE` (on every rank, before any
    collective) and build the `(dp, dp_shard · cp, tp)` device mesh the model is sharded on,
    and from it the groups: `tp`, `cp`, and the data-parallel group `dp × dp_shard` (every
    rank of it reads rows of its own). A single-process run returns groups of None."""
    world = world_size_from_env()
    if cfg.world != world:
        raise ValueError(
            f"parallel.dp × parallel.dp_shard × parallel.cp × parallel.tp = {cfg.dp} × {cfg.dp_shard} × {cfg.cp} × "
            f"{cfg.tp} = {cfg.world} must equal the number of processes, {world} (torchrun --nproc-per-node × --nnodes)"
        )
    if world == 1:
        return ParallelGroups()
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(dist.destroy_process_group)  # the backend's threads stopped before the interpreter exits
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the model's mesh: FSDP2 shards over dp_shard × cp (replicated over dp), the TP plan over tp
    mesh = dist.device_mesh.init_device_mesh(
        device, (cfg.dp, cfg.dp_shard * cfg.cp, cfg.tp), mesh_dim_names=("dp", "dp_shard_cp", "tp")
    )
    fine = mesh._unflatten("dp_shard_cp", (cfg.dp_shard, cfg.cp), ("dp_shard", "cp"))
    groups = {"tp": fine["tp"], "cp": fine["cp"], "dp": fine["dp", "dp_shard"]._flatten("batch")}
    return ParallelGroups(**{name: m.get_group() if m.size() > 1 else None for name, m in groups.items()}, mesh=mesh)


def shard_model(
    model: torch.nn.Module,
    groups: ParallelGroups,
    *,
    recorder: Any = None,
    recompile_limit: int | None = None,
    compile_kwargs: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Shard `model` in place on `groups.mesh` with torch.distributed's own engine, in
    torchtitan's order, and return it:

    1. tensor parallel (`tp` > 1): `parallelize_module` with the model's plan
       (`model.tp_plan()`: attention heads and the MLP column-/row-wise, the embedding on
       its rows, the LM head's output on the vocabulary, `Shard(-1)` DTensor logits);
    2. `recorder` given: each decoder layer (`model.decoder_layers()`) compiled on its own
       (fullgraph, through `recorder`), inside its FSDP unit;
    3. FSDP2 `fully_shard` per decoder layer and at the root over the mesh's
       `(dp, dp_shard × cp)` dimensions (HSDP: replicated over `dp`, sharded over the
       rest): parameters, gradients and optimizer state are sharded `dp_shard · cp` ways,
       a bf16 model under a `MixedPrecisionPolicy` that reduces gradients in fp32. Only
       `forward` runs sharded: a run generates through an unsharded copy of the policy
       (`gather_weights`).

    A model that is not trained (`requires_grad` off everywhere) is sharded alike (its
    memory is sharded too). Single process (no mesh): the model as it is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = groups.mesh
    if mesh is None:
        return model
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], model.tp_plan())
    layers = list(model.decoder_layers())
    if recorder is not None:
        for layer in layers:
            layer.forward = compile_loss(
                layer.forward, recorder=recorder, recompile_limit=recompile_limit, **(compile_kwargs or {})
            )
    dtype = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard_mesh = mesh["dp", "dp_shard_cp"]
    for layer in layers:
        fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model


def gather_weights(sharded: torch.nn.Module, replica: torch.nn.Module) -> None:
    """Load the whole weights of `sharded` (FSDP2 / TP DTensors, gathered with
    `torch.distributed.checkpoint`'s state-dict API) into `replica`, an unsharded model of the
    same structure. A collective: every rank of the mesh calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    replica.load_state_dict(get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True)))


def gradient_scale(sizes: tuple[int, int, int]) -> int:
    """What the step multiplies each micro-batch's loss by before its backward, so that
    FSDP2's average over its `dp · dp_shard · cp` ranks is the single-process gradient of
    every parameter. The one statement of how gradients add up across ranks:

    - data parallel (`dp · dp_shard`): each rank's loss is its rows' share of the global
      loss (global normalisers), so the ranks' gradients sum to the gradient;
    - CP: each rank's gradient is cp × its positions' share (the all-gather's SUM backward,
      ref §10), so the CP ranks' gradients sum to cp × the gradient;
    - TP: the DTensor plan gives every rank of a TP group the whole gradient of the
      replicated parameters and its shard's of the sharded ones (a loss over
      vocabulary-sharded logits returns each rank its shard's logit gradient, and the plan
      all-reduces the partial gradients of the activations), so TP adds no factor.

    The sum over FSDP's ranks is then `cp` × the gradient, and the scale turns FSDP's
    average over `dp · dp_shard · cp` ranks into it: `dp · dp_shard`, the data-parallel
    group's size."""
    return sizes[2]


def clip_grad_norm(parameters: Any, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters that may be DTensors (FSDP2 shards, TP
    shards of them, replicated ones): the total norm of every gradient over all its shards,
    summed in one all-reduce over the world, and each local gradient scaled by `max_norm /
    (norm + 1e-6)` clamped to 1, as torch's does. Plain tensors only: torch's own."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    world = dist.get_world_size()
    squares = []
    for g in grads:  # Σ over the ranks counts a gradient once per copy: world / (its shards) copies
        local, shards = (g.to_local(), _shard_count(g)) if isinstance(g, DTensor) else (g, 1)
        squares.append(torch.linalg.vector_norm(local.float()) ** 2 * (shards / world))
    total = torch.stack(squares).sum()
    dist.all_reduce(total)
    total = total.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total


def _shard_count(x: DTensor) -> int:
    """Into how many pieces `x`'s placements cut it (the sizes of its mesh's Shard dimensions)."""
    count = 1
    for size, placement in zip(x.device_mesh.shape, x.placements):
        if placement.is_partial():
            raise ValueError(f"clip_grad_norm: a gradient with a Partial placement ({x.placements}) is not reduced")
        count *= 1 if placement.is_replicate() else size  # Shard, or FSDP2's strided shard of a TP shard
    return count


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
