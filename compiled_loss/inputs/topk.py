"""DISTILLATION inputs (ref §5.1, §8.9): the student's log-probs at the teacher's top-k token
ids, the teacher's top-k log-probs, and optionally the student's full-vocabulary `Σ p log p`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import torch
from torch.distributed import ProcessGroup

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.parallel import group_size
from compiled_loss.vocab import LinearLogits, vocab_reduce

Tensor = torch.Tensor


def _student_topk(
    rows: Logits,
    index: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`[N, k]` student values at teacher indices: full-vocab log-probs (zero_outside_topk)
    or log-probs renormalised over the k gathered logits; plus `Σ p log p` if asked."""
    if zero_outside_topk:
        stats = vocab_reduce(rows, index, entropy=calculate_entropy, chunk_size=chunk_size, group=group)
        return stats.picked - stats.lse[:, None], stats.negent if calculate_entropy else None
    # the k logits (from whichever vocabulary shard holds them; LinearLogits: chunk by chunk),
    # renormalised over the k by the same primitive, so rows no loss reads get exactly zero gradient
    if group_size(group) > 1 or isinstance(rows, LinearLogits):
        picked = vocab_reduce(rows, index, chunk_size=chunk_size, group=group).picked
    else:
        picked = rows.gather(-1, index)
    k_way = vocab_reduce(picked, torch.arange(index.shape[-1], device=index.device).expand_as(index))
    return k_way.picked - k_way.lse[:, None], None


def topk_logprobs(
    view: TokenView,
    logits: Logits,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    *,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Student / teacher top-k log-probs `[B, S-1, k]` and `H_all` `[B, S-1]` (or None); the
    indices are global token ids, the vocabulary sharded over `group`."""
    k = teacher_topk_indices.shape[-1]
    if k <= 0:
        raise ValueError(f"topk must be positive, got k={k}")
    rows = view.rows(logits)
    index = view.local(teacher_topk_indices.to(device=rows.device, dtype=torch.long))
    student, entropy = _student_topk(rows, index, zero_outside_topk, calculate_entropy, group, chunk_size)
    student = view.full(student)
    teacher = torch.log_softmax(teacher_topk_logits.to(device=student.device, dtype=student.dtype), -1)
    h_all = None if entropy is None else view.full(entropy)[:, :-1]
    return student[:, :-1], teacher[:, :-1], h_all


class TopkInput(TypedDict):
    """DISTILLATION inputs: `[B, S-1, k]` log-probs; `H_all [B, S-1]` or None."""

    student_topk_logprobs: Tensor
    teacher_topk_logprobs: Tensor
    H_all: Tensor | None


def topk_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[TopkInput, None]:
    """`student_topk_logprobs`, `teacher_topk_logprobs` `[B, S-1, k]` and `H_all` from
    `data["teacher_topk_logits"]` / `data["teacher_topk_indices"]` `[B, S, k]`."""
    require_keys(data, ("teacher_topk_logits", "teacher_topk_indices"), view.who)
    student, teacher, h_all = topk_logprobs(
        view,
        logits,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        spec.zero_outside_topk,
        spec.topk_entropy,
        group=options.parallel.tp,
        chunk_size=options.chunk_size,
    )
    return TopkInput(student_topk_logprobs=student, teacher_topk_logprobs=teacher, H_all=h_all), None
