"""Host-side packed-sequence layout with bucketed shapes (DESIGN principle 4).

Sequence boundaries arrive as `CpuIntTuple`s. `PackedLayout.build` validates them and turns
them, once per micro-batch and on the host, into small index tensors whose shapes depend
only on the bucket (packed tokens `T_b`, rows `B_b`), never on the boundary values;
`pad_to_bucket` pads the unpacked data to `[B_b, S_b]`. Compiled code only sees those
tensors, so it compiles once per bucket.

Conventions (NeMo-RL / Megatron, ref §5.2, §9.2, §13.2):
- packed segment `i` occupies physical slots `[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`;
- its first `min(L_i, S)` slots hold row `i` of the unpacked `[B, S]` data, where
  `L_i = cu_seqlens[i+1] - cu_seqlens[i]` may exceed the row width `S` (bin-alignment
  padding absorbed into the last sequence), hence the clamp;
- every other slot (per-sequence padding, the bucket tail) is padding: masked, zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from compiled_loss.packing.boundaries import check_cu_seqlens
from compiled_loss.packing.context import ContextShards
from compiled_loss.packing.transforms import pack_source_index, roll_within_segments
from compiled_loss.parallel import ParallelGroups, group_size

Tensor = torch.Tensor


def round_to_bucket(n: int, multiple: int, per_octave: int = 0) -> int:
    """Round `n` up to the bucket grid.

    `multiple` is the grid step; with `per_octave > 0` the step also grows with `n` so that
    each power-of-two octave holds at most `per_octave` buckets (bounded compiles for any
    range of sizes, at most `1/per_octave` padding waste).
    """
    step = _bucket_step(n, multiple, per_octave)
    return -(-max(n, 1) // step) * step


def _bucket_step(n: int, multiple: int, per_octave: int) -> int:
    """The grid step at `n` (`round_to_bucket`)."""
    if per_octave > 0 and n > 1:
        octave_start = 1 << ((n - 1).bit_length() - 1)
        return max(multiple, -(-octave_start // per_octave // multiple) * multiple)
    return multiple


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    """Bucket grid for the three shapes compiled code specialises on.

    `tokens`, `rows`, `width`: grid steps for packed tokens, number of sequences and row
    width (1 = exact shapes). `per_octave`: see `round_to_bucket`.
    """

    tokens: int = 1
    rows: int = 1
    width: int = 1
    per_octave: int = 0

    def __post_init__(self) -> None:
        for field in ("tokens", "rows", "width"):
            if getattr(self, field) < 1:
                raise ValueError(f"BucketGrid.{field} must be >= 1, got {getattr(self, field)}")
        if self.rows > 1 and self.rows % 2:
            raise ValueError(
                f"BucketGrid.rows must be 1 or even (padding rows must keep chosen/rejected "
                f"pairs aligned), got {self.rows}"
            )
        if self.per_octave < 0:
            raise ValueError(f"BucketGrid.per_octave must be >= 0, got {self.per_octave}")

    def bound(self, max_rows: int, max_length: int, *, packed: bool, pad_to_multiple: int = 1) -> int:
        """The most distinct shape buckets micro-batches of at most `max_rows` rows of at most
        `max_length` tokens can fall into: row buckets × width buckets, × packed-token buckets
        (each sequence padded to `pad_to_multiple`) for packed layouts. One compile per
        bucket needs that many graphs of the compiled function."""
        count = _distinct_buckets(max_rows, self.rows, self.per_octave)
        count *= _distinct_buckets(max_length, self.width, self.per_octave)
        if packed:
            longest = -(-max_length // pad_to_multiple) * pad_to_multiple
            count *= _distinct_buckets(max_rows * longest, self.tokens, self.per_octave)
        return count


def _distinct_buckets(limit: int, multiple: int, per_octave: int) -> int:
    """How many distinct values `round_to_bucket(n, multiple, per_octave)` takes for n in 1..limit."""
    if per_octave == 0:
        return -(-max(limit, 1) // multiple)
    values, start = {multiple}, 2  # n = 1 rounds to `multiple`
    while start <= limit:  # one step for every n in (start - 1, 2·(start - 1)]: n - 1 in one octave
        end = min(2 * start - 2, limit)
        step = _bucket_step(start, multiple, per_octave)
        values.update(range(-(-start // step) * step, -(-end // step) * step + 1, step))
        start = end + 1
    return len(values)


def row_width(data: Mapping[str, Tensor]) -> int:
    """The unpacked row width `S`: dimension 1 of `input_ids` (or `token_mask`)."""
    for key in ("input_ids", "token_mask"):
        if key in data:
            return data[key].shape[1]
    raise ValueError(
        f"data must hold 'input_ids' or 'token_mask' ([B, S]) to give the row width; present: {sorted(data)}"
    )


def pad_to_bucket(data: Mapping[str, Tensor], rows: int, num_rows: int, grid: BucketGrid) -> dict[str, Tensor]:
    """Zero-pad every batch tensor from `[rows, S, ...]` to the bucket `[num_rows, S_b, ...]`.

    Dimension 0 is the batch dimension of every tensor (as in NeMo-RL's
    BatchedDataDict); dimension 1 is padded when it equals the row width `S`. Padding
    rows get `sample_mask = 0` and `token_mask = 0`, so they contribute nothing (with
    `pair_index` / `is_chosen` they form pairs of their own). Data
    already in bucket shape is returned as is, so calling this inside a compiled region
    on bucket-shaped data adds nothing to the graph.
    """
    width = row_width(data)
    padded_width = round_to_bucket(width, grid.width, grid.per_octave)
    out: dict[str, Tensor] = {}
    for key, value in data.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = value
            continue
        pad = [0, 0] * value.dim()
        if value.shape[0] != num_rows:
            if value.shape[0] != rows:
                raise ValueError(
                    f"data[{key!r}] must have {rows} rows (one per packed sequence), got shape {tuple(value.shape)}"
                )
            pad[-1] = num_rows - rows
        if value.dim() >= 2 and value.shape[1] == width:
            pad[-3] = padded_width - width
        out[key] = torch.nn.functional.pad(value, pad) if any(pad) else value
        if key in _PAIR_KEYS and value.shape[0] == rows < num_rows:
            out[key] = torch.cat([value, _PAIR_KEYS[key](num_rows - rows).to(value)])
    return out


# Preference data may name its pairs (ref §4.3): bucket padding rows then form pairs of
# their own — (chosen, rejected) with negative pair indices, distinct from every real pair.
_PAIR_KEYS = {
    "is_chosen": lambda n: (torch.arange(n) % 2 == 0).long(),
    "pair_index": lambda n: -1 - torch.arange(n) // 2,
}


@dataclasses.dataclass(frozen=True, eq=False)
class PackedLayout:
    """Index tensors for one micro-batch's packing, shaped by its bucket.

    Static sizes, constant within a bucket: `num_rows` (B_b) and `tokens` (T_b).
    Tensors: per packed slot `slot_row` / `slot_col` (row and position in its padded
    sequence; bucket-tail slots get position `T_b`, i.e. never a real token) and
    `slot_last` (last physical slot of a segment, or bucket tail); per row `row_start`
    (first packed slot) and `row_len` (true length `L_i`, 0 for padding rows).
    The row width `S` is not part of the layout: it is read from the data's static
    shape, and the `min(L_i, S)` clamp (ref §5.2) happens in traced code.
    `rows` (the true B) and `grid` are read only by the host-side `pad_data`.

    With a context-parallel group (`shards`), the per-slot tensors still describe the
    whole packing, the logits hold this rank's `T_b / cp` slots, and `local` / `gather` /
    `next_rows` move per-slot tensors between the two (`ContextShards`).
    """

    num_rows: int
    tokens: int
    slot_row: Tensor
    slot_col: Tensor
    slot_last: Tensor
    row_start: Tensor
    row_len: Tensor
    rows: int
    grid: BucketGrid
    shards: ContextShards | None = None

    @staticmethod
    def build(
        cu_seqlens: Tensor | Sequence[int],
        cu_seqlens_padded: Tensor | Sequence[int] | None = None,
        *,
        grid: BucketGrid = BucketGrid(),
        device: torch.device | str | None = None,
        parallel: ParallelGroups = ParallelGroups(),
    ) -> PackedLayout:
        """Validate the boundaries and build the bucketed index tensors (host side). With a
        context-parallel group `parallel.cp` of size cp, every padded length must be a multiple of 2·cp and
        the bucketed length is rounded up to a multiple of cp."""
        cu, cup = check_cu_seqlens(cu_seqlens, cu_seqlens_padded)
        n_seq, total = len(cu) - 1, cup[-1]
        cp = group_size(parallel.cp)
        num_rows = round_to_bucket(n_seq, grid.rows, grid.per_octave)
        tokens = -(-round_to_bucket(total, grid.tokens, grid.per_octave) // cp) * cp
        row, pos = pack_source_index(cup)
        tail = tokens - total
        ends = torch.tensor(cup[1:], dtype=torch.long) - 1
        last = torch.zeros(total, dtype=torch.bool)
        last[ends[ends >= 0]] = True
        pad_rows = num_rows - n_seq
        lengths = [cu[i + 1] - cu[i] for i in range(n_seq)]
        tensors = dict(
            slot_row=torch.cat([row, torch.zeros(tail, dtype=torch.long)]),
            slot_col=torch.cat([pos, torch.full((tail,), tokens, dtype=torch.long)]),
            slot_last=torch.cat([last, torch.ones(tail, dtype=torch.bool)]),
            row_start=torch.tensor(list(cup[:-1]) + [0] * pad_rows, dtype=torch.long),
            row_len=torch.tensor(lengths + [0] * pad_rows, dtype=torch.long),
        )
        shards = None
        if cp > 1:
            padded = [cup[i + 1] - cup[i] for i in range(n_seq)]
            shards = ContextShards.of_segments(cup[:-1], padded, tokens, parallel.cp).to(device or "cpu")
        return PackedLayout(
            num_rows=num_rows,
            tokens=tokens,
            rows=n_seq,
            grid=grid,
            shards=shards,
            **{k: v.to(device) for k, v in tensors.items()},
        )

    _copies: dict[torch.device, PackedLayout] = dataclasses.field(default_factory=dict, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.row_len.device

    def on(self, device: torch.device) -> PackedLayout:
        """This layout with its index tensors on `device`. Eager calls copy once per device
        and keep the copy; under torch.compile the copy is part of the graph (build the
        layout on its device, `build(..., device=)`, to have none)."""
        if self.device == device:
            return self
        if torch.compiler.is_compiling():
            return self.to(device)
        if device not in self._copies:
            self._copies[device] = self.to(device)
        return self._copies[device]

    def to(self, device: torch.device | str) -> PackedLayout:
        """The same layout with its index tensors on `device`."""
        return dataclasses.replace(
            self,
            shards=None if self.shards is None else self.shards.to(device),
            **{f: getattr(self, f).to(device) for f in ("slot_row", "slot_col", "slot_last", "row_start", "row_len")},
        )

    # ---- host side -------------------------------------------------------------------

    def pad_data(self, data: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`pad_to_bucket` for this layout's rows (a no-op on bucket-shaped data)."""
        return pad_to_bucket(data, self.rows, self.num_rows, self.grid)

    # ---- traceable -------------------------------------------------------------------

    @property
    def local_tokens(self) -> int:
        """Slots of this rank's packed logits: `T_b`, or `T_b / cp` under context parallelism."""
        return self.tokens if self.shards is None else self.shards.local_slots

    def slots(self, packed: Tensor, name: str = "logits") -> Tensor:
        """A packed `[1, T, ...]` tensor (T >= the local bucketed length) as its slots.

        A view: squeezing and (only when T is longer) slicing, so eager autograd allocates no
        logits-sized zero buffer for the backward of a select or a full-width slice.
        """
        n = self.local_tokens
        if packed.dim() < 2 or packed.shape[0] != 1 or packed.shape[1] < n:
            what = "the bucketed packed length" if self.shards is None else "this context-parallel rank's slots"
            raise ValueError(
                f"{name} must be packed as [1, T, ...] with T >= {n} ({what}), got shape {tuple(packed.shape)}"
            )
        rows = packed.squeeze(0)
        return rows if rows.shape[0] == n else rows[:n]

    def local(self, x: Tensor) -> Tensor:
        """This rank's slots of a per-slot `[T_b, ...]` tensor (all of them without CP)."""
        return x if self.shards is None else self.shards.local(x)

    def gather(self, y: Tensor) -> Tensor:
        """Per-local-slot results → all `[T_b, ...]` slots (identity without CP)."""
        return y if self.shards is None else self.shards.gather(y)

    def next_rows(self, rows: Tensor) -> Tensor:
        """Each local slot's successor within its segment (zero after a segment's last slot
        and in the tail): a per-segment `roll(-1)`, across ranks under CP. No gradient."""
        return self.roll(rows.detach()) if self.shards is None else self.shards.next_rows(rows)

    def valid_mask(self, width: int) -> Tensor:
        """`[B_b, width]` bool: column `j` of row `b` holds a real token (`j < L_b`)."""
        cols = torch.arange(width, device=self.device)
        return cols[None, :] < self.row_len[:, None]

    def truncate(self, data: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Zero every `[B, w, ...]` tensor (w > 1, or w = S) past each row's length.

        The vectorised equivalent of the per-sequence wrapper's `[:, :L_i]` slicing (ref
        §7.2): values past a sequence's length can never reach a loss, gradient or metric.
        """
        out, width = dict(data), row_width(data)
        for key, value in data.items():
            if isinstance(value, Tensor) and value.dim() > 1 and (value.shape[1] > 1 or value.shape[1] == width):
                keep = self.valid_mask(value.shape[1])
                keep = keep.reshape(keep.shape + (1,) * (value.dim() - 2))
                out[key] = torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device))
        return out

    def pack(self, x: Tensor) -> Tensor:
        """`[B_b, S, ...]` unpacked → `[T_b, ...]` packed; padding slots are zero."""
        width = x.shape[1]
        keep = self.slot_col < self.row_len[self.slot_row].clamp(max=width)
        packed = x[self.slot_row, torch.where(keep, self.slot_col, 0)]
        keep = keep.reshape(keep.shape + (1,) * (packed.dim() - 1))
        return torch.where(keep, packed, torch.zeros((), dtype=x.dtype, device=x.device))

    def unpack(self, y: Tensor, width: int) -> Tensor:
        """`[T_b, ...]` packed → `[B_b, width, ...]` unpacked; past-length entries are zero."""
        cols = torch.arange(width, device=self.device)
        keep = cols[None, :] < self.row_len[:, None]
        out = y[torch.where(keep, self.row_start[:, None] + cols[None, :], 0)]
        keep = keep.reshape(keep.shape + (1,) * (out.dim() - 2))
        return torch.where(keep, out, torch.zeros((), dtype=y.dtype, device=y.device))

    def roll(self, y: Tensor) -> Tensor:
        """Left-shift a packed `[T_b, ...]` tensor by one within each segment (zero fill)."""
        return roll_within_segments(y, self.slot_last, 0)
