"""The draft→target vocabulary map of a drafter (`d2t`, ref §6.2).

Draft index `i` stands for target token `i + d2t[i]`. A `DraftVocab` is that map checked
once on the host (one device sync when it is built); mapping teacher logits through it
needs no sync, so compiled callers and per-micro-batch callers build it once.
"""

from __future__ import annotations

import dataclasses

import torch

from compiled_loss.parallel import ParallelGroups, check_agreement, group_rank, group_size
from compiled_loss.parallel.collectives import all_gather
from compiled_loss.vocab.fused import LinearLogits

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


def draft_vocab_logits(
    teacher_logits: Tensor | LinearLogits,
    d2t: Tensor | DraftVocab | None,
    parallel: ParallelGroups = ParallelGroups(),
    who: str = "draft_vocab_logits",
) -> Tensor:
    """Restrict full-vocab teacher logits `[..., V]` to the draft vocabulary via `d2t`
    (draft index `i` → target id `i + d2t[i]`); no-op when `d2t` is None (ref §6.2).

    Under tensor parallelism (`parallel.tp`) the teacher arrives vocab-sharded
    `[..., V / tp]`: it is all-gathered to the full vocabulary and this rank's contiguous
    slice of the draft vocabulary is returned `[..., V_draft / tp]` (the draft head is
    sharded the same way). Pass a `DraftVocab` (checked once) to map without a device sync;
    a raw `d2t` tensor is checked on every eager call (one sync) and not under torch.compile.
    `LinearLogits` (an LM head's factors) give the same logits from the draft vocabulary's
    rows of the head alone (its weight shards all-gathered under TP): no `[..., V]` logits.
    An eager call under TP first checks that every rank holds an equally wide shard of the
    same shape and dtype (a ValueError on every rank, naming `who`, otherwise).
    """
    if d2t is None:
        return teacher_logits.logits() if isinstance(teacher_logits, LinearLogits) else teacher_logits
    group = parallel.tp
    shards = group_size(group)
    check_agreement(
        f"{who}'s inputs (each rank's teacher_logits are its vocabulary shard "
        "[..., V / tp]: equally wide, with the same shape and dtype on every rank)",
        {"teacher_logits.weight": teacher_logits.weight, "teacher_logits.bias": teacher_logits.bias}
        if isinstance(teacher_logits, LinearLogits)
        else {"teacher_logits": teacher_logits},
        group,
    )
    if isinstance(teacher_logits, LinearLogits):
        if shards > 1:  # the whole head
            bias = teacher_logits.bias
            teacher_logits = dataclasses.replace(
                teacher_logits,
                weight=all_gather(teacher_logits.weight, group).flatten(0, 1),
                bias=None if bias is None else all_gather(bias, group).flatten(0, 1),
            )
        vocab = teacher_logits.weight.shape[0]
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
    if isinstance(teacher_logits, LinearLogits):
        bias = teacher_logits.bias
        return teacher_logits.linear(teacher_logits.weight[target], None if bias is None else bias[target])
    return teacher_logits.index_select(-1, target)
