"""The seed signatures' parallel arguments, converted once at the library's edge:
`vocab_parallel_rank` / `vocab_parallel_group` / `context_parallel_group` into the
`ParallelGroups` everything below takes, and logits (a DTensor too, see
`compiled_loss.vocab.shards`) into this rank's local tensor over them."""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from compiled_loss.parallel import ParallelGroups, group_rank
from compiled_loss.vocab.shards import local_logits


def seed_parallel(
    vocab_parallel_rank: int | None,
    vocab_parallel_group: ProcessGroup | None,
    context_parallel_group: ProcessGroup | None,
) -> ParallelGroups:
    """The groups of the seed signatures' `vocab_parallel_rank` / `vocab_parallel_group` /
    `context_parallel_group` arguments; the rank, passed beside the group, must be the group's."""
    if vocab_parallel_rank is not None and vocab_parallel_rank != group_rank(vocab_parallel_group):
        raise ValueError(
            f"vocab_parallel_rank={vocab_parallel_rank} is not this process's rank "
            f"{group_rank(vocab_parallel_group)} in vocab_parallel_group"
        )
    return ParallelGroups(tp=vocab_parallel_group, cp=context_parallel_group)


def seed_groups(
    logits: Any,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: ProcessGroup | None,
    context_parallel_group: ProcessGroup | None,
    who: str,
) -> tuple[Any, ParallelGroups]:
    """The seed signatures' logits and group arguments converted once: `local_logits` over
    the given groups; `vocab_parallel_rank`, when given, must be this rank's in the
    vocabulary group the logits end up sharded over."""
    parallel = ParallelGroups(tp=vocab_parallel_group, cp=context_parallel_group)
    logits, parallel = local_logits(logits, parallel, who)
    seed_parallel(vocab_parallel_rank, parallel.tp, parallel.cp)
    return logits, parallel
