"""The draft room: co-trained drafters next to the policy loss — the runtime protocol and
the draft soft-CE paths of the seed's draft wrappers."""

from compiled_loss.draft.loss import DraftStepState, draft_soft_ce, packed_draft_soft_ce, with_draft_loss
from compiled_loss.draft.runtime import (
    DraftBatch,
    DraftRuntime,
    DraftRuntimeBase,
    anchor_noise,
    anchor_seed,
    aux_hidden_states,
    aux_layers_default,
)

__all__ = [
    "DraftBatch",
    "DraftRuntime",
    "DraftRuntimeBase",
    "DraftStepState",
    "anchor_noise",
    "anchor_seed",
    "aux_hidden_states",
    "aux_layers_default",
    "draft_soft_ce",
    "packed_draft_soft_ce",
    "with_draft_loss",
]
