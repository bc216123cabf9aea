"""The one place the test suite writes its tolerances: per dtype, per kind of comparison.

A test says what it compares, and the table says how close that must be:

    torch.testing.assert_close(got, want, **close(torch.float32, "reordered"))
    assert got == approx(want, torch.float32, "reordered")

`tests/test_tolerances.py` fails on an `atol=` / `rtol=` numeric literal anywhere else. A bound that
is the asserted property itself (a loss falls by 10%, a speed-up) is not a tolerance and stays where
it is asserted.
"""

from __future__ import annotations

import pytest
import torch

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _t(rtol: float, atol: float) -> dict[str, float]:
    return dict(rtol=rtol, atol=atol)


TOLERANCES: dict[torch.dtype, dict[str, dict[str, float]]] = {
    torch.float32: {
        # bitwise: the same operations in the same order (determinism, a no-op rewrite, a copy)
        "exact": _t(0.0, 0.0),
        # the same formula computed twice (a rewritten expression, a float64 hand computation of it): a few
        # roundings of 2^-24 apart, never a long sum in another order
        "same": _t(1e-6, 1e-7),
        # a reduction reordered (packed vs per-sequence, chunked vs dense, micro-batches vs whole, two
        # libraries' sums): a sum of n terms moves by ~n·2^-24 relative to its size
        "reordered": _t(1e-5, 1e-6),
        # a sum over every position in another order, once more through a backward: parameter gradients,
        # a model's gradients, metrics averaged over many tokens
        "accumulated": _t(1e-4, 1e-6),
        # a run over ranks against one process: each rank sums its shard, then a sum over ranks
        "parallel": _t(1e-5, 1e-6),
        # a model forward (matmuls, layer norms) recomputed another way: logits of magnitude ~10 whose
        # dot products over the hidden size round differently
        "forward": _t(1e-5, 1e-5),
        # a KV-cache decode step against the full forward over the whole row: attention over the cache and
        # every matmul in another order, through several layers (seen 2.2e-5 apart)
        "decode": _t(1e-5, 1e-4),
        # the fused head (LinearLogits, the projection recomputed per chunk) against dense logits
        "fused": _t(1e-5, 1e-6),
        "fused_grad": _t(1e-5, 1e-5),  # the hidden states' and weight's: a sum over the vocabulary / positions
        # compiled (Inductor) against eager: Inductor fuses and reorders the reductions
        "compiled": _t(1e-5, 1e-6),
        # the library against plain torch over the numeric grid (sums over up to 50257 vocabulary entries in
        # another order: a gradient entry differs by up to ~1.2e-6)
        "vs_torch": _t(1e-5, 1e-5),
        "vs_torch_grad": _t(1e-5, 4e-6),
        "fused_vs_torch_grad": _t(1e-5, 4e-6),
        # the reference's printed numbers (§12), given to 4 decimals: the printed value is within 5e-5 of
        # the exact one, plus the fp32 computation's own error
        "printed": _t(0.0, 1e-4),
        # the reference's printed numbers given to ~3-4 significant digits, relative
        "printed_rel": _t(1e-3, 0.0),
        # a second process's (torchrun's, a reloaded checkpoint's, a cached compile's) run of the same
        # steps logged as text: Python floats written and read back through a JSON/CSV log
        "logged": _t(1e-6, 0.0),
    },
    torch.bfloat16: {
        "exact": _t(0.0, 0.0),
        # one rounding to bf16 (2^-8 relative) on each side of the comparison
        "same": _t(1e-2, 1e-2),
        # the fused head in bf16: the projection is a product of bf16 factors, rounded per chunk
        "fused": _t(1e-3, 1e-4),
        "fused_grad": _t(2e-2, 2e-2),  # rounded to bf16 after a product of bf16 factors
        # both sides reduce the same bf16 logits (the fused head: the same bf16 projection) in fp32, so
        # the outputs agree as fp32 sums do; a gradient is rounded to bf16 once (2^-8 relative), the
        # fused head's after a product of bf16 factors too
        "vs_torch": _t(1e-4, 1e-5),
        "vs_torch_grad": _t(4e-3, 1e-5),
        "fused_vs_torch_grad": _t(1.6e-2, 1e-3),
        # a fuzzed comparison in bf16 against another library's bf16 computation
        "reordered": _t(2e-2, 2e-2),
    },
    torch.float64: {
        "exact": _t(0.0, 0.0),
        # the same formula twice in float64: a few roundings of 2^-53
        "same": _t(1e-12, 1e-12),
        # a float64 reduction or matmul in another order
        "reordered": _t(1e-10, 1e-10),
    },
}

# The dtypes the numeric grid runs over (it compares against plain torch: "vs_torch" kinds).
GRID_DTYPES = (torch.float32, torch.bfloat16)


def close(dtype: torch.dtype, kind: str) -> dict[str, float]:
    """`dict(rtol=..., atol=...)` for `torch.testing.assert_close(a, b, **close(dtype, kind))`."""
    try:
        return dict(TOLERANCES[dtype][kind])
    except KeyError:
        raise KeyError(f"no tolerance for {dtype} {kind!r}; kinds: {sorted(TOLERANCES.get(dtype, {}))}") from None


def approx(expected, dtype: torch.dtype, kind: str, **kwargs):
    """`pytest.approx(expected)` at the table's tolerance: `got == approx(want, torch.float32, "reordered")`."""
    tol = close(dtype, kind)
    return pytest.approx(expected, rel=tol["rtol"], abs=tol["atol"], **kwargs)
