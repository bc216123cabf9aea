"""DRAFT inputs (ref §5.1 DRAFT, §8.14): the policy's logits as the drafter's teacher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.vocab import LinearLogits, map_teacher_logits_to_draft_vocab

Tensor = torch.Tensor


def draft_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> dict[str, Any]:
    """`teacher_logits`: the policy's logits shifted left by one within each sequence (zero
    after a sequence's last position; the shift crosses ranks under context parallelism),
    detached and mapped to the draft vocabulary (`options.d2t`); `token_mask`: shifted the
    same way; `student_logits`: `data["student_logits"]` — all in the logits' own layout.
    `LinearLogits` are mapped first (only the draft vocabulary's rows of the LM head)."""
    require_keys(data, ("token_mask", "student_logits"), f"{view.who} (DRAFT)")
    d2t, tp = options.d2t, options.parallel.tp
    if isinstance(logits, LinearLogits):
        logits = map_teacher_logits_to_draft_vocab(logits, d2t, None, tp).detach()
        d2t, tp = None, None  # mapped: the rows are this rank's draft-vocabulary slice
    teacher = map_teacher_logits_to_draft_vocab(view.next_rows(view.rows(logits)), d2t, None, tp)
    return {
        "teacher_logits": view.local_layout(teacher),
        "student_logits": data["student_logits"],
        "token_mask": view.local_layout(view.next_tokens(data["token_mask"])),
    }
