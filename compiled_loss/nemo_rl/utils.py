"""Seed API `nemo_rl.algorithms.loss.utils` (ref §5.2, §6): the seed's names, re-exported
from the rooms that hold them, and those with the seed's group arguments —
`map_teacher_logits_to_draft_vocab` and `reconstruct_opd_full_teacher_logits` — converted
here into the library's.

The layout helpers that take boundaries as `CpuIntTuple`s are host-side utilities (they
build index tensors from Python ints); compiled paths use `PackedLayout` instead.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import ProcessGroup

from compiled_loss.inputs.teacher import (
    OPD_FULL_TEACHER_INDEX_FIELD,
    OPD_FULL_TEACHER_PAYLOAD_FIELD,
    check_heads,
    teacher_logits,
)
from compiled_loss.inputs.teacher import project_hidden_states_per_teacher as _project_hidden_states_per_teacher
from compiled_loss.metrics import rescale_loss_metrics
from compiled_loss.nemo_rl.groups import seed_groups
from compiled_loss.packing import CpuIntTuple, pack_rolled_draft_token_mask, roll_packed_seq_dim, to_cpu_int_tuple
from compiled_loss.packing import pack_input_ids as _pack_input_ids
from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel import group_size
from compiled_loss.vocab import DraftVocab, LinearLogits, draft_vocab_logits

Tensor = torch.Tensor

__all__ = [
    "OPD_FULL_TEACHER_INDEX_FIELD",
    "OPD_FULL_TEACHER_PAYLOAD_FIELD",
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


def map_teacher_logits_to_draft_vocab(
    teacher_logits: Tensor | LinearLogits,
    d2t: Tensor | DraftVocab | None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
) -> Tensor:
    """Restrict full-vocab teacher logits `[..., V]` to the draft vocabulary via `d2t`
    (ref §6.2): `draft_vocab_logits` over `vocab_parallel_group` (or the vocabulary mesh
    group of a DTensor sharded on the vocabulary: `compiled_loss.vocab.shards`)."""
    teacher_logits, parallel = seed_groups(
        teacher_logits, vocab_parallel_rank, vocab_parallel_group, None, "map_teacher_logits_to_draft_vocab"
    )
    return draft_vocab_logits(teacher_logits, d2t, parallel, "map_teacher_logits_to_draft_vocab")


def reconstruct_opd_full_teacher_logits(
    payload: Tensor,
    *,
    teacher_payload: str,
    student_logits: Tensor,
    vocab_parallel_rank: int | None,
    context_parallel_group: ProcessGroup | None,
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
    if teacher_payload == "logits" and vocab_parallel_rank is None:
        raise ValueError("teacher_payload='logits' requires vocab_parallel_rank")
    to_logits = functools.partial(
        teacher_logits,
        teacher_payload=teacher_payload,
        tp_rank=vocab_parallel_rank or 0,  # read for logits payloads only, where it is given (checked above)
        local_vocab=local_vocab,
        teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
    )
    if teacher_payload == "hidden_states":
        check_heads(teacher_output_layer_weight_by_index or {}, width)
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
