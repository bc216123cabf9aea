"""The teacher side of on-policy distillation (ref §6.5–6.6): teacher logits for this
rank's shard from a transported payload (hidden states projected per teacher, or logits).
Traceable; in eager mode the `teacher_index` values are checked against the loaded heads
(one host read)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel import group_size

Tensor = torch.Tensor


OPD_FULL_TEACHER_PAYLOAD_FIELD = "opd_full_teacher_payload"
"""The data key of the teacher payload `[B, S, D]` (full logits or hidden states)."""
OPD_FULL_TEACHER_INDEX_FIELD = "opd_full_teacher_index"
"""The data key of each row's teacher index `[B]` (which loaded teacher LM head)."""


def _check_heads(weight_by_index: dict[int, Tensor], hidden: int) -> Tensor:
    """Every loaded head reads `hidden` and all share one vocabulary shard and dtype; the
    first head (the reference for the output's width and dtype)."""
    if not weight_by_index:
        raise ValueError(
            "teacher_payload='hidden_states' needs teacher_output_layer_weight_by_index (a teacher LM-head shard)"
        )
    reference = next(iter(weight_by_index.values()))
    for idx, weight in weight_by_index.items():
        if weight.dim() != 2 or weight.shape[1] != hidden:
            raise ValueError(
                f"teacher {idx}'s LM head must be [V_local, {hidden}] (the payload's hidden size), got "
                f"{tuple(weight.shape)}"
            )
        if weight.shape[0] != reference.shape[0] or weight.dtype != reference.dtype:
            raise ValueError(
                "all loaded teacher LM heads must share one vocabulary shard and dtype; teacher "
                f"{idx} has {tuple(weight.shape)} {weight.dtype}, the first has "
                f"{tuple(reference.shape)} {reference.dtype}"
            )
    return reference


def _check_teacher_index(teacher_index: Tensor, weight_by_index: dict[int, Tensor]) -> None:
    """Eager only (one host read): every row names a loaded head."""
    if torch.compiler.is_compiling():
        return
    for idx in sorted(set(teacher_index.reshape(-1).tolist())):  # host
        if idx not in weight_by_index:
            raise ValueError(
                f"teacher_index names teacher {idx} but no teacher LM head is loaded for that "
                f"index (loaded: {sorted(weight_by_index)})"
            )


def project_hidden_states(payload: Tensor, weight_by_index: dict[int, Tensor], teacher_index: Tensor | None) -> Tensor:
    """Teacher logits `[..., V_local]` from hidden states `[..., H]`: each position through
    the LM head its `teacher_index` (same leading shape, or None with one head loaded)
    names. Traceable: one matmul per loaded head, the rows picked with `where`; a row
    naming no loaded head is an error in eager mode and NaN under torch.compile."""
    reference = _check_heads(weight_by_index, payload.shape[-1])
    if teacher_index is None:
        if len(weight_by_index) > 1:
            raise ValueError(
                f"{len(weight_by_index)} teacher LM heads are loaded but no teacher_index routes the rows; "
                "refusing to guess"
            )
        return payload.to(reference.dtype) @ reference.to(payload.device).T
    _check_teacher_index(teacher_index, weight_by_index)
    out = payload.new_full(payload.shape[:-1] + (reference.shape[0],), float("nan"), dtype=reference.dtype)
    for idx, weight in weight_by_index.items():
        chosen = (teacher_index == idx).to(payload.device)[..., None]
        out = torch.where(chosen, payload.to(weight.dtype) @ weight.to(payload.device).T, out)
    return out


def project_hidden_states_per_teacher(
    payload: Tensor, weight_by_index: dict[int, Tensor], teacher_index: Tensor
) -> Tensor:
    """Project each row's hidden states `[B, S, H]` through its own teacher's LM head
    `[V_local, H]` (ref §6.5); see `project_hidden_states`."""
    rows = payload.shape[0]
    if teacher_index.dim() != 1 or teacher_index.shape[0] != rows:
        raise ValueError(
            f"teacher_index must carry one entry per payload row ({rows}), got shape {tuple(teacher_index.shape)}"
        )
    return project_hidden_states(payload, weight_by_index, teacher_index[:, None].expand(payload.shape[:2]))


def teacher_logits(
    payload: Tensor,
    teacher_index: Tensor | None,
    *,
    teacher_payload: str,
    vocab_parallel_rank: int | None,
    local_vocab: int,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> Tensor:
    """This rank's teacher logit shard `[..., V_local]` from a payload `[..., D]` of full
    logits (this rank's vocabulary slice is taken) or hidden states (projected through the
    LM head `teacher_index [...]` names). Traceable."""
    if teacher_payload == "hidden_states":
        out = project_hidden_states(payload, teacher_output_layer_weight_by_index or {}, teacher_index)
    elif teacher_payload == "logits":
        if vocab_parallel_rank is None:
            raise ValueError("teacher_payload='logits' requires vocab_parallel_rank")
        end = (vocab_parallel_rank + 1) * local_vocab
        if payload.shape[-1] < end:
            raise ValueError(
                f"teacher logits payload has vocab width {payload.shape[-1]}, narrower than rank "
                f"{vocab_parallel_rank}'s shard end {end}"
            )
        out = payload[..., end - local_vocab : end]
    else:
        raise ValueError(f"teacher_payload must be 'hidden_states' or 'logits', got {teacher_payload!r}")
    if out.shape[-1] != local_vocab:
        raise ValueError(
            f"reconstructed teacher logits have vocab width {out.shape[-1]}, the student shard has {local_vocab}"
        )
    return out


def reconstruct_opd_full_teacher_logits(
    payload: Tensor,
    *,
    teacher_payload: str,
    student_logits: Tensor,
    vocab_parallel_rank: int | None,
    context_parallel_group: Any,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
    teacher_index: Tensor | None = None,
) -> Tensor:
    """Turn the canonical `[B, S, D]` teacher payload (hidden states or full logits) into
    teacher logits `[B, S_local, V_local]` aligned with `student_logits` (ref §6.6).

    Under context parallelism the payload is padded to `S_local · cp` and this rank's
    load-balanced share of the positions is kept (ref §6.6).
    """
    rows, seq, width = payload.shape
    local_seq, local_vocab = student_logits.shape[1], student_logits.shape[-1]
    if teacher_index is not None and (teacher_index.dim() != 1 or teacher_index.shape[0] != rows):
        raise ValueError(
            f"teacher_index must carry one entry per payload row ({rows}), got shape {tuple(teacher_index.shape)}"
        )
    to_logits = functools.partial(
        teacher_logits,
        teacher_payload=teacher_payload,
        vocab_parallel_rank=vocab_parallel_rank,
        local_vocab=local_vocab,
        teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
    )
    if teacher_payload == "hidden_states":
        _check_heads(teacher_output_layer_weight_by_index or {}, width)
    else:  # full logits: this rank's vocabulary slice first
        payload = to_logits(payload, None)
    cp = group_size(context_parallel_group)
    pad = local_seq * cp - seq
    if pad < 0:
        raise ValueError(
            f"teacher payload has {seq} positions, more than the student's {local_seq} × {cp} context ranks"
        )
    payload = torch.nn.functional.pad(payload, (0, 0, 0, pad)).contiguous().to(student_logits.device)
    if cp > 1:
        shards = ContextShards.of_rows(rows, local_seq * cp, context_parallel_group, payload.device)
        payload = shards.local(payload.flatten(0, 1)).reshape(rows, local_seq, -1)
    if teacher_payload != "hidden_states":
        return payload
    return to_logits(payload, None if teacher_index is None else teacher_index[:, None].expand(rows, local_seq))
