"""DTensor logits at the library's edge: `local_logits` unwraps them once, on the host side
of every entry point that takes logits, into this rank's local tensor and the process
groups of their mesh, so compiled code sees plain tensors (one graph per shape bucket,
whatever the placements) and nothing below the edge knows a DTensor.

Accepted layouts (NeMo-RL's DTensor path and torchtitan's loss parallel build them):

- `(Shard(-1),)` on a one-dimensional mesh: the vocabulary sharded over its group
  (`(Shard(-2),)` on one named "cp": the sequence);
- `(Replicate(),)`: the full vocabulary on every rank;
- on a two-dimensional mesh whose dimensions are named `"cp"` and `"tp"`, the sequence
  dimension (`-2`) sharded (or replicated) over `"cp"` — this rank's positions in the
  load-balanced `2·cp`-chunk order, as the caller laid the sequence out before its model —
  and the vocabulary sharded (or replicated) over `"tp"`;
- `LinearLogits` whose LM-head weight (and bias) is a DTensor sharded on its vocabulary rows
  (`(Shard(0),)`, a one-dimensional mesh): the head's local rows, and the hidden states
  replicated over the group with their partial gradients summed in the backward (Megatron's
  copy-to-region).

The vocabulary shards may be uneven (V = 50257 over 2 or 4 ranks: torch's chunking gives
every rank `ceil(V / tp)` ids but the last ones): a narrower shard is padded to the widest
with its dtype's lowest value (a copy of that shard), so every rank's offset is `rank ·
ceil(V / tp)`, the primitive's; `ParallelGroups.vocab_size` keeps the real `V`, which the
eager id check reads. The gradient flows back into the DTensor with its
placements. Anything else — a `Partial` placement, a mesh of other dimension names, a
shard of another dimension, a group argument that is not the mesh's — is a ValueError
naming it, raised alike on every rank before any collective. The seed signatures' group
arguments reach it through `compiled_loss.nemo_rl.groups`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate
from typing_extensions import TypeIs

from compiled_loss.parallel import ParallelGroups, same_group
from compiled_loss.vocab.fused import LinearLogits

Tensor = torch.Tensor


def _is_dtensor(x: object) -> TypeIs[DTensor]:
    return isinstance(x, DTensor)


def _same_group(given: ProcessGroup | None, mesh_group: ProcessGroup | None) -> bool:
    return given is None or same_group(given, mesh_group)


def _mesh_dims(x: Any, who: str, name: str, roles: dict[str, int]) -> dict[str, tuple[Any, Any]]:
    """`{role: (placement, group)}` of DTensor `x`: a one-dimensional mesh is the vocabulary's
    (role "tp") unless it is named "cp", a two-dimensional one must name its dimensions "cp"
    and "tp"; each role's placement must shard dimension `roles[role]` or replicate."""
    mesh, placements = x.device_mesh, x.placements
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        names = ("cp",) if names == ("cp",) and "cp" in roles else ("tp",)
    elif mesh.ndim != 2 or set(names or ()) != {"cp", "tp"}:
        raise ValueError(
            f"{who}: a DTensor {name} must be on a one-dimensional mesh or one with dimensions named 'cp' and 'tp', "
            f"got a mesh of dimensions {names} (shape {tuple(mesh.shape)})"
        )
    dims = {}
    for index, (role, placement) in enumerate(zip(names, placements)):
        want = roles[role] % x.ndim
        if not (placement.is_replicate() or (placement.is_shard() and placement.dim % x.ndim == want)):
            axis = "the vocabulary" if role == "tp" else "the sequence"
            raise ValueError(
                f"{who}: {name}'s placement {placement} on mesh dimension {role!r}: only Shard({want}) ({axis}) or "
                f"Replicate() are taken (placements {tuple(placements)}); a Partial must be reduced first"
            )
        dims[role] = (placement, mesh.get_group(index) if mesh.ndim > 1 else mesh.get_group())
    return dims


def _groups(who: str, dims: dict[str, tuple[Any, Any]], parallel: ParallelGroups) -> ParallelGroups:
    """`parallel` with the groups the sharded mesh dimensions give (a replicated one gives none);
    a group passed explicitly for the same dimension must be the mesh's."""
    found = {}
    for role, (placement, group) in dims.items():
        given = getattr(parallel, role)
        if placement.is_replicate():
            continue
        if not _same_group(given, group):
            argument = "vocab_parallel_group" if role == "tp" else "context_parallel_group"
            raise ValueError(f"{who}: {argument} must be None or the DTensor's {role!r} mesh group")
        found[role] = group
    return dataclasses.replace(parallel, **found)


