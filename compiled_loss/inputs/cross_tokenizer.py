"""Cross-tokenizer distillation inputs (ref §5.1 DISTILLATION_CROSS_TOKENIZER): the host-side
alignment of two tokenizations, and the loss input built from the student's logits and
the teachers' data keys the loss declares (`InputSpec.teacher_logits_keys`,
`.teacher_alignment_keys`).

The loss reads whole student and teacher distributions, so the student's logits must be
the full-vocabulary tensor on every position: no `LinearLogits`, no tensor- or
context-parallel group (NeMo-RL's cross-tokenizer distillation runs at tp = cp = 1 too).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TypedDict

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.parallel import ParallelGroups
from compiled_loss.vocab import LinearLogits

Tensor = torch.Tensor


def align_tokenizations(
    student_lengths: Sequence[Sequence[int]], teacher_lengths: Sequence[Sequence[int]], width: int
) -> Tensor:
    """`[B, width]` long (host side): entry `t` is the teacher position `a` whose prefix
    (teacher tokens `0..a`) covers the same text as the student's prefix (tokens `0..t`),
    so that both next tokens start at the same text offset; -1 where no teacher prefix ends
    there and past the row. `*_lengths[b]` are the text lengths (characters or bytes) of
    row `b`'s tokens in order; when several teacher prefixes end at one offset (tokens
    without text), the longest is taken."""
    if len(student_lengths) != len(teacher_lengths):
        raise ValueError(
            f"align_tokenizations: student_lengths has {len(student_lengths)} rows, teacher_lengths "
            f"{len(teacher_lengths)}"
        )
    out = torch.full((len(student_lengths), width), -1, dtype=torch.long)
    for b, (student, teacher) in enumerate(zip(student_lengths, teacher_lengths)):
        if any(n < 0 for n in itertools.chain(student, teacher)):
            raise ValueError(f"align_tokenizations: token text lengths must be >= 0, got a negative one in row {b}")
        teacher_end = {end: a for a, end in enumerate(itertools.accumulate(teacher))}
        for t, end in enumerate(itertools.accumulate(student[:width])):
            out[b, t] = teacher_end.get(end, -1)
    return out


def check_student_logits(logits: Logits, name: str, parallel: ParallelGroups, who: str) -> None:
    """The student's logits must be a whole `[B, S, V_s]` (or packed `[1, T, V_s]`) tensor;
    `name` is the loss's."""
    if parallel.sizes[:2] != (1, 1):
        raise ValueError(
            f"{who}: {name} reads whole student and teacher distributions; it takes no vocab_parallel_group or "
            "context_parallel_group (NeMo-RL's cross-tokenizer distillation runs at tp = cp = 1 too)"
        )
    if isinstance(logits, LinearLogits):
        raise ValueError(
            f"{who}: {name} reads the student's full distributions; pass the logits tensor, not LinearLogits"
        )


class CrossTokenizerInput(TypedDict):
    """DISTILLATION_CROSS_TOKENIZER inputs."""

    logits: Tensor  # the student's, [B, S, V_s]
    teacher_full_logits_by_idx: dict[int, Tensor]
    aligns_by_idx: dict[int, Tensor]


def cross_tokenizer_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[CrossTokenizerInput, None]:
    """The student's logits at every position `[B, S, V_s]` and the teachers' data keys the
    loss declares."""
    assert isinstance(logits, Tensor)  # `check_student_logits` refuses LinearLogits
    logits_keys, alignment_keys = spec.teacher_logits_keys, spec.teacher_alignment_keys
    require_keys(data, logits_keys + alignment_keys, view.who)
    inputs = CrossTokenizerInput(
        logits=view.unpacked(logits),
        teacher_full_logits_by_idx={i: data[key] for i, key in enumerate(logits_keys)},
        aligns_by_idx={i: data[key] for i, key in enumerate(alignment_keys)},
    )
    return inputs, None
