"""`compile_loss`: torch.compile for loss code, with the loss configs' floats kept constant
(layer 0: the losses compile themselves with `compile_loss` when their config asks;
`compiled_loss.train` re-exports it);
`save_compile_cache` / `load_compile_cache`: torch's portable compile-cache artifacts and
Inductor's compiled C++ kernel libraries in one file, so that a fresh process skips what an
earlier one compiled."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import secrets
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def compile_loss(
    fn: Callable[..., Any], *, recorder: Any = None, recompile_limit: int | None = None, **compile_kwargs: Any
) -> Callable[..., Any]:
    """`torch.compile(fn, **compile_kwargs)` (through `recorder.compile` when a
    `compiled_loss.train.CompileRecorder` is given), called with `specialize_float=True`:
    the Python floats of loss configs (clip ranges, β, …) stay constants of the graph.
    Without it, `dynamic=True` turns each into a graph input that the graph reads back
    with `.item()`.

    `recompile_limit`: the most graphs Dynamo keeps for `fn` (torch's own limit, 8, when
    None). A function compiled once per shape bucket needs one per bucket: past the limit
    a `fullgraph=True` function fails (`FailOnRecompileLimitHit`). The callers bound their
    buckets on the host (`admit_bucket`) and pass that bound here."""
    compiled = recorder.compile(fn, **compile_kwargs) if recorder is not None else torch.compile(fn, **compile_kwargs)
    limits: dict[str, Any] = {"specialize_float": True}
    if recompile_limit is not None:
        if recompile_limit < 1:
            raise ValueError(f"compile_loss: recompile_limit must be >= 1, got {recompile_limit}")
        config = torch._dynamo.config
        limits["recompile_limit"] = recompile_limit
        limits["accumulated_recompile_limit"] = max(config.accumulated_recompile_limit, recompile_limit)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(**limits):
            return compiled(*args, **kwargs)

    return run


def admit_bucket(seen: set[Any], bucket: Any, limit: int, who: str, knob: str) -> None:
    """Add `bucket` (a hashable shape key) to `seen`, the buckets a compiled function has
    run on; a ValueError, raised before anything compiles, when it would be bucket number
    `limit + 1`: `who` is the caller, `knob` the setting that raises `limit`."""
    if bucket in seen:
        return
    if len(seen) >= limit:
        raise ValueError(
            f"{who}: shape bucket {bucket} would be distinct bucket {len(seen) + 1}, and {knob}={limit} "
            "compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)"
        )
    seen.add(bucket)


_MAGIC = b"compiled_loss compile cache 3\n"
_MAGIC_PREFIX = b"compiled_loss compile cache "


def _options() -> list[tuple[Any, str, bool]]:
    """The Inductor options compile caches are written and read under, which
    `load_compile_cache` sets for the whole process: (config module, option, value).
    - No precompiled C++ header. Inductor builds a 150 MB header for its CPU kernels on
      every machine before it looks a kernel library up (7 s here), even when the library is
      there; the header is no part of a kernel's key, the option is part of every graph's.
      Off, a cold compile takes longer (measured: 63 s against 51 s for the default run).
    - AOTAutograd's cache on for graphs with an `autograd.Function` (the vocab primitive's):
      its forward and backward graphs are part of the key, so a changed function misses."""
    import torch._functorch.config
    import torch._inductor.config

    return [
        (torch._inductor.config, "cpp_cache_precompile_headers", False),
        (torch._functorch.config, "autograd_cache_allow_custom_autograd_functions", True),
    ]


def compile_cache_fingerprint() -> dict[str, str | None]:
    """What a compile cache file is valid for, recorded in it: the torch build, the Python
    version, the machine, the CPU's vector ISA (Inductor generates its CPU kernels for it,
    and torch's cache keys leave it out), the GPU (None without CUDA) and the two Inductor
    options `load_compile_cache` sets (a process that saved without loading first compiled
    under others: its graphs' keys differ)."""
    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    return {
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "options": " ".join(f"{option}={getattr(module, option)}" for module, option, _ in _options()),
    }


def _read_header(file: Any) -> dict[str, Any] | None:
    """The header of a compile cache file open at its start; None when it is not one, and
    {"version": line} for one another version of this module wrote."""
    line = file.readline(len(_MAGIC))
    if line != _MAGIC:
        return {"version": line.decode(errors="replace").strip()} if line.startswith(_MAGIC_PREFIX) else None
    try:
        header = json.loads(file.readline())
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def _batches(payload: bytes) -> list[tuple[str, bytes]]:
    """`payload` as one batch of artifacts per kind, each (kind, the bytes
    `load_cache_artifacts` reads for it). A process that called `save_cache_artifacts` more
    than once gets one batch per call and kind, of which torch 2.13's `load_cache_artifacts`
    keeps only the last of each kind (it reads them into a dict): measured, a file saved after
    two steps that compiled lost the first step's graphs."""
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list[Any]] = {}
    for kind, artifacts in AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache):
        merged.setdefault(kind, []).extend(artifacts)
    batches = []
    for kind, artifacts in merged.items():
        serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        serializer.append((kind, artifacts))
        batches.append((kind, serializer.to_bytes()))
    return batches


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inductor_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _kernel_libraries() -> dict[str, bytes]:
    """The C++ libraries in Inductor's cache directory this process needs, by their path in
    it: the kernel libraries it has loaded (`/proc/self/maps`; none off Linux) and the
    vector-ISA probes Inductor builds before its first CPU kernel (`<key>.so`, where kernels
    are `<key>.main.so`). Torch's artifacts hold the kernels' C++ source, not these: without
    them a fresh machine runs the C++ compiler for every kernel (measured: 48 of 69 s)."""
    root = _inductor_dir().resolve()
    if not root.is_dir():
        return {}
    found = {p for p in root.glob("*/*.so") if not p.name.endswith(".main.so")}
    maps = Path("/proc/self/maps")
    if maps.is_file():
        for line in maps.read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].endswith(".so"):
                path = Path(fields[5])
                if path.parent.parent == root:
                    found.add(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(found) if p.is_file()}


