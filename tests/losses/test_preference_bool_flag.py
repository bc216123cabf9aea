"""`is_chosen` as a bool tensor (a chosen/rejected flag) reads as 1 / 0, as NeMo-RL treats
it: bool and integer flags give the same loss, every metric and the same gradient —
unpacked, packed with bucket padding rows and compiled, the reward model's loss — and
`validate_batch` accepts it."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch, pack_logits
from common import message
from tolerances import approx

from compiled_loss.inputs import validate_batch
from compiled_loss.loss_functions import PreferenceLossFn
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

DPO = CASE_BY_NAME["dpo_sft"]
ORDER = [3, 0, 2, 1]  # rows (c0, r0, c1, r1) reordered: r1, c0, c1, r0


def _named(data: dict, order: list[int], flag: torch.dtype) -> dict:
    """`data`'s rows (interleaved pairs) in `order`, named by `pair_index` and an `is_chosen` of dtype `flag`."""
    rows = data["sample_mask"].shape[0]
    named = {"pair_index": torch.arange(rows) // 2, "is_chosen": (torch.arange(rows) % 2 == 0).to(flag), **data}
    return {k: v[order] for k, v in named.items()}


def _assert_identical(got, want):
    """Loss, every metric and the gradient bit for bit: (loss, metrics, grad) each."""
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for key in want[1]:
        assert torch.equal(got[1][key], want[1][key]), key
    assert torch.equal(got[2], want[2])


def _dpo(data, logits):
    logits = logits.detach().requires_grad_()
    gs, gt = globals_for(data)
    loss, metrics = wrap_loss_fn_with_input_preparation(
        logits, data, gs, gt, loss_fn=DPO.make_loss(), prepare_fn=DPO.prepare(False)
    )
    return loss, metrics, torch.autograd.grad(loss, logits)[0]


def test_dpo_reads_a_bool_flag_as_the_integer_one():
    data, logits = make_batch(DPO, [5, 4, 6, 3], 6, seed=1)
    shuffled = logits.detach()[ORDER]
    want = _dpo(_named(data, ORDER, torch.long), shuffled)
    _assert_identical(_dpo(_named(data, ORDER, torch.bool), shuffled), want)
    assert want[0].item() == approx(_dpo(data, logits)[0].item(), torch.float32, "same")  # the interleaved result


def test_the_reward_model_reads_a_bool_flag_as_the_integer_one():
    rewards, data = torch.tensor([2.0, -1.0, 0.5, 1.5]), {"sample_mask": torch.ones(4)}

    def loss(flag):
        scores = rewards[ORDER].clone().requires_grad_()
        value, metrics = PreferenceLossFn()(scores, _named(data, ORDER, flag), torch.tensor(4.0), None)
        return value, metrics, torch.autograd.grad(value, scores)[0]

    want = loss(torch.long)
    _assert_identical(loss(torch.bool), want)
    assert want[1]["accuracy"].item() == 0.5


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "aot_eager"]
)  # aot_eager: two compiles (a graph per flag dtype), 4 s
def test_packed_with_bucket_padding_rows(compiled):
    data, logits = make_batch(DPO, [5, 4], 6, seed=2)
    cu, cup = boundaries([4, 5], [1, 0])
    wrapper = SequencePackingFusionLossWrapper(
        DPO.make_loss(), DPO.prepare(True), cu, cup, bucket=BucketGrid(tokens=16, rows=4, width=8)
    )
    packed = pack_logits(logits.detach()[[1, 0]], cu, cup, wrapper.layout.tokens, seed=2)
    recorder = CompileRecorder("aot_eager")
    call = lambda w, *a: w(*a)  # noqa: E731
    call = recorder.compile(call, fullgraph=True) if compiled else call

    def loss(flag):
        x = packed.clone().requires_grad_()
        value, metrics = call(wrapper, x, wrapper.layout.pad_data(_named(data, [1, 0], flag)), *globals_for(data))
        return value, metrics, torch.autograd.grad(value, x)[0]

    want = loss(torch.long)
    _assert_identical(loss(torch.bool), want)
    if compiled:
        assert (recorder.report.compiles, recorder.report.problems()) == (2, [])


def test_validate_batch_accepts_a_bool_flag_and_names_a_float_one():
    data, logits = make_batch(DPO, [5, 4, 6, 3], 6, seed=1)
    vocab = logits.shape[-1]
    validate_batch(_named(data, ORDER, torch.bool), vocab_size=vocab)
    assert message(validate_batch, _named(data, ORDER, torch.float32), vocab_size=vocab) == (
        "TypeError: data['is_chosen'] must be an integer or bool tensor, got torch.float32"
    )
    bad = {**_named(data, ORDER, torch.bool), "is_chosen": torch.tensor([True, True, True, False])}
    assert message(validate_batch, bad, vocab_size=vocab) == (
        "ValueError: data: pair_index / is_chosen must name exactly one chosen and one rejected row per pair index, "
        "got pair_index=[1, 0, 1, 0] is_chosen=[True, True, True, False]"
    )
