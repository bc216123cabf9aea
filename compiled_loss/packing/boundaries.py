"""Sequence boundaries as host data (DESIGN principle 4, ref §6.7).

Boundaries arrive as `CpuIntTuple`s (tuples of Python ints): reading them needs no device
sync, and they never reach compiled code — only index tensors built from them do.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

Tensor = torch.Tensor

CpuIntTuple = tuple[int, ...]

# cu_seqlens are int32 in the attention kernels that read them (flash-attention, TE)
MAX_PACKED_TOKENS = 2**31 - 1


def to_cpu_int_tuple(values: Tensor | Sequence[int], name: str = "values") -> CpuIntTuple:
    """A tensor (one device sync), an array or a sequence of ints as a tuple of Python ints."""
    if hasattr(values, "__array__") and not isinstance(values, Tensor):  # numpy and friends
        values = torch.as_tensor(values)
    if isinstance(values, Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor, got dtype {values.dtype} and shape {tuple(values.shape)}"
            )
        return tuple(values.tolist())  # host
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a 1-D sequence of ints [0, ..., total], got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"{name} must hold integers, got {type(v).__name__} {v!r}")
        out.append(operator.index(v))
    return tuple(out)


def _check_boundaries(cu: CpuIntTuple, name: str) -> None:
    if len(cu) < 2:
        raise ValueError(f"{name} must have at least 2 entries [0, ..., total], got {cu}")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i}] = {cu[i]} > {name}[{i + 1}] = {cu[i + 1]}"
            )
    if cu[-1] > MAX_PACKED_TOKENS:
        raise ValueError(
            f"{name} totals {cu[-1]} packed tokens, more than the {MAX_PACKED_TOKENS} an int32 cu_seqlens can address"
        )


def check_cu_seqlens(
    cu_seqlens: Tensor | Sequence[int],
    cu_seqlens_padded: Tensor | Sequence[int] | None = None,
    *,
    name: str = "cu_seqlens_q",
) -> tuple[CpuIntTuple, CpuIntTuple]:
    """Validate and convert boundaries; the padded ones default to the true ones."""
    cu = to_cpu_int_tuple(cu_seqlens, name)
    _check_boundaries(cu, name)
    if cu_seqlens_padded is None:
        return cu, cu
    pname = f"{name}_padded"
    cup = to_cpu_int_tuple(cu_seqlens_padded, pname)
    _check_boundaries(cup, pname)
    if len(cup) != len(cu):
        raise ValueError(f"{pname} must have as many entries as {name} ({len(cu)}), got {len(cup)}")
    for i in range(len(cu) - 1):
        true_len, padded_len = cu[i + 1] - cu[i], cup[i + 1] - cup[i]
        if padded_len < true_len:
            raise ValueError(
                f"sequence {i}: padded length {pname}[{i + 1}] - {pname}[{i}] = {padded_len} is "
                f"smaller than its true length {name}[{i + 1}] - {name}[{i}] = {true_len}"
            )
    return cu, cup
