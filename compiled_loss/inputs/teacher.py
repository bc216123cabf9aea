"""The teacher side of on-policy distillation (ref §6.5–6.6): teacher logits for this
rank's shard from a transported payload (hidden states projected per teacher, or logits).
Host-side utilities: they read `teacher_index` values."""

from __future__ import annotations

from typing import Any

import torch

from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel import group_size

Tensor = torch.Tensor


def project_hidden_states_per_teacher(
    payload: Tensor, weight_by_index: dict[int, Tensor], teacher_index: Tensor
) -> Tensor:
    """Project each row's hidden states `[B, S, H]` through its own teacher's LM head
    `[V_local, H]`; one matmul per distinct teacher present (ref §6.5). Host-side."""
    rows, _, hidden = payload.shape
    if teacher_index.dim() != 1 or teacher_index.shape[0] != rows:
        raise ValueError(
            f"teacher_index must carry one entry per payload row ({rows}), got shape "
            f"{tuple(teacher_index.shape)}"
        )
    present = sorted(set(teacher_index.tolist()))  # host
    for idx in present:
        if idx not in weight_by_index:
            raise ValueError(
                f"teacher_index names teacher {idx} but no teacher LM head is loaded for that "
                f"index (loaded: {sorted(weight_by_index)})"
            )
        if weight_by_index[idx].shape[1] != hidden:
            raise ValueError(
                f"teacher {idx}'s LM head expects hidden size {weight_by_index[idx].shape[1]}, "
                f"payload has {hidden}"
            )
    if len(present) == 1:
        weight = weight_by_index[present[0]]
        return payload.to(weight.dtype) @ weight.T
    reference = next(iter(weight_by_index.values()))
    out = payload.new_empty(payload.shape[:2] + (reference.shape[0],), dtype=reference.dtype)
    for idx in present:
        weight = weight_by_index[idx]
        if weight.shape[0] != reference.shape[0] or weight.dtype != reference.dtype:
            raise ValueError(
                "all loaded teacher LM heads must share one vocabulary shard and dtype; teacher "
                f"{idx} has {tuple(weight.shape)} {weight.dtype}, the first has "
                f"{tuple(reference.shape)} {reference.dtype}"
            )
        rows_of = (teacher_index == idx).nonzero().squeeze(-1)  # host
        out[rows_of] = payload[rows_of].to(weight.dtype) @ weight.T
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
    _, seq, width = payload.shape
    local_seq, local_vocab = student_logits.shape[1], student_logits.shape[-1]
    weights = teacher_output_layer_weight_by_index
    if teacher_payload == "hidden_states":
        if not weights:
            raise ValueError(
                "teacher_payload='hidden_states' needs teacher_output_layer_weight_by_index "
                "(a teacher LM-head shard)"
            )
        if len(weights) > 1 and teacher_index is None:
            raise ValueError(
                f"{len(weights)} teacher LM heads are loaded but no teacher_index routes the "
                "rows; refusing to guess"
            )
        for idx, weight in weights.items():
            if weight.shape[1] != width:
                raise ValueError(
                    f"teacher {idx}'s LM head expects hidden size {weight.shape[1]}, payload "
                    f"has {width}"
                )
    elif teacher_payload == "logits":
        if vocab_parallel_rank is None:
            raise ValueError("teacher_payload='logits' requires vocab_parallel_rank")
        end = (vocab_parallel_rank + 1) * local_vocab
        if width < end:
            raise ValueError(
                f"teacher logits payload has vocab width {width}, narrower than rank "
                f"{vocab_parallel_rank}'s shard end {end}"
            )
        payload = payload[..., end - local_vocab : end]
    else:
        raise ValueError(
            f"teacher_payload must be 'hidden_states' or 'logits', got {teacher_payload!r}"
        )
    cp = group_size(context_parallel_group)
    pad = local_seq * cp - seq
    if pad < 0:
        raise ValueError(
            f"teacher payload has {seq} positions, more than the student's {local_seq} × {cp} context ranks"
        )
    payload = torch.nn.functional.pad(payload, (0, 0, 0, pad)).contiguous().to(student_logits.device)
    if cp > 1:
        rows = payload.shape[0]
        shards = ContextShards.of_rows(rows, local_seq * cp, context_parallel_group, payload.device)
        payload = shards.local(payload.flatten(0, 1)).reshape(rows, local_seq, -1)
    if teacher_payload == "hidden_states":
        if teacher_index is not None:
            payload = project_hidden_states_per_teacher(
                payload, {k: w.to(payload.device) for k, w in weights.items()}, teacher_index
            )
        else:
            weight = next(iter(weights.values())).to(payload.device)
            payload = payload.to(weight.dtype) @ weight.T
    if payload.shape[-1] != local_vocab:
        raise ValueError(
            f"reconstructed teacher logits have vocab width {payload.shape[-1]}, the student "
            f"shard has {local_vocab}"
        )
    return payload
