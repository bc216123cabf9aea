"""The draft room: co-trained drafters next to the policy loss — the runtime protocol and
the draft soft-CE paths of the seed's draft wrappers."""

from compiled_loss.draft.loss import draft_soft_ce, packed_draft_soft_ce, with_draft_loss
from compiled_loss.draft.runtime import DraftRuntime

__all__ = ["DraftRuntime", "draft_soft_ce", "packed_draft_soft_ce", "with_draft_loss"]
