"""The token view: where the tokens of one micro-batch are, for input preparation.

A micro-batch's positions are padded rows `[B, S]` (`RowsView`) or a packed `[1, T]` layout
(`PackedView`, over a `PackedLayout`), each with or without a context-parallel group. Input
preparation runs the vocabulary work on THIS RANK's tokens as flat rows `[N, ...]` and
returns what a loss reads at EVERY position of the batch, `[B, S, ...]`; the view makes the
moves between the two, one name each (`TokenView`):

- `rows(logits)`: this rank's `[N, V]` logit rows (of `LinearLogits`: its hidden states' rows);
- `local(x)`: a per-position `[B, S, ...]` tensor → this rank's `[N, ...]` entries;
- `next_tokens(x)`: the same for each position's successor within its sequence (zero after
  a sequence's last position): next-token targets, shifted masks;
- `next_rows(rows)`: each of this rank's rows' successor row within its sequence (zero after
  the last; fetched from another rank under context parallelism; no gradient);
- `full(y)`: this rank's `[N, ...]` results → every position's `[B, S, ...]` (all-gathered
  over the context-parallel group, whose backward hands each rank `cp ×` its share);
- `unpacked(logits)`: the logits at every position, `[B, S, V]`, for losses that read them whole;
- `local_layout(y)`: `[N, ...]` back in the logits' own layout (`[B, S_local, ...]` or
  `[1, T_local, ...]`), for losses that read this rank's positions in place.

`who` names the seed preparation function of the layout in error messages.

Views are built on the host from static sizes (the batch's row width, the layout's bucket)
and every method traces with no host sync and no data-dependent shape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol, overload

import torch

from compiled_loss.packing.context import ContextShards
from compiled_loss.packing.layout import PackedLayout
from compiled_loss.packing.transforms import roll_within_segments
from compiled_loss.parallel import ParallelGroups, group_size
from compiled_loss.vocab.fused import LinearLogits, per_position

Tensor = torch.Tensor
Logits = Tensor | LinearLogits


class TokenView(Protocol):
    """Where a micro-batch's tokens are (see the module docstring). `width` is the batch's row
    width `S`."""

    @property
    def width(self) -> int: ...
    @property
    def who(self) -> str: ...
    @overload
    def rows(self, logits: Tensor) -> Tensor: ...
    @overload
    def rows(self, logits: LinearLogits) -> LinearLogits: ...
    def rows(self, logits: Logits) -> Logits: ...
    def local(self, x: Tensor) -> Tensor: ...
    def next_tokens(self, x: Tensor) -> Tensor: ...
    def next_rows(self, rows: Tensor) -> Tensor: ...
    def full(self, y: Tensor) -> Tensor: ...
    def unpacked(self, logits: Tensor) -> Tensor: ...
    def local_layout(self, y: Tensor) -> Tensor: ...


def _last_of(length: int, period: int, device: torch.device) -> Tensor:
    """`[length]` bool: the last slot of each run of `period` (a row's last position)."""
    return torch.arange(length, device=device) % period == period - 1


@dataclasses.dataclass(frozen=True)
class RowsView:
    """Padded rows `[B, S]`: this rank's tokens are its rows' positions, flattened. Under
    context parallelism the logits hold `S_local` positions per row: each row is padded to
    `S_pad = S_local · cp` and load-balanced over the ranks in `2·cp` chunks (ref §8.10,
    `shards`)."""

    num_rows: int  # B
    width: int  # S
    padded: int  # S_pad (= S without context parallelism)
    shards: ContextShards | None = None
    who: ClassVar[str] = "prepare_loss_input"

    @staticmethod
    def of(logits: Logits, width: int, parallel: ParallelGroups) -> RowsView:
        """The view of `[B, S(_local), ...]` logits (or `LinearLogits`) over rows of width
        `width`, their positions sharded over `parallel.cp`."""
        cp = group_size(parallel.cp)
        if cp == 1:
            return RowsView(logits.shape[0], width, width)
        padded = logits.shape[1] * cp
        if padded < width:
            raise ValueError(
                f"logits hold {logits.shape[1]} positions per context-parallel rank; {cp} ranks cover {padded}, "
                f"fewer than the {width} positions of input_ids"
            )
        shards = ContextShards.of_rows(logits.shape[0], padded, parallel.cp, logits.device)
        return RowsView(logits.shape[0], width, padded, shards)

    @overload
    def rows(self, logits: Tensor) -> Tensor: ...
    @overload
    def rows(self, logits: LinearLogits) -> LinearLogits: ...
    def rows(self, logits: Logits) -> Logits:
        """`[B, W, V]` logits → this rank's `[N, V]` rows (a view when W == S)."""
        if self.shards is None and logits.shape[1] < self.width:
            raise ValueError(
                f"logits must cover the {self.width} positions of input_ids, got shape {tuple(logits.shape)}"
            )

        def flat(t: Tensor) -> Tensor:
            if self.shards is None and t.shape[1] > self.width:
                t = t[:, : self.width]
            return t.reshape(-1, t.shape[-1])

        return per_position(logits, flat)

    def local(self, x: Tensor) -> Tensor:
        if self.shards is None:
            return x.reshape((-1,) + tuple(x.shape[2:]))
        pad = [0, 0] * (x.dim() - 2) + [0, self.padded - self.width]
        return self.shards.local(torch.nn.functional.pad(x, pad).reshape((-1,) + tuple(x.shape[2:])))

    def next_tokens(self, x: Tensor) -> Tensor:
        return self.local(roll_within_segments(x, _last_of(x.shape[1], x.shape[1], x.device), 1))

    def next_rows(self, rows: Tensor) -> Tensor:
        if self.shards is None:
            return roll_within_segments(rows.detach(), _last_of(rows.shape[0], self.width, rows.device), 0)
        return self.shards.next_rows(rows)

    def full(self, y: Tensor) -> Tensor:
        if self.shards is None:
            return y.reshape((self.num_rows, self.width) + tuple(y.shape[1:]))
        y = self.shards.gather(y)
        return y.reshape((self.num_rows, -1) + tuple(y.shape[1:]))[:, : self.width]

    def unpacked(self, logits: Tensor) -> Tensor:
        """The logits themselves without context parallelism (whatever their width)."""
        return logits if self.shards is None else self.full(self.rows(logits))

    def local_layout(self, y: Tensor) -> Tensor:
        return y.reshape((self.num_rows, -1) + tuple(y.shape[1:]))


@dataclasses.dataclass(frozen=True)
class PackedView:
    """Packed `[1, T]` logits laid out by `layout` (this rank's `T_b / cp` slots under context
    parallelism), holding an unpacked batch of row width `width`."""

    layout: PackedLayout
    width: int
    who: ClassVar[str] = "prepare_packed_loss_input"

    @overload
    def rows(self, logits: Tensor) -> Tensor: ...
    @overload
    def rows(self, logits: LinearLogits) -> LinearLogits: ...
    def rows(self, logits: Logits) -> Logits:
        return per_position(logits, self.layout.slots)

    def local(self, x: Tensor) -> Tensor:
        return self.layout.local(self.layout.pack(x))

    def next_tokens(self, x: Tensor) -> Tensor:
        return self.layout.local(self.layout.roll(self.layout.pack(x)))

    def next_rows(self, rows: Tensor) -> Tensor:
        return self.layout.next_rows(rows)

    def full(self, y: Tensor) -> Tensor:
        return self.layout.unpack(self.layout.gather(y), self.width)

    def unpacked(self, logits: Tensor) -> Tensor:
        return self.full(self.rows(logits))

    def local_layout(self, y: Tensor) -> Tensor:
        return y[None]
