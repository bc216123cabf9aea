"""Degenerate shapes: an empty batch (B = 0), zero-width rows (S = 0, what the per-sequence
loop hands a zero-length sequence, ref §7.2), one-token rows (S = 1), zero-length
sequences in a packing, all-masked micro-batches, a single sequence — through both
packing wrappers and the unpacked path (ref §7.6)."""

from __future__ import annotations

import pytest
import torch
from reliability.oracle import (
    ATOL,
    FAMILIES,
    FIXED,
    GRAD_ATOL,
    RTOL,
    WRAPPERS,
    Packing,
    assert_metrics_equal,
    check_against_oracle,
    global_counts,
    grad_of,
    layout_tokens,
    make_data,
    make_logits,
    run_wrapper,
)

from compiled_loss.metrics import aggregation
from compiled_loss.packing import BucketGrid
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

LOGPROB_FAMILIES = ("pg", "nll", "distill")  # no next-token position on a 1-token row: loss 0
PATHS = ("unpacked",) + tuple(w.__name__ for w in WRAPPERS)


def _unpacked(case, logits, data, gs, gt):
    loss, metrics = wrap_loss_fn_with_input_preparation(
        logits, data, gs, gt, loss_fn=case.loss_fn, prepare_fn=case.prepare(False)
    )
    return loss, metrics, grad_of(loss, logits)


def _assert_sentinels(metrics: dict) -> None:
    for key, value in metrics.items():
        if aggregation(key) == "min":
            assert float(value) == float("inf"), f"{key} = {float(value)}, want the +inf sentinel"
        elif aggregation(key) == "max":
            assert float(value) == float("-inf"), f"{key} = {float(value)}, want the -inf sentinel"


def _assert_exact_zero(loss, grad) -> None:
    assert loss.detach().item() == 0.0, f"loss = {loss.item()}, want exactly 0"
    assert torch.equal(grad, torch.zeros_like(grad)), f"gradient not exactly 0: {grad[grad != 0][:6].tolist()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_batch_unpacked(family):
    """B = 0: loss exactly 0, zero gradient, summed metrics 0, extrema ±inf sentinels."""
    case = FIXED[family]
    data = make_data(family, 0, 4, seed=0)
    logits = torch.zeros(0, 4, case.logit_width, requires_grad=True)
    loss, metrics, grad = _unpacked(case, logits, data, torch.tensor(0.0), torch.tensor(0.0))
    _assert_exact_zero(loss, grad)
    _assert_sentinels(metrics)
    for key, value in metrics.items():
        if aggregation(key) == "sum":
            assert float(value) == 0.0, f"{key} = {float(value)} on an empty batch"


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_width_rows_unpacked(family):
    """S = 0 (the per-sequence loop's slice of a zero-length sequence): the loss, metrics and
    zero gradient of the same rows as 1-token rows with token_mask 0 — loss exactly 0 except
    DPO's, whose pairs still compare two (empty, zero) rewards: -logsigmoid(0) per pair."""
    case = FIXED[family]
    rows = 2
    data = make_data(family, rows, 1, seed=1)
    data["token_mask"].zero_()
    gs, gt = data["sample_mask"].sum(), torch.tensor(0.0)
    one = torch.zeros(rows, 1, case.logit_width, requires_grad=True)
    want, want_metrics, _ = _unpacked(case, one, data, gs, gt)
    empty = {k: (v[:, :0] if v.dim() > 1 else v) for k, v in data.items()}
    logits = torch.zeros(rows, 0, case.logit_width, requires_grad=True)
    loss, metrics, grad = _unpacked(case, logits, empty, gs, gt)
    if family == "dpo":
        assert loss.item() == pytest.approx(want.item()) and want.item() > 0
    else:
        _assert_exact_zero(loss, grad)
    _assert_sentinels(metrics)
    assert_metrics_equal(metrics, want_metrics, what="S=0")


