"""Positions the per-sequence loop never evaluates — the last real position of each
sequence predicts a token past it — reach no value and no gradient in either packing
wrapper, whatever the logits or the teacher hold there (NaN, a -inf for the pad id)."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, assert_metrics_close, boundaries, globals_for, make_batch, pack_logits

from compiled_loss.wrapper import SequencePackingFusionLossWrapper, SequencePackingLossWrapper

LENGTHS, PADS, WIDTH = [4, 3, 6], [1, 2, 0], 7
CU, CUP = boundaries(LENGTHS, PADS)
LAST = [CUP[i] + n - 1 for i, n in enumerate(LENGTHS)]  # packed slot of each last real position


def _poison_logits(packed: torch.Tensor, how: str) -> torch.Tensor:
    out = packed.detach().clone()
    for slot in LAST:
        if how == "nan":
            out[0, slot] = float("nan")
        else:  # the pad id 0 (the target past the sequence) gets -inf
            out[0, slot, 0] = float("-inf")
    return out.requires_grad_()


def _run(case, wrapper_cls, packed, data):
    fused = wrapper_cls is SequencePackingFusionLossWrapper
    wrapper = wrapper_cls(case.make_loss(), case.prepare(packed=fused), CU, CUP)
    loss, metrics = wrapper(packed, data, *globals_for(data))
    return loss, metrics, torch.autograd.grad(loss, packed)[0]


@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
@pytest.mark.parametrize("how", ["nan", "neg_inf_pad"])
@pytest.mark.parametrize("name", ["nll", "grpo", "grpo_topk_topp", "distill_mixed_zero_outside"])
def test_poisoned_unevaluated_logits_change_nothing(name, how, wrapper_cls):
    case = CASE_BY_NAME[name]
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=3)
    data["input_ids"][:, -1] = 0
    clean = pack_logits(logits, CU, CUP, CUP[-1], seed=3)
    want = _run(case, wrapper_cls, clean, data)
    got = _run(case, wrapper_cls, _poison_logits(clean, how), data)
    torch.testing.assert_close(got[0], want[0])
    assert_metrics_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    assert torch.all(got[2][0, LAST] == 0)


@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
def test_a_neg_inf_teacher_logit_at_the_last_real_position_changes_nothing(wrapper_cls):
    case = CASE_BY_NAME["distill_mixed_zero_outside"]
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=4)
    packed = pack_logits(logits, CU, CUP, CUP[-1], seed=4)
    want = _run(case, wrapper_cls, packed, data)
    poisoned = {**data, "teacher_topk_logits": data["teacher_topk_logits"].clone()}
    for i, n in enumerate(LENGTHS):
        poisoned["teacher_topk_logits"][i, n - 1, 0] = float("-inf")
    got = _run(case, wrapper_cls, packed, poisoned)
    torch.testing.assert_close(got[0], want[0])
    assert_metrics_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
