"""Both packing wrappers equal the independent per-sequence oracle (ref §7.2–7.3) for every
loss × input type, random valid configs and random packings: loss, every metric, the
gradient at real logit positions, and exactly zero gradient at every other packed slot.
The unpacked path (ref §7.6) on the same sequences equals the oracle too."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reliability.oracle import (
    ATOL,
    CASE_STRATEGIES,
    FAMILIES,
    GRAD_ATOL,
    RTOL,
    assert_metrics_equal,
    check_against_oracle,
    global_counts,
    grad_of,
    hyp,
    layout_tokens,
    make_data,
    make_logits,
    packings,
    per_sequence_oracle,
)

from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

EXAMPLES = {"pg": 120, "nll": 40, "dpo": 40, "distill": 40, "mse": 40}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_wrappers_equal_per_sequence_oracle(family):
    """Packed loss, metrics and real-slot gradient == oracle; no-token slots get zero gradient."""

    @hyp(EXAMPLES[family])
    @given(CASE_STRATEGIES[family](), packings(pairs=family == "dpo"))
    def run(case, packing):
        data = make_data(family, packing.rows, packing.width, packing.seed)
        gs, gt = global_counts(family, data, packing.lengths)
        logits = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
        check_against_oracle(case, packing, logits, data, gs, gt)

    run()


@pytest.mark.parametrize("family", FAMILIES)
def test_unpacked_path_equals_per_sequence_oracle(family):
    """`wrap_loss_fn_with_input_preparation` on full-length rows == the oracle over the same
    rows laid out packed (loss, metrics, gradient)."""

    @hyp(15)
    @given(
        CASE_STRATEGIES[family](),
        st.integers(1, 2).map(lambda n: 2 * n) if family == "dpo" else st.integers(1, 4),
        st.sampled_from([1, 2, 4, 6]),
        st.integers(0, 2**16),
    )
    def run(case, rows, width, seed):
        data = make_data(family, rows, width, seed)
        gs, gt = global_counts(family, data, [width] * rows)
        logits = make_logits(rows * width, case.logit_width, seed)
        cu = tuple(range(0, rows * width + 1, width))
        want, want_metrics = per_sequence_oracle(case, logits, data, cu, cu, gs, gt)
        want_grad = grad_of(want, logits)
        unpacked = logits.reshape(rows, width, case.logit_width)
        got, got_metrics = wrap_loss_fn_with_input_preparation(
            unpacked, data, gs, gt, loss_fn=case.loss_fn, prepare_fn=case.prepare(False)
        )
        torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
        assert_metrics_equal(got_metrics, want_metrics, what="unpacked")
        torch.testing.assert_close(grad_of(got, logits), want_grad, rtol=RTOL, atol=GRAD_ATOL)

    run()
