"""The teacher side of on-policy distillation (ref §6.5–6.6): teacher logits for this
rank's shard from a transported payload (hidden states projected per teacher, or logits).
Traceable; in eager mode the `teacher_index` values are checked against the loaded heads
(one host read)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


OPD_FULL_TEACHER_PAYLOAD_FIELD = "opd_full_teacher_payload"
"""The data key of the teacher payload `[B, S, D]` (full logits or hidden states)."""
OPD_FULL_TEACHER_INDEX_FIELD = "opd_full_teacher_index"
"""The data key of each row's teacher index `[B]` (which loaded teacher LM head)."""


def check_heads(weight_by_index: dict[int, Tensor], hidden: int) -> Tensor:
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
    reference = check_heads(weight_by_index, payload.shape[-1])
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
    tp_rank: int,
    local_vocab: int,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> Tensor:
    """This rank's teacher logit shard `[..., V_local]` from a payload `[..., D]` of full
    logits (the slice of vocabulary shard `tp_rank` is taken) or hidden states (projected through the
    LM head `teacher_index [...]` names). Traceable."""
    if teacher_payload == "hidden_states":
        out = project_hidden_states(payload, teacher_output_layer_weight_by_index or {}, teacher_index)
    elif teacher_payload == "logits":
        end = (tp_rank + 1) * local_vocab
        if payload.shape[-1] < end:
            raise ValueError(
                f"teacher logits payload has vocab width {payload.shape[-1]}, narrower than rank "
                f"{tp_rank}'s shard end {end}"
            )
        out = payload[..., end - local_vocab : end]
    else:
        raise ValueError(f"teacher_payload must be 'hidden_states' or 'logits', got {teacher_payload!r}")
    if out.shape[-1] != local_vocab:
        raise ValueError(
            f"reconstructed teacher logits have vocab width {out.shape[-1]}, the student shard has {local_vocab}"
        )
    return out