@pytest.mark.parametrize("bucket_width", [1, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_rows_packed(family, bucket_width):
    """S = 1 (one sequence of length 0, one absorbing bin padding, L > S), data padded to a
    bucket of width 1 or 8: both wrappers == oracle (so the bucket changes nothing);
    log-prob losses are exactly 0 with zero gradient and ±inf extrema."""
    case = FIXED[family]
    lengths = (1, 0, 1, 3) if family == "dpo" else (1, 0, 3)
    packing = Packing(lengths, (1,) * len(lengths), 1, BucketGrid(tokens=8, rows=2, width=bucket_width), True, seed=5)
    data = make_data(family, packing.rows, 1, packing.seed)
    data["token_mask"].fill_(1)
    data["sample_mask"].fill_(1)
    gs, gt = global_counts(family, data, lengths)
    logits = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
    check_against_oracle(case, packing, logits, data, gs, gt)
    if family in LOGPROB_FAMILIES:
        for wrapper_cls in WRAPPERS:
            loss, metrics, grad = run_wrapper(case, wrapper_cls, packing, logits, data, gs, gt)
            _assert_exact_zero(loss, grad)
            _assert_sentinels(metrics)


@pytest.mark.parametrize("family", LOGPROB_FAMILIES)
def test_one_token_rows_unpacked(family):
    """S = 1 unpacked: log-prob losses are exactly 0 with zero gradient and ±inf extrema."""
    case = FIXED[family]
    data = make_data(family, 3, 1, seed=2)
    data["sample_mask"].fill_(1)
    logits = make_logits(3, case.logit_width, seed=2).detach().reshape(3, 1, -1).requires_grad_()
    loss, metrics, grad = _unpacked(case, logits, data, torch.tensor(3.0), torch.tensor(0.0))
    _assert_exact_zero(loss, grad)
    _assert_sentinels(metrics)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_length_sequences_packed(family):
    """Zero-length sequences between real ones (with and without padding slots): both
    wrappers == oracle, zero gradient on every slot without a real token."""
    case = FIXED[family]
    lengths, pads = ((0, 0, 4, 3), (0, 2, 1, 0)) if family == "dpo" else ((0, 5, 0, 3), (2, 0, 0, 1))
    packing = Packing(lengths, pads, 6, BucketGrid(tokens=16, rows=4, width=8), False, seed=11)
    data = make_data(family, packing.rows, packing.width, packing.seed)
    gs, gt = global_counts(family, data, lengths)
    logits = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
    check_against_oracle(case, packing, logits, data, gs, gt)


ALL_MASKED = [
    (f, p, how)
    for f in FAMILIES
    for p in PATHS
    for how in ("sample_mask", "token_mask")
    if not (f == "dpo" and how == "token_mask")
]  # DPO's reward ignores token_mask=0: loss log 2


@pytest.mark.parametrize("family,path,how", ALL_MASKED, ids=[f"{f}-{p}-{h}" for f, p, h in ALL_MASKED])
def test_all_masked_micro_batch(family, path, how):
    """Every sample_mask (or token_mask) 0: loss exactly 0, gradient exactly 0, extrema ±inf
    sentinels; with sample_mask 0 every summed metric is exactly 0."""
    case = FIXED[family]
    lengths = (4, 2, 5, 3)
    packing = Packing(lengths, (1, 0, 2, 0), 5, BucketGrid(tokens=16, rows=4, width=8), True, seed=3)
    data = make_data(family, packing.rows, packing.width, packing.seed)
    data[how].zero_()
    gs, gt = global_counts(family, data, lengths)
    if path == "unpacked":
        full = make_data(family, 4, 5, seed=3)
        full[how].zero_()
        logits = make_logits(20, case.logit_width, seed=3).detach().reshape(4, 5, -1).requires_grad_()
        loss, metrics, grad = _unpacked(case, logits, full, gs, gt)
    else:
        wrapper_cls = {w.__name__: w for w in WRAPPERS}[path]
        logits = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
        loss, metrics, grad = run_wrapper(case, wrapper_cls, packing, logits, data, gs, gt)
    _assert_exact_zero(loss, grad)
    _assert_sentinels(metrics)
    if how == "sample_mask":
        for key, value in metrics.items():
            if aggregation(key) == "sum":
                assert float(value) == 0.0, f"{key} = {float(value)} with every sample masked"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "dpo"])
def test_single_sequence(family):
    """One sequence (per-sequence padding, bucketed): both wrappers == oracle == the unpacked
    path on that row."""
    case = FIXED[family]
    packing = Packing((5,), (2,), 5, BucketGrid(tokens=16, rows=2, width=8), False, seed=4)
    data = make_data(family, 1, 5, packing.seed)
    data["sample_mask"].fill_(1)
    gs, gt = global_counts(family, data, packing.lengths)
    logits = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
    check_against_oracle(case, packing, logits, data, gs, gt)
    for wrapper_cls in WRAPPERS:
        got, got_metrics, got_grad = run_wrapper(case, wrapper_cls, packing, logits, data, gs, gt)
        want, want_metrics = wrap_loss_fn_with_input_preparation(
            logits[:, :5], data, gs, gt, loss_fn=case.loss_fn, prepare_fn=case.prepare(False)
        )
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert_metrics_equal(got_metrics, want_metrics, what=wrapper_cls.__name__)
        torch.testing.assert_close(got_grad[:, :5], grad_of(want, logits)[:, :5], rtol=RTOL, atol=GRAD_ATOL)
