"""Preference data that names its pairs (`pair_index`, `is_chosen`, ref §4.3): rows in any
order give the interleaved result — unpacked, packed with bucket padding rows, and
compiled — and a naming that is not one chosen + one rejected row per pair is refused."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, assert_metrics_close, boundaries, globals_for, make_batch, pack_logits
from common import message

from compiled_loss.loss_functions import PreferenceLossFn
from compiled_loss.loss_input import prepare_packed_loss_input
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

DPO = CASE_BY_NAME["dpo_sft"]
ORDER = [3, 0, 2, 1]  # a packing reorder of rows (c0, r0, c1, r1): r1, c0, c1, r0


def _named(data: dict, order: list[int]) -> dict:
    """`data`'s rows (interleaved pairs) in `order`, with the pair naming."""
    rows = data["sample_mask"].shape[0]
    named = {"pair_index": torch.arange(rows) // 2, "is_chosen": (torch.arange(rows) % 2 == 0).long(), **data}
    return {k: v[order] for k, v in named.items()}


def _dpo(data, logits):
    gs, gt = globals_for(data)
    return wrap_loss_fn_with_input_preparation(
        logits, data, gs, gt, loss_fn=DPO.make_loss(), prepare_fn=DPO.prepare(False)
    )


def test_dpo_rows_in_any_order_give_the_interleaved_result():
    data, logits = make_batch(DPO, [5, 4, 6, 3], 6, seed=1)
    want, want_metrics = _dpo(data, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    shuffled = logits.detach()[ORDER].requires_grad_()
    got, got_metrics = _dpo(_named(data, ORDER), shuffled)
    (got_grad,) = torch.autograd.grad(got, shuffled)
    torch.testing.assert_close(got, want)
    assert_metrics_close(got_metrics, want_metrics)
    torch.testing.assert_close(got_grad, want_grad[ORDER])


def test_reward_model_rows_in_any_order_give_the_interleaved_result():
    rewards = torch.tensor([2.0, -1.0, 0.5, 1.5])
    data = {"sample_mask": torch.ones(4)}
    want, want_metrics = PreferenceLossFn()(rewards, data, torch.tensor(4.0), None)
    got, got_metrics = PreferenceLossFn()(rewards[ORDER], _named(data, ORDER), torch.tensor(4.0), None)
    torch.testing.assert_close(got, want)
    assert_metrics_close(got_metrics, want_metrics)
    assert want_metrics["accuracy"].item() == 0.5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_packed_with_bucket_padding_rows(compiled):
    """Two padding rows (BucketGrid(rows=4) over 2 real rows) form a pair of their own."""
    data, logits = make_batch(DPO, [5, 4], 6, seed=2)
    want, want_metrics = _dpo(data, logits)
    named = _named(data, [1, 0])
    cu, cup = boundaries([4, 5], [1, 0])
    wrapper = SequencePackingFusionLossWrapper(
        DPO.make_loss(), DPO.prepare(True), cu, cup, bucket=BucketGrid(tokens=16, rows=4, width=8)
    )
    packed = pack_logits(logits.detach()[[1, 0]], cu, cup, wrapper.layout.tokens, seed=2)
    call = lambda w, *a: w(*a)  # noqa: E731
    recorder = CompileRecorder("aot_eager")
    fn = recorder.compile(call, fullgraph=True) if compiled else call
    got, got_metrics = fn(wrapper, packed, wrapper.layout.pad_data(named), *globals_for(data))
    torch.testing.assert_close(got, want)
    assert_metrics_close(got_metrics, want_metrics)
    if compiled:
        assert (recorder.report.compiles, recorder.report.problems()) == (1, [])


def test_a_naming_that_is_not_one_chosen_and_one_rejected_per_pair_is_refused():
    data, logits = make_batch(DPO, [5, 4, 6, 3], 6, seed=1)
    bad = {**data, "pair_index": torch.tensor([0, 0, 1, 1]), "is_chosen": torch.tensor([1, 1, 0, 0])}
    assert message(_dpo, bad, logits) == (
        "ValueError: preference data: pair_index / is_chosen must name exactly one chosen and one rejected row "
        "per pair index, got pair_index=[0, 0, 1, 1] is_chosen=[1, 1, 0, 0]"
    )


def test_an_odd_number_of_real_rows_is_refused_before_bucket_padding():
    cu, cup = boundaries([4, 5, 3], [0, 0, 0])
    assert message(
        SequencePackingFusionLossWrapper,
        DPO.make_loss(),
        prepare_packed_loss_input,
        cu,
        cup,
        bucket=BucketGrid(rows=4),
    ) == (
        "ValueError: SequencePackingFusionLossWrapper: DPOLossFn reads (chosen, rejected) row pairs, but the "
        "packing has an odd number of sequences (3)"
    )
