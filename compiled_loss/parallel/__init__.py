"""The parallel room: process groups (`ParallelGroups`, the one options object that carries
them), the host-side agreement check, and the traceable collectives the vocab-parallel and
context-parallel computations use (`collectives`)."""

from compiled_loss.parallel.groups import ParallelGroups, check_agreement, group_rank, group_size, same_group

__all__ = ["ParallelGroups", "check_agreement", "group_rank", "group_size", "same_group"]
