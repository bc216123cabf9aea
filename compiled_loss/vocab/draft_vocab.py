"""The draft→target vocabulary map of a drafter (`d2t`, ref §6.2).

Draft index `i` stands for target token `i + d2t[i]`. A `DraftVocab` is that map checked
once on the host (one device sync when it is built); mapping teacher logits through it
needs no sync, so compiled callers and per-micro-batch callers build it once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from compiled_loss.parallel import check_agreement, group_rank, group_size
from compiled_loss.parallel.collectives import all_gather
from compiled_loss.vocab.fused import LinearLogits
from compiled_loss.vocab.shards import seed_groups

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    """A validated `d2t`: `target_ids[i] = i + d2t[i]` (long, on d2t's device), and the
    smallest / largest target id as Python ints."""

    d2t: Tensor
    target_ids: Tensor
    min_target: int
    max_target: int

    @staticmethod
    def build(d2t: Tensor) -> DraftVocab:
        """Check `d2t` (1-D, integer, non-empty) and read its target range (host side)."""
        if not isinstance(d2t, Tensor) or d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(
                f"d2t must be a 1-D integer tensor, got "
                f"{f'{d2t.dtype} {tuple(d2t.shape)}' if isinstance(d2t, Tensor) else type(d2t).__name__}"
            )
        if d2t.numel() == 0:
            raise ValueError("d2t must map at least one draft index, got an empty tensor")
        target = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
        lo, hi = torch.stack([target.min(), target.max()]).tolist()  # host
        return DraftVocab(d2t, target, lo, hi)

    @property
    def size(self) -> int:
        """Draft vocabulary size."""
        return self.target_ids.shape[0]

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every target id lies in `[0, vocab_size)` (host ints, no sync
        unless it fails)."""
        if self.min_target >= 0 and self.max_target < vocab_size:
            return
        target = self.target_ids.tolist()  # host: only on the error path
        bad = [i for i, t in enumerate(target) if not 0 <= t < vocab_size]
        raise ValueError(
            f"d2t maps draft index {bad[0]} to target id {target[bad[0]]} outside the target "
            f"vocabulary [0, {vocab_size}) ({len(bad)} such entries)"
        )


def map_teacher_logits_to_draft_vocab(
    teacher_logits: Tensor | LinearLogits,
    d2t: Tensor | DraftVocab | None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
) -> Tensor:
    """Restrict full-vocab teacher logits `[..., V]` to the draft vocabulary via `d2t`
    (draft index `i` → target id `i + d2t[i]`); no-op when `d2t` is None (ref §6.2).

    Under tensor parallelism (`vocab_parallel_group`, or a DTensor sharded on the vocabulary:
    `compiled_loss.vocab.shards`) the teacher arrives vocab-sharded `[..., V / tp]`: it is
    all-gathered to the full vocabulary and this rank's contiguous slice of the draft
    vocabulary is returned `[..., V_draft / tp]` (the draft head is
    sharded the same way). Pass a `DraftVocab` (checked once) to map without a device sync;
    a raw `d2t` tensor is checked on every eager call (one sync) and not under torch.compile.
    `LinearLogits` (an LM head's factors) give the same logits from the draft vocabulary's
    rows of the head alone (its weight shards all-gathered under TP): no `[..., V]` logits.
    An eager call under TP first checks that every rank holds an equally wide shard of the
    same shape and dtype (a ValueError on every rank otherwise).
    """
    teacher_logits, parallel = seed_groups(
        teacher_logits, vocab_parallel_rank, vocab_parallel_group, None, "map_teacher_logits_to_draft_vocab"
    )
    linear = isinstance(teacher_logits, LinearLogits)
    if d2t is None:
        return teacher_logits.logits() if linear else teacher_logits
    group = parallel.tp
    shards = group_size(group)
    check_agreement(
        "map_teacher_logits_to_draft_vocab's inputs (each rank's teacher_logits are its vocabulary shard "
        "[..., V / tp]: equally wide, with the same shape and dtype on every rank)",
        {"teacher_logits.weight": teacher_logits.weight, "teacher_logits.bias": teacher_logits.bias}
        if linear
        else {"teacher_logits": teacher_logits},
        group,
    )
    if linear:
        weight, bias = teacher_logits.weight, teacher_logits.bias
        if shards > 1:
            weight = all_gather(weight, group).flatten(0, 1)
            bias = None if bias is None else all_gather(bias, group).flatten(0, 1)
        vocab = weight.shape[0]
    else:
        if shards > 1:
            gathered = all_gather(teacher_logits, group)  # [tp, ..., V / tp]
            teacher_logits = gathered.movedim(0, -2).reshape(teacher_logits.shape[:-1] + (-1,))
        vocab = teacher_logits.shape[-1]
    if isinstance(d2t, Tensor) and torch.compiler.is_compiling():
        target = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
    else:
        draft_vocab = d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t)
        draft_vocab.check_vocab(vocab)
        target = draft_vocab.target_ids
    if shards > 1:
        if target.shape[0] % shards:
            raise ValueError(
                f"the draft vocabulary ({target.shape[0]} ids) must divide evenly over the {shards} "
                "tensor-parallel ranks"
            )
        local = target.shape[0] // shards
        rank = group_rank(group)
        target = target[rank * local : (rank + 1) * local]
    target = target.to(teacher_logits.device)
    if linear:
        bias = None if bias is None else bias[target]
        return teacher_logits.linear(weight[target], bias)
    return teacher_logits.index_select(-1, target)
