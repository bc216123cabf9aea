"""What `DraftRuntimeLossWrapper` needs of a co-trained drafter (ref §7.5)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

Tensor = torch.Tensor


@runtime_checkable
class DraftRuntime(Protocol):
    """A co-trained drafter: its loss over the prepared policy micro-batch.

    `compute_loss` runs the drafter on what the policy forward captured (detached teacher
    logits and hidden states), so the policy's gradients do not depend on it; the wrapper
    adds `loss_weight × loss` to the policy loss and merges the metrics.
    """

    loss_weight: float

    def compute_loss(self, prepared_data: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]: ...
