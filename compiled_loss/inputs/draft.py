"""DRAFT inputs (ref §5.1 DRAFT, §8.14): the policy's logits as the drafter's teacher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.parallel import ParallelGroups
from compiled_loss.vocab import LinearLogits, draft_vocab_logits

Tensor = torch.Tensor


class DraftInput(TypedDict):
    """DRAFT inputs, in the logits' own layout."""

    teacher_logits: Tensor
    student_logits: Tensor
    token_mask: Tensor


def draft_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[DraftInput, None]:
    """`teacher_logits`: the policy's logits shifted left by one within each sequence (zero
    after a sequence's last position; the shift crosses ranks under context parallelism),
    detached and mapped to the draft vocabulary (`options.d2t`); `token_mask`: shifted the
    same way; `student_logits`: `data["student_logits"]` — all in the logits' own layout.
    `LinearLogits` are mapped first (only the draft vocabulary's rows of the LM head)."""
    require_keys(data, ("token_mask", "student_logits"), f"{view.who} (DRAFT)")
    d2t, parallel = options.d2t, ParallelGroups(tp=options.parallel.tp)
    if isinstance(logits, LinearLogits):
        logits = draft_vocab_logits(logits, d2t, parallel, view.who).detach()
        d2t, parallel = None, ParallelGroups()  # mapped: the rows are this rank's draft-vocabulary slice
    teacher = draft_vocab_logits(view.next_rows(view.rows(logits)), d2t, parallel, view.who)
    inputs = DraftInput(
        teacher_logits=view.local_layout(teacher),
        student_logits=data["student_logits"],
        token_mask=view.local_layout(view.next_tokens(data["token_mask"])),
    )
    return inputs, None
