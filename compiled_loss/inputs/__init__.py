"""The inputs room: logits (unpacked `[B, S, V]` or packed `[1, T, V]`) → what each loss
consumes (ref §5), through the vocab room, plus the teacher side of on-policy distillation.

- `prepare`: `prepare_loss_input`, `prepare_packed_loss_input`,
  `get_next_token_logprobs_from_logits`, `get_distillation_topk_logprobs_from_logits`;
- `teacher`: `reconstruct_opd_full_teacher_logits`, `project_hidden_states_per_teacher`, the data
  keys of the teacher payload;
- `validate`: `validate_batch`, the host-side check of a batch before compiled code, and
  the shape and token-id checks the preparers run on every call;
- `cross_tokenizer`: `align_tokenizations` (student → teacher positions, host side) and the
  DISTILLATION_CROSS_TOKENIZER loss input.
"""

from compiled_loss.inputs.cross_tokenizer import align_tokenizations
from compiled_loss.inputs.prepare import (
    get_distillation_topk_logprobs_from_logits,
    get_next_token_logprobs_from_logits,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from compiled_loss.inputs.teacher import (
    OPD_FULL_TEACHER_INDEX_FIELD,
    OPD_FULL_TEACHER_PAYLOAD_FIELD,
    project_hidden_states_per_teacher,
    reconstruct_opd_full_teacher_logits,
)
from compiled_loss.inputs.validate import validate_batch

__all__ = [
    "OPD_FULL_TEACHER_INDEX_FIELD",
    "OPD_FULL_TEACHER_PAYLOAD_FIELD",
    "align_tokenizations",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "prepare_loss_input",
    "prepare_packed_loss_input",
    "project_hidden_states_per_teacher",
    "reconstruct_opd_full_teacher_logits",
    "validate_batch",
]
