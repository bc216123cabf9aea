"""The parallel room: process groups and the traceable collectives the vocab-parallel and
context-parallel computations use (`collectives`)."""

from compiled_loss.parallel.groups import group_rank, group_size, require_single_process

__all__ = ["group_rank", "group_size", "require_single_process"]