def _pad_vocab(x: Tensor, vocab: int, tp: int, value: float) -> Tensor:
    """`x`'s last dimension padded to `ceil(vocab / tp)` with `value` (a no-op on a full shard)."""
    width = -(-vocab // tp)
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]), value=value)


def _local_linear(logits: LinearLogits, parallel: ParallelGroups, who: str) -> tuple[LinearLogits, ParallelGroups]:
    """`LinearLogits` with a DTensor head: its local rows, the hidden states copied to the region."""
    weight, bias, hidden = logits.weight, logits.bias, logits.hidden
    if not (_is_dtensor(hidden) or _is_dtensor(weight)):
        return logits, parallel
    if _is_dtensor(hidden):
        if not all(p.is_replicate() for p in hidden.placements):
            raise ValueError(f"{who}: LinearLogits.hidden as a DTensor must be replicated, got {hidden.placements}")
        hidden = hidden.to_local()
    if not _is_dtensor(weight):
        return dataclasses.replace(logits, hidden=hidden), parallel
    if weight.device_mesh.ndim != 1:
        raise ValueError(f"{who}: LinearLogits.weight as a DTensor must be on a one-dimensional mesh")
    dims = _mesh_dims(weight, who, "LinearLogits.weight", {"tp": 0})
    if bias is not None and (not _is_dtensor(bias) or bias.placements != weight.placements):
        raise ValueError(f"{who}: LinearLogits.bias must be a DTensor placed as the weight ({weight.placements})")
    parallel = _groups(who, dims, parallel)
    vocab, mesh = weight.shape[0], weight.device_mesh
    weight, bias = weight.to_local(), None if bias is None else bias.to_local()
    if parallel.tp is not None:  # every rank projects the whole hidden states; their gradients are summed
        hidden = DTensor.from_local(hidden, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        tp = mesh.size()
        if vocab % tp:  # uneven rows: zero rows, and a bias no softmax weighs (on every rank alike)
            if logits.softcap is not None or logits.scale != 1.0:
                raise ValueError(
                    f"{who}: an LM head of {vocab} rows over {tp} ranks (uneven shards) with softcap={logits.softcap} "
                    f"and scale={logits.scale}: the padded rows' logits would not vanish; shard the vocabulary evenly"
                )
            bias = weight.new_zeros(weight.shape[0]) if bias is None else bias
            bias = _pad_vocab(bias, vocab, tp, torch.finfo(weight.dtype if logits.dtype is None else logits.dtype).min)
            weight = F.pad(weight, (0, 0, 0, bias.shape[0] - weight.shape[0]))
            parallel = dataclasses.replace(parallel, vocab_size=vocab)
    return dataclasses.replace(logits, hidden=hidden, weight=weight, bias=bias), parallel


def local_logits(logits: Any, parallel: ParallelGroups, who: str) -> tuple[Any, ParallelGroups]:
    """`(this rank's logits, the groups they are sharded over)` of `logits`: a plain tensor
    (or `LinearLogits` of plain tensors) and `parallel` as they are; a DTensor unwrapped (see
    the module docstring), its mesh's groups in place of `parallel`'s `tp` / `cp`."""
    if isinstance(logits, LinearLogits):
        return _local_linear(logits, parallel, who)
    if not _is_dtensor(logits):
        return logits, parallel
    dims = _mesh_dims(logits, who, "logits", {"tp": -1, "cp": -2})
    parallel = _groups(who, dims, parallel)
    vocab = logits.shape[-1]
    local = logits.to_local()
    if parallel.tp is not None and vocab % dist.get_world_size(parallel.tp):
        local = _pad_vocab(local, vocab, dist.get_world_size(parallel.tp), torch.finfo(local.dtype).min)
        parallel = dataclasses.replace(parallel, vocab_size=vocab)
    return local, parallel


def local_tensor(x: Any, parallel: ParallelGroups, who: str, name: str) -> Any:
    """A second logits-shaped input (a draft head's `student_logits`) laid out as the logits:
    a DTensor's local shard, its vocabulary padded as `local_logits` pads; a plain tensor as is."""
    if not _is_dtensor(x):
        return x
    local, groups = local_logits(x, ParallelGroups(), f"{who} ({name})")
    if (groups.tp, groups.cp) != (None, None) and not (
        _same_group(groups.tp, parallel.tp) and _same_group(groups.cp, parallel.cp)
    ):
        raise ValueError(f"{who}: {name} must be sharded as the logits are, over the same mesh groups")
    return local