def save_compile_cache(path: str | os.PathLike[str]) -> bool:
    """Write the compile-cache artifacts of this process to `path` (the graphs Inductor,
    AOTAutograd and Dynamo's profile-guided shapes compiled or read from the local cache so
    far: `torch.compiler.save_cache_artifacts()`, one batch per kind, plus the compiled C++
    kernel libraries of its CPU graphs: `_kernel_libraries`) behind a header with
    `compile_cache_fingerprint()`, the size and sha256 of each artifact batch and of each
    kernel library. Call `load_compile_cache` first, before anything compiles: it sets the
    options the file is for. Atomic: written to a temporary file beside `path` (its parent
    directories created) and renamed over it; the file gets the mode `open()` gives a new
    file (0o666 less the umask), so other users can read a shared cache. Return whether it
    wrote: False when nothing compiled with Inductor yet, or when `path` already holds every
    artifact and kernel library for this fingerprint (a process that loaded it and compiled
    nothing new)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    batches, info = _batches(saved[0]), saved[1]
    kernels = _kernel_libraries()
    fingerprint, keys = compile_cache_fingerprint(), {kind: sorted(names) for kind, names in info.artifacts.items()}
    target = Path(path)
    if target.is_file():
        with target.open("rb") as f:
            held = _read_header(f)
        if (
            held is not None
            and all(held.get(key) == value for key, value in fingerprint.items())
            and all(set(names) <= set(held.get("artifacts", {}).get(kind, ())) for kind, names in keys.items())
            and set(kernels) <= {entry[0] for entry in held.get("kernels", ()) if isinstance(entry, list) and entry}
        ):
            return False
    entries = [*batches, *kernels.items()]
    payload = b"".join(data for _, data in entries)
    header = {
        **fingerprint,
        "bytes": len(payload),
        "artifacts": keys,
        "artifact_batches": [[kind, len(data), _sha256(data)] for kind, data in batches],
        "kernels": [[name, len(data), _sha256(data)] for name, data in kernels.items()],
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(target, _MAGIC + json.dumps(header).encode() + b"\n" + payload)
    return True


def _write_atomic(target: Path, data: bytes, mode: int | None = None) -> None:
    """`data` written to a temporary file beside `target` and renamed over it: with `mode`,
    or else the mode `open()` gives a new file (0o666 less the umask)."""
    temporary = target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _entries(header: dict[str, Any], payload: bytes) -> tuple[list[list[Any]], list[list[Any]]] | None:
    """The artifact batches and kernel libraries the header lists, each [kind or path in
    Inductor's cache directory, bytes, sha256 recorded, its bytes in `payload`]; None when
    the header does not describe `payload`."""
    found: list[list[list[Any]]] = []
    offset = 0
    for listed in (header.get("artifact_batches"), header.get("kernels")):
        if not isinstance(listed, list):
            return None
        entries = []
        for entry in listed:
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and isinstance(entry[0], str)
                and isinstance(entry[1], int)
                and entry[1] >= 0
                and isinstance(entry[2], str)
            ):
                return None
            name, size, digest = entry
            entries.append([name, size, digest, payload[offset : offset + size]])
            offset += size
        found.append(entries)
    for name, *_ in found[1]:
        parts = name.split("/")
        if len(parts) != 2 or not all(parts) or ".." in parts or not parts[1].endswith(".so"):
            return None  # only files <dir>/<name>.so inside Inductor's cache directory
    return (found[0], found[1]) if offset == len(payload) else None


def load_compile_cache(path: str | os.PathLike[str]) -> bool:
    """Set the Inductor options compile caches are written and read under (no precompiled
    C++ header; AOTAutograd's cache on for graphs with an `autograd.Function`) for this
    process, then hand the artifacts `save_compile_cache` wrote to `path` to torch's local
    caches (`torch.compiler.load_cache_artifacts`) and its kernel libraries to Inductor's
    cache directory (those already there are kept). Call it at start, before anything
    compiles, whether `path` exists or not: a later compile whose graph torch finds there
    (its key matches) reads it instead of compiling it. Return whether it loaded: False,
    with nothing loaded, when `path` does not exist, and also, with a warning naming `path`
    and what differs, when the file was written for another fingerprint
    (`compile_cache_fingerprint()`: another torch, Python, machine, CPU ISA, GPU or options)
    or by another version of this module, whose artifacts this process could not use. A
    file that is no compile cache, or a truncated or corrupt one, raises ValueError naming
    `path`; so does one whose artifact batch or kernel library fails its sha256 (naming the
    entry): every checksum is verified before anything reaches torch or Inductor's cache
    directory."""
    for module, option, value in _options():
        setattr(module, option, value)
    target = Path(path)
    if not target.exists():
        return False
    if not target.is_file():
        raise ValueError(f"compile cache {target}: not a file")
    with target.open("rb") as f:
        header = _read_header(f)
        payload = f.read()
    if header is not None and "version" in header:
        warnings.warn(
            f"compile cache {target} not loaded: another version of compiled_loss wrote it "
            f"({header['version']!r}, here {_MAGIC.decode().strip()!r}); everything compiles anew",
            stacklevel=2,
        )
        return False
    entries = None if header is None or header.get("bytes") != len(payload) else _entries(header, payload)
    if header is None or entries is None:
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
    batches, kernels = entries
    for what, listed in (("artifact batch", batches), ("kernel library", kernels)):
        for name, _, digest, data in listed:
            if _sha256(data) != digest:
                raise ValueError(
                    f"compile cache {target}: {what} {name!r} fails its sha256 check (corrupt); nothing loaded"
                )
    for kind, _, _, data in batches:
        if torch.compiler.load_cache_artifacts(data) is None:
            raise ValueError(f"compile cache {target}: torch could not read its artifact batch {kind!r}")
    root = _inductor_dir()
    for name, _, _, data in kernels:
        library = root / name
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(library, data, mode=0o755)
    return True
