"""Run a function on real gloo ranks (spawned processes) and collect what each returns.

`fn(rank, world_size, *args)` must be importable (a module-level function of a test
module on the path). An exception on a rank is returned as `"<Type>: <message>"`; a run
that outlives `timeout` is killed and fails the test, so nothing hangs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
            _entry, args=(world_size, init_file, out_dir, fn, args), nprocs=world_size, join=False,
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
