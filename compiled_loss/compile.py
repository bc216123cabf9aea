"""`compile_loss`: torch.compile for loss code, with the loss configs' floats kept constant,
and `CompiledModule`, a module called through it (layer 0: the losses compile themselves
with `compile_loss` when their config asks; `compiled_loss.train` re-exports both);
`save_compile_cache` / `load_compile_cache`: torch's portable compile-cache artifacts in
one file, so that a fresh process skips what an earlier one compiled."""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def compile_loss(fn: Callable[..., Any], *, recorder: Any = None, **compile_kwargs: Any) -> Callable[..., Any]:
    """`torch.compile(fn, **compile_kwargs)` (through `recorder.compile` when a
    `compiled_loss.train.CompileRecorder` is given), called with `specialize_float=True`:
    the Python floats of loss configs (clip ranges, β, …) stay constants of the graph.
    Without it, `dynamic=True` turns each into a graph input that the graph reads back
    with `.item()`."""
    compiled = recorder.compile(fn, **compile_kwargs) if recorder is not None else torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return run


class CompiledModule(torch.nn.Module):
    """`module` called through `compile_loss`, as a module: for wrappers whose own forward
    does not trace — `DistributedDataParallel(CompiledModule(model))` runs DDP's bookkeeping
    eagerly around one compiled graph of the model."""

    def __init__(self, module: torch.nn.Module, **compile_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self._run = compile_loss(module, **compile_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)


_MAGIC = b"compiled_loss compile cache 1\n"


def compile_cache_fingerprint() -> dict[str, str | None]:
    """What a compile cache file is valid for, recorded in it: the torch build, the Python
    version, the machine, the CPU's vector ISA (Inductor generates its CPU kernels for it,
    and torch's cache keys leave it out) and the GPU (None without CUDA)."""
    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    return {
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
    }


def _read_header(file: Any) -> dict[str, Any] | None:
    """The header of a compile cache file open at its start; None when it is not one."""
    if file.readline(len(_MAGIC)) != _MAGIC:
        return None
    try:
        header = json.loads(file.readline())
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def _merged(payload: bytes) -> bytes:
    """`payload` with one batch of artifacts per kind. A process that called
    `save_cache_artifacts` more than once gets one batch per call and kind, of which torch
    2.13's `load_cache_artifacts` keeps only the last of each kind (it reads them into a
    dict): measured, a file saved after two steps that compiled lost the first step's graphs."""
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list[Any]] = {}
    for kind, artifacts in AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache):
        merged.setdefault(kind, []).extend(artifacts)
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend(merged.items())
    return serializer.to_bytes()


def save_compile_cache(path: str | os.PathLike[str]) -> bool:
    """Write the compile-cache artifacts of this process to `path` (the graphs Inductor,
    AOTAutograd and Dynamo's profile-guided shapes compiled or read from the local cache so
    far: `torch.compiler.save_cache_artifacts()`) behind a header with
    `compile_cache_fingerprint()`. Atomic: written to a temporary file beside `path` (its
    parent directories created) and renamed over it. Return whether it wrote: False when
    nothing compiled with Inductor yet, or when `path` already holds every artifact for this
    fingerprint (a process that loaded it and compiled nothing new)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    payload, info = _merged(saved[0]), saved[1]
    fingerprint, keys = compile_cache_fingerprint(), {kind: sorted(names) for kind, names in info.artifacts.items()}
    target = Path(path)
    if target.is_file():
        with target.open("rb") as f:
            held = _read_header(f)
        if (
            held is not None
            and all(held.get(key) == value for key, value in fingerprint.items())
            and all(set(names) <= set(held.get("artifacts", {}).get(kind, ())) for kind, names in keys.items())
        ):
            return False
    header = {**fingerprint, "bytes": len(payload), "artifacts": keys}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + json.dumps(header).encode() + b"\n" + payload)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


def load_compile_cache(path: str | os.PathLike[str]) -> bool:
    """Hand the artifacts `save_compile_cache` wrote to `path` to torch's local caches
    (`torch.compiler.load_cache_artifacts`), before anything compiles: a later compile
    whose graph torch finds there (its key matches) reads it instead of compiling it.
    Return whether it loaded: False, with nothing loaded, when `path` does not exist, and
    also, with a warning naming `path` and what differs, when the file was written for
    another fingerprint (`compile_cache_fingerprint()`: another torch, Python, machine,
    CPU ISA or GPU), whose artifacts this process could not use. A file that is no compile
    cache, or a truncated or corrupt one, raises ValueError naming `path`."""
    target = Path(path)
    if not target.exists():
        return False
    if not target.is_file():
        raise ValueError(f"compile cache {target}: not a file")
    with target.open("rb") as f:
        header = _read_header(f)
        payload = f.read()
    if header is None or header.get("bytes") != len(payload):
        problem = "it is no compile cache" if header is None else "it is truncated or corrupt"
        raise ValueError(f"compile cache {target}: {problem} (save_compile_cache writes one)")
    here = compile_cache_fingerprint()
    differs = [f"{key} {header.get(key)!r}, here {value!r}" for key, value in here.items() if header.get(key) != value]
    if differs:
        warnings.warn(
            f"compile cache {target} not loaded: written for another setup ({'; '.join(differs)}); "
            "everything compiles anew",
            stacklevel=2,
        )
        return False
    if torch.compiler.load_cache_artifacts(payload) is None:
        raise ValueError(f"compile cache {target}: torch could not read its artifacts (truncated or corrupt)")
    return True
