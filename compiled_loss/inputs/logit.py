"""LOGIT inputs (ref §5.1): the logits themselves, at every position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.packing.view import TokenView

Tensor = torch.Tensor


def logit_input(
    view: TokenView, logits: Tensor, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> dict[str, Any]:
    """`{"logits": [B, S, V]}` (as given without context parallelism; all-gathered with it)."""
    return {"logits": view.unpacked(logits)}
