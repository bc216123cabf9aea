"""Context parallelism: one rank's share of a sequence layout (ref §8.11, §9.2).

Every sequence (a packed segment, or an unpacked row) of padded length `P` — a multiple
of `2·cp` — is cut into `2·cp` chunks of `c = P / (2·cp)` slots; rank `r` holds chunks `r`
and `2cp-1-r`, in that order (the load-balanced layout of Megatron and NeMo-RL). A
`ContextShards` maps this rank's local slots to the full layout's ("global") slots:

- `local(x)`: the local slots' entries of a global tensor (targets, masks, indices);
- `gather(y)`: every rank's per-slot results, all-gathered and put back in global order
  — the backward is a SUM all-reduce then this rank's slots (`gather_context_parallel`);
- `next_rows(rows)`: each local slot's successor row within its sequence (zero after the
  last slot), fetching the few rows that live on another rank (chunk heads): the
  next-token shift of the draft teacher.

Maps for packed segments are built on the host from the boundaries; maps for `B` uniform
rows are closed-form index arithmetic, so they trace with static shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from compiled_loss.parallel import check_agreement, group_rank, group_size
from compiled_loss.parallel.collectives import all_gather, gather_context_parallel

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class ContextShards:
    """This rank's slots of a context-parallel layout (see the module docstring).

    `local_to_global` `[T/cp]`: the global slot of each local slot; `gather_index` `[T]`:
    where each global slot sits in the rank-major all-gather `[cp · T/cp]`; `heads` `[H]`:
    the local slots that start a chunk (2 per sequence); `successor` `[T/cp]`: for each local
    slot, where its successor's row is in `cat(local rows, all-gathered heads, a zero row)`.
    """

    group: ProcessGroup | None
    size: int
    rank: int
    local_to_global: Tensor
    gather_index: Tensor
    heads: Tensor
    successor: Tensor

    @property
    def local_slots(self) -> int:
        return self.local_to_global.shape[0]

    def to(self, device: torch.device | str) -> ContextShards:
        return dataclasses.replace(
            self, **{f: getattr(self, f).to(device) for f in ("local_to_global", "gather_index", "heads", "successor")}
        )

    def local(self, x: Tensor) -> Tensor:
        """The local slots' entries of a global `[T, ...]` tensor."""
        return x.index_select(0, self.local_to_global)

    def gather(self, y: Tensor) -> Tensor:
        """Per-local-slot results `[T/cp, ...]` of every rank → global order `[T, ...]`."""
        gathered = gather_context_parallel(y, self.group)
        return gathered.reshape((-1,) + tuple(y.shape[1:])).index_select(0, self.gather_index)

    def next_rows(self, rows: Tensor) -> Tensor:
        """Each local slot's successor row `[T/cp, ...]` within its sequence (no gradient)."""
        rows = rows.detach()
        heads = all_gather(rows.index_select(0, self.heads), self.group).flatten(0, 1)
        zero = rows.new_zeros((1,) + tuple(rows.shape[1:]))
        return torch.cat([rows, heads, zero]).index_select(0, self.successor)

    # ---- builders ----------------------------------------------------------------------

    @staticmethod
    def of_segments(
        starts: Sequence[int], lengths: Sequence[int], slots: int, group: ProcessGroup | None
    ) -> ContextShards:
        """Host side: segments `[starts[i], starts[i] + lengths[i])` of a `slots`-long packed
        layout (lengths multiples of 2·cp); slots after the last segment (the bucket tail,
        a multiple of cp) are split evenly and have no successor. Every rank of the group must
        pass the same layout (checked, a ValueError on every rank otherwise)."""
        check_agreement(
            "the context-parallel layout (segment starts, padded lengths, slots)",
            (tuple(starts), tuple(lengths), slots),
            group,
        )
        cp, rank = group_size(group), group_rank(group)
        total = sum(lengths)
        bad = [i for i, n in enumerate(lengths) if n % (2 * cp)]
        if bad:
            raise ValueError(
                f"with context parallel size {cp} every padded sequence length must be a multiple of "
                f"2*cp={2 * cp}; sequences {bad} have padded lengths {[lengths[i] for i in bad]}"
            )
        if (slots - total) % cp:
            raise ValueError(f"the {slots - total} bucket tail slots must split evenly over {cp} context ranks")
        seg_len = torch.tensor(list(lengths) + [slots - total], dtype=torch.long)
        seg_start = torch.tensor(list(starts) + [total], dtype=torch.long)
        tail = len(lengths)
        seg = torch.repeat_interleave(torch.arange(tail + 1), seg_len)  # segment of each global slot
        pos = torch.arange(slots) - seg_start[seg]
        return _shards(seg, pos, seg_len, seg_start, tail, cp, rank, group)

    @staticmethod
    def of_rows(
        rows: int, width: int, group: ProcessGroup | None, device: torch.device | str | None = None
    ) -> ContextShards:
        """`rows` sequences of `width` slots each (a multiple of 2·cp): the unpacked layout
        `[B, S_pad]` flattened. Index arithmetic only (traceable, static shapes). Every rank of
        the group must pass the same rows and width: checked in eager mode (a ValueError on
        every rank otherwise); compiled callers check on the host."""
        check_agreement(
            "the context-parallel layout of unpacked rows (rows B, padded width cp · S_local)", (rows, width), group
        )
        cp, rank = group_size(group), group_rank(group)
        if width % (2 * cp):
            raise ValueError(
                f"with context parallel size {cp} the padded row width must be a multiple of 2*cp={2 * cp}, got {width}"
            )
        slot = torch.arange(rows * width, device=device)
        seg = slot // width
        seg_len = torch.full((rows + 1,), width, dtype=torch.long, device=device)
        seg_len[-1] = 0  # no tail
        seg_start = torch.arange(rows + 1, device=device) * width
        return _shards(seg, slot - seg * width, seg_len, seg_start, rows, cp, rank, group)


