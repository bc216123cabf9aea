"""Co-trained drafter runtimes (ref §7.5, §11.3): what a runtime is given and the seed's
runtime protocol around it.

A runtime's loss is a pure function of one micro-batch's `DraftBatch` — everything the
policy forward captured, detached — so it traces into the training step's graph with
static shapes. The seed protocol (`stash_teacher_logits`, `begin_global_batch`,
`compute_loss(prepared_data)`) wraps that function for trainers that drive a runtime the
reference's way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Tensor = torch.Tensor

_MASK64 = (1 << 64) - 1


@runtime_checkable
class DraftRuntime(Protocol):
    """A co-trained drafter: its loss over the prepared policy micro-batch.

    `compute_loss` runs the drafter on what the policy forward captured (detached teacher
    logits and hidden states), so the policy's gradients do not depend on it; the wrapper
    adds `loss_weight × loss` to the policy loss and merges the metrics.
    """

    loss_weight: float

    def compute_loss(self, prepared_data: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One micro-batch as a drafter sees it, in a row layout — `R` rows of `L` slots: the
    unpacked `[B, S]` batch, or one packed row `[1, T]`. Every tensor is detached."""

    input_ids: Tensor
    """`[R, L]` long: the tokens."""
    hidden_states: Tensor
    """`[R, L, A·H]`: the policy's auxiliary hidden states, concatenated in ascending layer order."""
    teacher_logits: Tensor
    """`[R, L, V]`: the policy's raw logits (before temperature); slot t predicts token t+1."""
    loss_mask: Tensor
    """`[R, L]`: `token_mask · sample_mask`, token-indexed like the data (1 = a supervised token)."""
    document_ids: Tensor
    """`[R, L]` long: the document (sequence) of each slot, -1 for padding; attention stays within one."""
    position_ids: Tensor
    """`[R, L]` long: each slot's position within its document."""
    anchor_noise: Tensor
    """`[R, L]` fp32 uniform noise drawn on the host from `anchor_seed` (anchor sampling)."""


def anchor_seed(dp_rank: int, global_batch: int, micro_batch: int) -> int:
    """Seed of a micro-batch's anchor noise (ref §11.3): a splitmix64 hash of
    (dp rank, global batch, micro-batch), so TP / CP peers draw identical anchors."""
    z = 0
    for part in (dp_rank, global_batch, micro_batch):
        z = (z + part + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z & ((1 << 63) - 1)


def anchor_noise(shape: tuple[int, ...], seed: int, device: torch.device | str | None = None) -> Tensor:
    """Uniform `[0, 1)` noise of `shape` from `seed` (host side, outside compiled code)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator).to(device)


def aux_layers_default(num_layers: int) -> tuple[int, ...]:
    """The reference's auxiliary hidden-state layers (`get_eagle3_aux_hidden_state_layers`,
    ref §11.1): outputs of decoder layers `{1, L//2 - 1, L - 4}` (0-based, clamped)."""
    return tuple(
        sorted({min(1, num_layers - 1), max(0, num_layers // 2 - 1), max(min(1, num_layers - 1), num_layers - 4)})
    )


def aux_hidden_states(hidden: Sequence[Tensor], aux_layers: Sequence[int]) -> Tensor:
    """`[R, L, A·H]`: the outputs of decoder layers `aux_layers`, concatenated in ascending
    layer order, detached, from a model's hidden-state list `[after the embedding, after
    layer 0, …]` (`TinyLM(return_hidden=True)`'s convention)."""
    return torch.cat([hidden[i + 1] for i in sorted(aux_layers)], -1).detach()


class DraftRuntimeBase(torch.nn.Module):
    """A runtime: the drafter (a module of its own), its `loss_weight`, the policy layers
    whose outputs it reads (`aux_layers`, 0-based decoder layers), and `draft_loss(batch,
    n_slots)` — pure and traceable, returning the loss already divided by `n_slots` (the
    micro-batch slots of a global batch, so the summed gradient is the mean of per-slot
    means) and metrics as 0-d tensors (raw num/den pairs, which sum across micro-batches).

    The seed protocol keeps the little state the reference's trainers expect:
    `begin_global_batch(n_slots)` starts a global batch, `stash_teacher_logits(logits,
    need_clone)` keeps the raw logits (before in-place temperature scaling), and
    `compute_loss(prepared_data)` — with `prepared_data["draft_batch"]`, a `DraftBatch`
    whose teacher may be left out (the stash is used) — runs `draft_loss`.
    """

    def __init__(self, loss_weight: float, aux_layers: tuple[int, ...], dp_group: Any = None) -> None:
        super().__init__()
        self.loss_weight, self.aux_layers, self.dp_group = loss_weight, tuple(sorted(aux_layers)), dp_group
        self.n_slots, self.global_batch, self.micro_batch = 1, -1, 0
        self._stashed: Tensor | None = None

    def draft_loss(self, batch: DraftBatch, n_slots: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} must implement draft_loss(batch, n_slots)")

    def begin_global_batch(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self.n_slots, self.global_batch, self.micro_batch = n_slots, self.global_batch + 1, 0

    def stash_teacher_logits(self, logits: Tensor, need_clone: bool) -> None:
        self._stashed = logits.detach().clone() if need_clone else logits.detach()

    def compute_loss(self, prepared_data: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        if "draft_batch" not in prepared_data:
            raise ValueError(f"{type(self).__name__}.compute_loss needs prepared_data['draft_batch'] (a DraftBatch)")
        batch = prepared_data["draft_batch"]
        if batch.teacher_logits is None:
            if self._stashed is None:
                raise ValueError(f"{type(self).__name__}: no teacher logits stashed for this micro-batch")
            batch = dataclasses.replace(batch, teacher_logits=self._stashed)
        self.micro_batch += 1
        self._stashed = None
        return self.draft_loss(batch, self.n_slots)
