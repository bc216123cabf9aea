"""Checkpoints of the embedded training loop (`run.save_every`, `run.resume`), with torch.save.

A checkpoint holds what the rest of the run depends on: the global step, the policy, the
KL reference (the warm-start weights once the warm start is over), the drafter, both
optimizers (the warm start's and the loss's), the prompt generator's and torch's RNG
states and the metrics of the steps so far. The sampler's randomness is a function of the
seed and the step, so it needs no state.
Every rank holds the whole model, so rank 0 writes the file and every rank reads it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, *, step: int, loss: str, policy: torch.nn.Module, reference: torch.nn.Module,
                    drafter: torch.nn.Module | None, optimizers: tuple[torch.optim.Optimizer, ...],
                    rng: random.Random, history: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "step": step,
        "loss": loss,
        "policy": policy.state_dict(),
        "reference": reference.state_dict(),
        "drafter": drafter.state_dict() if drafter is not None else None,
        "optimizers": [o.state_dict() for o in optimizers],
        "python_rng": rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "history": history,
    }, path)


def load_checkpoint(path: str, *, loss: str, policy: torch.nn.Module, reference: torch.nn.Module,
                    drafter: torch.nn.Module | None, optimizers: tuple[torch.optim.Optimizer, ...],
                    rng: random.Random) -> tuple[int, list[dict[str, Any]]]:
    """Restore a checkpoint written by `save_checkpoint` into the run's objects; return its
    step and the metrics of the steps it covers."""
    if not Path(path).is_file():
        raise ValueError(f"run.resume={path!r}: no such checkpoint file")
    state = torch.load(path, map_location=next(policy.parameters()).device, weights_only=True)
    if state["loss"] != loss:
        raise ValueError(f"run.resume={path!r} was written by a loss={state['loss']} run; this run has loss={loss}")
    if (state["drafter"] is None) != (drafter is None):
        raise ValueError(f"run.resume={path!r} was written {'without' if state['drafter'] is None else 'with'} "
                         "a drafter; the run's draft option differs")
    policy.load_state_dict(state["policy"])
    reference.load_state_dict(state["reference"])
    if drafter is not None:
        drafter.load_state_dict(state["drafter"])
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    version, internal, gauss = state["python_rng"]
    rng.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]
