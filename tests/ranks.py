"""Run a function on real gloo ranks (spawned processes) and collect what each returns.

`fn(rank, world_size, *args)` must be importable (a module-level function of a test
module on the path). An exception on a rank is returned as `"<Type>: <message>"`; a run
that outlives `timeout` is killed and fails the test, so nothing hangs.

Inside a rank: `tp_cp_groups` builds the tensor- and context-parallel groups of a grid,
`mesh_groups` a training run's mesh and groups (what `init_parallel` builds under torchrun),
`context_local` takes this rank's context-parallel positions of a full tensor.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compiled_loss.packing.context import ContextShards


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result: Any = {"value": fn(rank, world_size, *args)}
    except Exception as e:  # reported to the parent, which asserts on it
        result = {"error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"{rank}.pt")


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120.0) -> list[Any]:
    """Each rank's return value (or its error as a string), in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_dir = str(Path(tmp) / "init"), str(Path(tmp) / "out")
        Path(out_dir).mkdir()
        ctx = mp.start_processes(
            _entry,
            args=(world_size, init_file, out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout} s")
        results = [torch.load(Path(out_dir) / f"{rank}.pt") for rank in range(world_size)]
    return [r.get("value", r.get("error")) for r in results]


def tp_cp_groups(rank: int, world: int, tp: int, cp: int) -> tuple[Any, Any]:
    """(tp group, cp group) of this rank (None for a size of 1): replicas of `tp · cp` ranks
    side by side, `rank = replica · tp · cp + cp_rank · tp + tp_rank`. Every rank builds
    every group, as `dist.new_group` requires."""
    tp_groups, cp_groups = {}, {}
    for base in range(0, world, tp * cp):
        for c in range(cp):
            ranks = [base + c * tp + t for t in range(tp)]
            tp_groups.update(dict.fromkeys(ranks, dist.new_group(ranks)))
        for t in range(tp):
            ranks = [base + c * tp + t for c in range(cp)]
            cp_groups.update(dict.fromkeys(ranks, dist.new_group(ranks)))
    return (tp_groups[rank] if tp > 1 else None), (cp_groups[rank] if cp > 1 else None)


def mesh_groups(world: int, **sizes: int):
    """`init_parallel`'s mesh and groups for `ParallelConfig(**sizes)` on the spawned ranks."""
    import os

    from compiled_loss.config import ParallelConfig
    from compiled_loss.train.parallel import init_parallel

    os.environ["WORLD_SIZE"] = str(world)
    return init_parallel(ParallelConfig(**sizes))


def context_local(x: torch.Tensor, cp_group: Any, cu_seqlens_padded: tuple[int, ...] | None = None) -> torch.Tensor:
    """This context-parallel rank's positions of a full tensor: unpacked rows `[B, S, ...]`
    (`cu_seqlens_padded` None) or packed segments `[1, T, ...]` at `cu_seqlens_padded`, in
    the load-balanced 2·cp-chunk order the library uses (`ContextShards`)."""
    if cp_group is None:
        return x
    rows, length = x.shape[:2]
    if cu_seqlens_padded is None:
        shards = ContextShards.of_rows(rows, length, cp_group)
    else:
        cup = cu_seqlens_padded
        shards = ContextShards.of_segments(cup[:-1], [b - a for a, b in zip(cup, cup[1:])], length, cp_group)
    return shards.local(x.flatten(0, 1)).reshape(rows, -1, *x.shape[2:])