def _shards(
    seg: Tensor,
    pos: Tensor,
    seg_len: Tensor,
    seg_start: Tensor,
    tail: int,
    cp: int,
    rank: int,
    group: ProcessGroup | None,
) -> ContextShards:
    """The maps, from each global slot's segment (`tail` = the tail's id) and position."""
    slots = seg.shape[0]
    local_slots = slots // cp
    chunk = torch.where(seg == tail, seg_len[seg] // cp, seg_len[seg] // (2 * cp))  # tail: cp chunks
    q = pos // chunk.clamp(min=1)
    owner = torch.where(seg == tail, q, torch.where(q < cp, q, 2 * cp - 1 - q))
    local = seg_start[seg] // cp + torch.where((seg != tail) & (q >= cp), chunk, 0) + pos % chunk.clamp(min=1)
    gather_index = owner * local_slots + local
    # local -> global: the slots this rank owns, by local position
    mine = torch.where(owner == rank, local, local_slots)  # others go to a scratch slot
    local_to_global = torch.zeros(local_slots + 1, dtype=torch.long, device=seg.device)
    local_to_global = local_to_global.scatter(0, mine, torch.arange(slots, device=seg.device))[:local_slots]
    # heads: 2 per sequence (its two chunks' first local slots), the same count on every rank
    seq_local_start = seg_start[:tail] // cp
    seq_chunk = seg_len[:tail] // (2 * cp)
    heads = torch.stack([seq_local_start, seq_local_start + seq_chunk], -1).flatten().clamp(max=max(local_slots - 1, 0))
    # successor of each global slot: the next slot of its segment, if any
    nxt = pos + 1
    has_next = (seg != tail) & (nxt < seg_len[seg])
    nq = nxt // chunk.clamp(min=1)
    n_owner = torch.where(nq < cp, nq, 2 * cp - 1 - nq)
    same_rank_local = local + 1  # within a chunk the successor is the next local slot
    head_id = 2 * seg + (nq >= cp).long()  # which head of the owner holds it
    crosses = nq != q
    n_heads = 2 * tail
    to_head = local_slots + n_owner * n_heads + head_id
    successor_global = torch.where(has_next, torch.where(crosses, to_head, same_rank_local), local_slots + cp * n_heads)
    successor = successor_global.index_select(0, local_to_global)
    return ContextShards(group, cp, rank, local_to_global, gather_index, heads, successor)
