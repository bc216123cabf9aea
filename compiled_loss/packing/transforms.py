"""Per-sequence packing transforms on host boundaries (ref §5.2, §6.3–6.4, §8.11).

`pack_source_index` is the one map from packed slots to `(row, position)`: each sequence
laid into its padded length, optionally rolled over it, and context-parallel sharded into
the load-balanced `2·cp` chunks (rank `r` keeps chunks `r` and `2cp-1-r`). The seed's
packing utilities are built on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compiled_loss.packing.boundaries import CpuIntTuple, check_cu_seqlens

Tensor = torch.Tensor


def pack_source_index(
    cu_seqlens_padded: CpuIntTuple,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    roll_shift: int = 0,
) -> tuple[Tensor, Tensor]:
    """Host-side: for each CP-local packed slot, the `(row, position)` of the padded
    sequence element it holds.

    Sequence `i` occupies its padded length `P_i`, optionally rolled by `roll_shift` over
    that length (`rolled[j] = seq[(j - shift) mod P]`), then CP-sharded into `2·cp`
    chunks of which rank `r` keeps chunks `r` and `2cp-1-r` (ref §5.2, §8.11). Returns
    long CPU tensors of length `cu_seqlens_padded[-1] // cp_size`; callers decide which
    positions hold real tokens.
    """
    starts = torch.tensor(cu_seqlens_padded[:-1], dtype=torch.long)
    padded = torch.tensor(cu_seqlens_padded[1:], dtype=torch.long) - starts
    n_seq = len(cu_seqlens_padded) - 1
    if cp_size > 1:
        bad = [i for i in range(n_seq) if int(padded[i]) % (2 * cp_size)]
        if bad:
            raise ValueError(
                f"with cp_size={cp_size} every padded sequence length must be a multiple of "
                f"2*cp_size={2 * cp_size}; sequences {bad} have padded lengths "
                f"{[int(padded[i]) for i in bad]}"
            )
    local_len = padded // cp_size
    row = torch.repeat_interleave(torch.arange(n_seq), local_len)
    q = torch.arange(int(local_len.sum())) - torch.repeat_interleave(torch.cumsum(local_len, 0) - local_len, local_len)
    if cp_size > 1:
        chunk = (padded // (2 * cp_size))[row]
        first = q < chunk
        global_chunk = torch.where(first, cp_rank, 2 * cp_size - 1 - cp_rank)
        q = global_chunk * chunk + torch.where(first, q, q - chunk)
    if roll_shift:
        q = torch.remainder(q - roll_shift, padded[row])
    return row, q


def roll_within_segments(x: Tensor, is_last: Tensor, dim: int) -> Tensor:
    """Left-shift `x` by one along `dim`, zeroing the slots flagged by `is_last` (bool,
    one per slot along `dim`): a per-segment `roll(-1)` with zero fill."""
    rolled = torch.roll(x, -1, dim)
    shape = [1] * x.dim()
    shape[dim] = -1
    return torch.where(is_last.reshape(shape), torch.zeros((), dtype=x.dtype, device=x.device), rolled)


def roll_packed_seq_dim(tensor: Tensor, cu_seqlens_padded: Tensor | Sequence[int], seq_dim: int) -> Tensor:
    """Left-shift a packed tensor by one along `seq_dim` within each segment (ref §6.3):
    one global roll, then zero each segment's last physical slot."""
    (cup, _) = check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    length = tensor.shape[seq_dim]
    if cup[-1] != length:
        raise ValueError(
            f"cu_seqlens_padded ends at {cup[-1]}, but the tensor has {length} packed slots along dim {seq_dim}"
        )
    cu = torch.tensor(cup, device=tensor.device)
    is_last = torch.zeros(length, dtype=torch.bool, device=tensor.device)
    is_last[torch.remainder(cu[1:].long() - 1, length)] = True
    return roll_within_segments(tensor, is_last, seq_dim)


def pack_input_ids(
    input_ids: Tensor,
    cu_seqlens_q: CpuIntTuple,
    cu_seqlens_q_padded: CpuIntTuple,
    cp_rank: int = 0,
    cp_size: int = 1,
    roll_shift: int = 0,
) -> Tensor:
    """Pack `[B, S]` → `[1, T_padded // cp]` (ref §5.2): each sequence laid into its padded
    length (copying `min(L_i, S)` tokens), rolled by `roll_shift`, CP-sharded."""
    cu, cup = check_cu_seqlens(cu_seqlens_q, cu_seqlens_q_padded)
    rows, width = input_ids.shape[:2]
    if rows != len(cu) - 1:
        raise ValueError(f"input_ids must have one row per sequence ({len(cu) - 1}), got {tuple(input_ids.shape)}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    row, pos = pack_source_index(cup, cp_rank=cp_rank, cp_size=cp_size, roll_shift=roll_shift)
    copied = torch.tensor([min(cu[i + 1] - cu[i], width) for i in range(rows)], dtype=torch.long)
    keep = pos < copied[row]
    row, col = row.to(input_ids.device), torch.where(keep, pos, 0).to(input_ids.device)
    keep = keep.to(input_ids.device)
    out = torch.where(keep, input_ids[row, col], torch.zeros((), dtype=input_ids.dtype, device=input_ids.device))
    return out.unsqueeze(0)


def pack_rolled_draft_token_mask(
    token_mask: Tensor,
    sample_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    cu_seqlens_padded: Tensor | Sequence[int],
) -> Tensor:
    """Packed draft-loss mask `[1, T_packed]` (ref §6.4): `token_mask·sample_mask` laid at
    padded offsets, then shifted left by one within each segment."""
    cu, cup = check_cu_seqlens(cu_seqlens, cu_seqlens_padded, name="cu_seqlens")
    packed = pack_input_ids(token_mask * sample_mask[:, None], cu, cup)
    return roll_packed_seq_dim(packed, cup, 1)
