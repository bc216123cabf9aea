"""LOGIT inputs (ref §5.1): the logits themselves, at every position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.packing.view import Logits, TokenView

Tensor = torch.Tensor


class LogitInput(TypedDict):
    """LOGIT inputs."""

    logits: Tensor  # [B, S, V]


def logit_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[LogitInput, None]:
    """`{"logits": [B, S, V]}` (as given without context parallelism; all-gathered with it)."""
    assert isinstance(logits, Tensor)  # `prepare_inputs` refuses LinearLogits for a LOGIT loss
    return LogitInput(logits=view.unpacked(logits)), None
