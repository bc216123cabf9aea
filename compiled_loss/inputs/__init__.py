"""The inputs room: logits (unpacked `[B, S, V]` or packed `[1, T, V]`) → what each loss
consumes (ref §5), through the vocab room, plus the teacher side of on-policy distillation.
The seed's shells over it (`prepare_loss_input`, `prepare_packed_loss_input`, the
`get_*_from_logits` functions, `reconstruct_opd_full_teacher_logits`) are in
`compiled_loss.nemo_rl`.

One preparer per input type, each written once against the token view
(`compiled_loss.packing.view`), registered in one table:

- `table`: `PREPARERS` (`LossInputType` → preparer), `prepare_inputs` (the checks, then the
  table), `Preparation` (the form the micro-batch entry point calls);
- `options`: `PrepareOptions`, what a preparation is given besides the loss's `InputSpec`;
- `logit`, `logprob`, `topk`, `draft`, `opd_full`, `cross_tokenizer`: the preparers (LOGIT,
  LOGPROB, DISTILLATION, DRAFT, OPD_FULL, DISTILLATION_CROSS_TOKENIZER), and
  `align_tokenizations` (student → teacher positions, host side);
- `teacher`: `teacher_logits` (a rank's teacher shard from the payload),
  `project_hidden_states_per_teacher`, the data keys of the teacher payload;
- `validate`: `validate_batch`, the host-side check of a batch before compiled code, and
  the shape and token-id checks every preparation runs.
"""

from compiled_loss.edge import edge_attribute
from compiled_loss.inputs.cross_tokenizer import align_tokenizations
from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.inputs.table import PREPARERS, Preparation, prepare_inputs
from compiled_loss.inputs.teacher import (
    OPD_FULL_TEACHER_INDEX_FIELD,
    OPD_FULL_TEACHER_PAYLOAD_FIELD,
    project_hidden_states_per_teacher,
)
from compiled_loss.inputs.validate import validate_batch

# names with the seed's signatures, exported here and defined in the edge room (`compiled_loss.edge`)
_EDGE = {
    "prepare_loss_input": "loss_input",
    "prepare_packed_loss_input": "loss_input",
    "get_next_token_logprobs_from_logits": "loss_input",
    "get_distillation_topk_logprobs_from_logits": "loss_input",
    "reconstruct_opd_full_teacher_logits": "utils",
}


def __getattr__(name: str) -> object:
    return edge_attribute(__name__, name, _EDGE)


__all__ = [
    "OPD_FULL_TEACHER_INDEX_FIELD",
    "OPD_FULL_TEACHER_PAYLOAD_FIELD",
    "PREPARERS",
    "Preparation",
    "PrepareOptions",
    "align_tokenizations",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "prepare_inputs",
    "prepare_loss_input",
    "prepare_packed_loss_input",
    "project_hidden_states_per_teacher",
    "reconstruct_opd_full_teacher_logits",
    "validate_batch",
]
