"""Checkpoints of the embedded training loop (`run.save_every`, `run.keep_last`, `run.resume`).

A checkpoint (one `torch.save` file) holds what the rest of the run depends on: the global
step, the warm start's length, the policy, the KL reference (the warm-start weights once
the warm start is over), the drafter, both optimizers (the warm start's and the loss's),
the prompt generator's and torch's RNG states, the metrics of the steps so far, the whole
run config (a plain dict, enums as their values) and a SHA-256 digest of all of it. The
sampler's randomness is a function of the seed and the step, so it needs no state.
The models' and optimizers' states are whole, whatever the layout: in a parallel run the
ranks gather them from their FSDP2 / tensor-parallel shards with
`torch.distributed.checkpoint`'s state-dict API (`full_state_dict` with `cpu_offload`: one
parameter at a time, rank 0 keeping each in host memory and the other ranks none), rank 0
writes the file, and on resume every rank maps it (`torch.load(mmap=True)`: the ranks of a
node share its pages) and takes its own shards of it. A checkpoint thus resumes on any
parallel layout (`parallel.*` is among the keys a resume may change), one process included;
the whole state passes through rank 0's host memory, not through any accelerator's.

A file is written beside its final name, flushed to disk and renamed over it, so a kill
leaves the previous file whole. A resume refuses, naming `run.resume`, a file it cannot
use: missing, unreadable (empty, truncated, corrupt — the digest catches bytes that still
unpickle), foreign (no checkpoint of this runner), or written by a run this config cannot
continue. A resume may change only how the same steps are laid out, compiled, logged and
saved (`RESUMABLE`) and, within the schedule, `run.steps` and `run.sft_steps`; everything
else — the model, loss, drafter, data, sampling, optimizer and seed — must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from compiled_loss.config import Config, draft_names

# Keys a resume may change (a key, or a group ending in "."): how the same steps are laid
# out, compiled, logged and saved. Logging and saving keys resume bitwise; a changed layout
# (packing, parallel sizes, micro-batches, log-prob chunking, the fused head) or compiler
# reorders float sums, so the run continues to float rounding. `run.steps` and
# `run.sft_steps` are checked against the checkpoint's step (`load_checkpoint`).
RESUMABLE = (
    "compile.",
    "packing.",
    "parallel.",
    "run.micro_batches",
    "logprob.chunk_size",
    "logprob.fused_linear",
    "run.deterministic",
    "run.validate_inputs",
    "run.log_every",
    "run.loggers",
    "run.save_every",
    "run.keep_last",
    "run.steps",
    "run.sft_steps",
)
_UNSET = "unset"  # a key one of the two configs lacks
_KEYS = (
    "step",
    "warm_steps",
    "config",
    "policy",
    "reference",
    "drafter",
    "optimizers",
    "python_rng",
    "torch_rng",
    "history",
    "digest",
)


@dataclasses.dataclass
class TrainingState:
    """What a checkpoint carries of a run, besides its step and metrics: the config, the
    models and optimizers, the prompt generator's RNG and the warm start's length."""

    cfg: Config
    policy: torch.nn.Module
    reference: torch.nn.Module
    """The KL reference (the warm-start weights once the warm start is over)."""
    drafter: torch.nn.Module | None
    optimizers: tuple[torch.optim.Optimizer, ...]
    """The warm start's and the loss's."""
    rng: random.Random
    """The prompt generator's."""
    warm_steps: int


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model.hidden_size": 32, …}` of a plain config."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def _digest(state: Any) -> str:
    """SHA-256 of a checkpoint's contents: every tensor's dtype, shape and bytes and every
    other value's type and repr, in order (a list and a tuple alike: unpickling may turn one
    into the other)."""
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"tensor {value.dtype} {tuple(value.shape)};".encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # host
        elif isinstance(value, dict):
            digest.update(f"dict {len(value)};".encode())
            for key, item in value.items():
                feed(key)
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"list {len(value)};".encode())
            for item in value:
                feed(item)
        else:
            text = repr(value)
            digest.update(f"{type(value).__name__} {len(text)} {text};".encode())

    feed(state)
    return digest.hexdigest()


_WHOLE = StateDictOptions(full_state_dict=True)  # load: every rank takes its shards of the whole state
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # save: rank 0 alone keeps the whole state


def _trained(training: TrainingState) -> torch.nn.Module:
    """The modules the optimizers step, as one (its parameters named `policy.…`, `drafter.…`)."""
    return torch.nn.ModuleDict(
        {"policy": training.policy} | ({"drafter": training.drafter} if training.drafter is not None else {})
    )


def _optimizer_state(trained: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The optimizer's state, whole; None before its first step (the state-dict API would
    initialise the state with a step of zero gradients, which counts in AdamW's bias correction)."""
    return get_optimizer_state_dict(trained, optimizer, options=_GATHER) if optimizer.state else None


def save_checkpoint(
    directory: Path, training: TrainingState, step: int, history: list[dict[str, Any]], *, write: bool = True
):
    """Gather the run's state whole (a collective in a parallel run: every rank calls it) and,
    where `write` (rank 0), write `directory/step_<step>.pt` atomically (a temporary file in
    the same directory, fsynced, then `os.replace`d over the name, then the directory
    fsynced); return its path (None where not written)."""
    trained = _trained(training)
    state = {
        "step": step,
        "warm_steps": training.warm_steps,
        "config": training.cfg.plain(),
        "policy": get_model_state_dict(training.policy, options=_GATHER),
        "reference": get_model_state_dict(training.reference, options=_GATHER),
        "drafter": training.drafter.state_dict() if training.drafter is not None else None,
        "optimizers": [_optimizer_state(trained, o) for o in training.optimizers],
        "python_rng": training.rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "history": history,
    }
    if not write:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step}.pt"
    state["digest"] = _digest(state)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory_fd = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    return path


