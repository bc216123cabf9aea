"""Seed API `nemo_rl.algorithms.loss.utils` (ref §5.2, §6): the seed's names, re-exported
from the rooms that hold them.

The layout helpers that take boundaries as `CpuIntTuple`s are host-side utilities (they
build index tensors from Python ints); compiled paths use `PackedLayout` instead.
"""

from compiled_loss.inputs.teacher import (
    OPD_FULL_TEACHER_INDEX_FIELD,
    OPD_FULL_TEACHER_PAYLOAD_FIELD,
    reconstruct_opd_full_teacher_logits,
)
from compiled_loss.inputs.teacher import project_hidden_states_per_teacher as _project_hidden_states_per_teacher
from compiled_loss.metrics import rescale_loss_metrics
from compiled_loss.packing import CpuIntTuple, pack_rolled_draft_token_mask, roll_packed_seq_dim, to_cpu_int_tuple
from compiled_loss.packing import pack_input_ids as _pack_input_ids
from compiled_loss.vocab import map_teacher_logits_to_draft_vocab

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
