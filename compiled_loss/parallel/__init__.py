"""The parallel room: process groups and the traceable collectives the vocab-parallel and
context-parallel computations use (`collectives`)."""

from compiled_loss.parallel.groups import check_agreement, group_rank, group_size

__all__ = ["check_agreement", "group_rank", "group_size"]