def _read(path: str, device: torch.device) -> dict[str, Any]:
    """The checkpoint at `path`, its digest verified; ValueError naming `run.resume` and what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"run.resume={path!r}: no such checkpoint file")
    if file.stat().st_size == 0:
        raise ValueError(f"run.resume={path!r}: the file is empty")
    try:
        state = torch.load(file, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # anything a damaged or foreign file makes the unpickler raise
        raise ValueError(
            f"run.resume={path!r}: torch.load cannot read it (a truncated, corrupt or foreign file: {type(e).__name__})"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(
            f"run.resume={path!r} holds a value of type {type(state).__name__}, not a checkpoint of "
            "python -m compiled_loss.run"
        )
    missing = [key for key in _KEYS if key not in state]
    if missing:
        raise ValueError(
            f"run.resume={path!r} is not a checkpoint of python -m compiled_loss.run: it lacks the keys {missing}"
        )
    if state.pop("digest") != _digest(state):
        raise ValueError(
            f"run.resume={path!r}: its contents do not match the digest they were written with (a corrupt file)"
        )
    return state


def _compatible(path: str, state: dict[str, Any], training: TrainingState) -> list[str]:
    """The config keys this run changes from the checkpoint's — all of them ones a resume may
    change — as `key old -> new`; ValueError naming `run.resume` and the keys otherwise."""
    old, new = _flat(state["config"]), _flat(training.cfg.plain())
    for group in ("loss", "draft"):  # another loss or drafter: its name says it, its fields are another schema's
        if old.get(f"{group}.name") != new[f"{group}.name"]:
            old = {k: v for k, v in old.items() if not k.startswith(f"{group}.") or k == f"{group}.name"}
            new = {k: v for k, v in new.items() if not k.startswith(f"{group}.") or k == f"{group}.name"}
    # where the run reads its checkpoint and compiled graphs from: no part of what it trains
    unread = {"run.resume", "run.compile_cache"}
    differ = sorted(k for k in (old.keys() | new.keys()) - unread if old.get(k, _UNSET) != new.get(k, _UNSET))
    changes = {k: f"{k} {old.get(k, _UNSET)!r} -> {new.get(k, _UNSET)!r}" for k in differ}
    fixed = draft_names()[new["draft.name"]].fixed_on_resume
    refused = [
        k for k in differ if k in fixed or not any(k.startswith(r) if r.endswith(".") else k == r for r in RESUMABLE)
    ]
    if refused:
        may = ", ".join(f"{r}*" if r.endswith(".") else r for r in RESUMABLE if r not in fixed)
        raise ValueError(
            f"run.resume={path!r} was written by a run this config cannot continue: "
            f"{', '.join(changes[k] for k in refused)} (checkpoint -> this run); a resume may change "
            f"only {may}"
        )
    return list(changes.values())


def load_checkpoint(path: str, training: TrainingState) -> tuple[int, list[dict[str, Any]], list[str]]:
    """Check a checkpoint written by `save_checkpoint` against the run (its config, its
    schedule) and restore it into the run's objects; return its step, the metrics of the
    steps it covers and the config changes the run makes (`key old -> new`). Any file it
    cannot continue from is a ValueError naming `run.resume` and what is wrong."""
    state = _read(path, next(training.policy.parameters()).device)
    changes = _compatible(path, state, training)
    done, warm, total = state["step"], state["warm_steps"], training.cfg.run.steps
    if min(done, warm) != min(done, training.warm_steps):  # a step the checkpoint trained would change phase
        need = f"run.sft_steps={warm}" if done > warm else f"run.sft_steps >= {done}"
        raise ValueError(
            f"run.resume={path!r} is at step {done} of a run with a warm start of {warm} steps; "
            f"run.sft_steps={training.cfg.run.sft_steps} would change the phase of steps it has trained "
            f"(and the KL reference taken at the warm start's end): resume with {need}"
        )
    if done >= total:
        raise ValueError(
            f"run.resume={path!r} is at step {done}; this run ends at run.steps={total}: nothing to train — raise "
            "run.steps"
        )
    try:
        set_model_state_dict(training.policy, state["policy"], options=_WHOLE)
        set_model_state_dict(training.reference, state["reference"], options=_WHOLE)
        if training.drafter is not None:
            training.drafter.load_state_dict(state["drafter"])
        trained = _trained(training)
        for optimizer, optimizer_state in zip(training.optimizers, state["optimizers"], strict=True):
            if optimizer_state is not None:  # None: it had not stepped, as a new one
                set_optimizer_state_dict(trained, optimizer, optimizer_state, options=_WHOLE)
        version, internal, gauss = state["python_rng"]
        training.rng.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a file of another version of this code
        raise ValueError(f"run.resume={path!r}: its state does not fit this run's objects ({e})") from e
    return done, state["history"], changes
