"""Seed API `nemo_rl.algorithms.loss.utils` (ref §5.2, §6).

Layout helpers that take boundaries as `CpuIntTuple`s are host-side utilities (they build
index tensors from Python ints); compiled paths use `PackedLayout` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compiled_loss.layout import (
    CpuIntTuple,
    check_cu_seqlens,
    pack_source_index,
    roll_within_segments,
    to_cpu_int_tuple,
)
from compiled_loss.metrics import rescale_loss_metrics
from compiled_loss.parallel import require_single_process

Tensor = torch.Tensor

__all__ = [
    "CpuIntTuple",
    "to_cpu_int_tuple",
    "rescale_loss_metrics",
    "map_teacher_logits_to_draft_vocab",
    "roll_packed_seq_dim",
    "pack_rolled_draft_token_mask",
    "_project_hidden_states_per_teacher",
    "reconstruct_opd_full_teacher_logits",
    "_pack_input_ids",
]


def check_d2t(d2t: Tensor, vocab_size: int) -> None:
    """Host-side (syncs): every draft index `i` must map to a target id `i + d2t[i]` in
    `[0, vocab_size)`."""
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    target = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    bad = ((target < 0) | (target >= vocab_size)).nonzero()  # host
    if bad.numel():
        i = int(bad[0, 0])  # host
        raise ValueError(
            f"d2t maps draft index {i} to target id {int(target[i])} outside the target "  # host
            f"vocabulary [0, {vocab_size}) ({bad.numel()} such entries)"
        )


def map_teacher_logits_to_draft_vocab(
    teacher_logits: Tensor,
    d2t: Tensor | None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
) -> Tensor:
    """Restrict full-vocab teacher logits `[..., V]` to the draft vocabulary via `d2t`
    (draft index `i` → target id `i + d2t[i]`); no-op when `d2t` is None (ref §6.2).

    The range check on `d2t` reads its values, so it runs in eager mode only; compiled
    callers validate `d2t` on the host first (`check_d2t`).
    """
    if d2t is None:
        return teacher_logits
    require_single_process(vocab_parallel_group, "vocab_parallel_group")
    if not torch.compiler.is_compiling():
        check_d2t(d2t, teacher_logits.shape[-1])
    target = torch.arange(d2t.shape[0], device=d2t.device, dtype=d2t.dtype) + d2t
    return teacher_logits.index_select(-1, target.to(teacher_logits.device))


def roll_packed_seq_dim(tensor: Tensor, cu_seqlens_padded: Tensor | Sequence[int], seq_dim: int) -> Tensor:
    """Left-shift a packed tensor by one along `seq_dim` within each segment (ref §6.3):
    one global roll, then zero each segment's last physical slot."""
    cu = torch.as_tensor(cu_seqlens_padded, device=tensor.device)
    length = tensor.shape[seq_dim]
    is_last = torch.zeros(length, dtype=torch.bool, device=tensor.device)
    is_last[torch.remainder(cu[1:].long() - 1, length)] = True
    return roll_within_segments(tensor, is_last, seq_dim)


def _pack_input_ids(
    input_ids: Tensor,
    cu_seqlens_q: CpuIntTuple,
    cu_seqlens_q_padded: CpuIntTuple,
    cp_rank: int = 0,
    cp_size: int = 1,
    roll_shift: int = 0,
) -> Tensor:
    """Pack `[B, S]` → `[1, T_padded // cp]` (ref §5.2): each sequence laid into its padded
    length (copying `min(L_i, S)` tokens), rolled by `roll_shift`, CP-sharded."""
    cu, cup = check_cu_seqlens(cu_seqlens_q, cu_seqlens_q_padded)
    rows, width = input_ids.shape[:2]
    if rows != len(cu) - 1:
        raise ValueError(
            f"input_ids must have one row per sequence ({len(cu) - 1}), got {tuple(input_ids.shape)}"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    row, pos = pack_source_index(cup, cp_rank=cp_rank, cp_size=cp_size, roll_shift=roll_shift)
    copied = torch.tensor([min(cu[i + 1] - cu[i], width) for i in range(rows)], dtype=torch.long)
    keep = pos < copied[row]
    row, col = row.to(input_ids.device), torch.where(keep, pos, 0).to(input_ids.device)
    keep = keep.to(input_ids.device)
    out = torch.where(keep, input_ids[row, col], torch.zeros((), dtype=input_ids.dtype, device=input_ids.device))
    return out.unsqueeze(0)


def pack_rolled_draft_token_mask(
    token_mask: Tensor,
    sample_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    cu_seqlens_padded: Tensor | Sequence[int],
) -> Tensor:
    """Packed draft-loss mask `[1, T_packed]` (ref §6.4): `token_mask·sample_mask` laid at
    padded offsets, then shifted left by one within each segment."""
    cu, cup = check_cu_seqlens(cu_seqlens, cu_seqlens_padded, name="cu_seqlens")
    packed = _pack_input_ids(token_mask * sample_mask[:, None], cu, cup)
    return roll_packed_seq_dim(packed, cup, 1)


def _project_hidden_states_per_teacher(
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

    Single process: a context-parallel group must have world size 1.
    """
    require_single_process(context_parallel_group, "context_parallel_group")
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
    pad = local_seq - seq
    if pad < 0:
        raise ValueError(
            f"teacher payload has {seq} positions, more than the student's {local_seq}"
        )
    payload = torch.nn.functional.pad(payload, (0, 0, 0, pad)).contiguous().to(student_logits.device)
    if teacher_payload == "hidden_states":
        if teacher_index is not None:
            payload = _project_hidden_states_per_teacher(
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
