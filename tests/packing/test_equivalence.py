"""Packed == unpacked, for random packings and every loss / input type (both packing
wrappers, bucketed or exact shapes): loss, gradients w.r.t. the logits, every metric; and
micro-batch split invariance of the globally normalised losses."""

from __future__ import annotations

import pytest
import torch
from cases import (
    CASE_BY_NAME,
    CASES,
    assert_metrics_close,
    boundaries,
    globals_for,
    make_batch,
    pack_logits,
    unpack_grad,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import close

from compiled_loss.metrics import combine_metrics
from compiled_loss.packing import BucketGrid
from compiled_loss.wrapper import (
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)


@st.composite
def packings(draw, pairs: bool):
    rows = 2 * draw(st.integers(1, 2)) if pairs else draw(st.integers(1, 4))
    width = draw(st.integers(3, 10))
    lengths = [draw(st.integers(2, width)) for _ in range(rows)]
    pads = [draw(st.integers(0, 3)) for _ in range(rows)]
    if draw(st.booleans()):  # Megatron: bin padding absorbed into the last sequence (L > S)
        lengths[-1] += draw(st.integers(1, 4))
    bucketed = draw(st.booleans())
    return lengths, pads, width, bucketed, draw(st.integers(0, 2**16))


def _check_packed_equals_unpacked(case, wrapper_cls, lengths, pads, width, bucketed, seed):
    loss_fn = case.make_loss()
    data, logits = make_batch(case, lengths, width, seed)
    gs, gt = globals_for(data)
    want, want_metrics = wrap_loss_fn_with_input_preparation(
        logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=case.prepare(packed=False)
    )
    (want_grad,) = torch.autograd.grad(want, logits)

    cu, cup = boundaries(lengths, pads)
    grid = BucketGrid(tokens=16, rows=2, width=8) if bucketed else BucketGrid()
    fused = wrapper_cls is SequencePackingFusionLossWrapper
    wrapper = wrapper_cls(loss_fn, case.prepare(packed=fused), cu, cup, bucket=grid)
    packed = pack_logits(logits, cu, cup, wrapper.layout.tokens, seed)
    got, got_metrics = wrapper(packed, data, gs, gt)
    (got_grad,) = torch.autograd.grad(got, packed)

    torch.testing.assert_close(got, want, **close(torch.float32, "reordered"))
    assert_metrics_close(got_metrics, want_metrics)
    grad_real, grad_pad = unpack_grad(got_grad, cu, cup, width)
    torch.testing.assert_close(grad_real, want_grad, **close(torch.float32, "reordered"))
    assert torch.all(grad_pad == 0)


@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_packed_equals_unpacked(case, wrapper_cls):
    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(packings(case.pairs))
    def run(packing):
        _check_packed_equals_unpacked(case, wrapper_cls, *packing)

    run()


def test_padding_slots_and_rows_get_zero_gradient_even_with_nonfinite_logits():
    """Garbage (±inf / NaN) in padding slots of the packed logits reaches no loss,
    gradient or metric."""
    case = CASE_BY_NAME["grpo"]
    lengths, pads, width = [4, 3], [2, 1], 5
    data, logits = make_batch(case, lengths, width, seed=3)
    gs, gt = globals_for(data)
    cu, cup = boundaries(lengths, pads)
    wrapper = SequencePackingFusionLossWrapper(
        case.make_loss(), case.prepare(packed=True), cu, cup, bucket=BucketGrid(tokens=16, rows=4)
    )
    clean = pack_logits(logits, cu, cup, wrapper.layout.tokens, seed=3)
    dirty = clean.detach().clone()
    dirty[0, 4:6] = float("nan")  # per-sequence padding of row 0
    dirty[0, -3:] = float("inf")  # bucket tail
    dirty.requires_grad_()
    want, want_metrics = wrapper(clean, data, gs, gt)
    got, got_metrics = wrapper(dirty, data, gs, gt)
    torch.testing.assert_close(got, want)
    assert_metrics_close(got_metrics, want_metrics)
    (grad,) = torch.autograd.grad(got, dirty)
    assert torch.all(grad[0, 4:6] == 0) and torch.all(grad[0, -3:] == 0)
    assert torch.isfinite(grad).all()


SPLIT_CASES = [c for c in CASES if c.name not in ("dual_clip_vapo",)]  # VAPO NLL: local denominator


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.name for c in SPLIT_CASES])
def test_microbatch_split_invariance(case):
    """Fragments of any split of a batch, each normalised by the global counts, sum to the
    whole-batch loss (and gradients); metrics combine through the registry."""

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(st.data())
    def run(draw):
        rows = 6 if case.pairs else draw.draw(st.integers(2, 6))
        width = draw.draw(st.integers(3, 8))
        lengths = [draw.draw(st.integers(2, width)) for _ in range(rows)]
        step = 2 if case.pairs else 1
        cuts = sorted(draw.draw(st.sets(st.sampled_from(range(step, rows, step)))))
        data, logits = make_batch(case, lengths, width, seed=draw.draw(st.integers(0, 999)))
        gs, gt = globals_for(data)
        loss_fn = case.make_loss()
        prepare = case.prepare(packed=False)
        whole, whole_metrics = wrap_loss_fn_with_input_preparation(
            logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=prepare
        )
        parts, part_metrics = [], []
        for start, end in zip([0] + cuts, cuts + [rows]):
            part_data = {k: v[start:end] for k, v in data.items()}
            loss, metrics = wrap_loss_fn_with_input_preparation(
                logits[start:end], part_data, gs, gt, loss_fn=loss_fn, prepare_fn=prepare
            )
            parts.append(loss)
            part_metrics.append(metrics)
        total = torch.stack(parts).sum()
        torch.testing.assert_close(total, whole, **close(torch.float32, "reordered"))
        (g_whole,) = torch.autograd.grad(whole, logits)
        (g_parts,) = torch.autograd.grad(total, logits)
        torch.testing.assert_close(g_parts, g_whole, **close(torch.float32, "reordered"))
        assert_metrics_close(combine_metrics(part_metrics), whole_metrics)

    run()
