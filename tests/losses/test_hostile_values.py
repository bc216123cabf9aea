"""Hostile values inside a micro-batch: the VAPO term with no positive-reward token is
exactly 0 even over non-finite masked log-probs (the reference skips it); degenerate shapes
give the ±inf extrema sentinels, never a raw reduction error."""

from __future__ import annotations

import pytest
import torch
from common import clipped_pg_data

from compiled_loss.loss_functions import ClippedPGLossFn, DistillationLossFn, DPOLossFn, MseValueLossFn, NLLLossFn
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation


def test_vapo_without_positive_rewards_ignores_non_finite_masked_logprobs():
    data = clipped_pg_data(rows=2, width=5)
    data["token_mask"][1, 2] = 0
    data["rewards"] = torch.tensor([0.0, -1.0])  # no positive-reward response
    lp = torch.full((2, 4), -0.5, requires_grad=True)
    poisoned = lp.detach().clone()
    poisoned[1, 1] = float("-inf")  # masked-out token (token_mask[1, 2] = 0)
    poisoned.requires_grad_()
    g = torch.tensor(7.0)
    with_vapo = ClippedPGLossFn({"positive_example_nll_weight": 0.5})
    plain = ClippedPGLossFn({"positive_example_nll_weight": 0.0})
    loss, metrics = with_vapo(poisoned, data, torch.tensor(2.0), g)
    want, _ = plain(lp, data, torch.tensor(2.0), g)
    torch.testing.assert_close(loss, want)
    assert metrics["positive_nll_loss"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, poisoned)
    assert torch.isfinite(grad).all() and grad[1, 1] == 0


LOSSES = {
    "grpo": (ClippedPGLossFn({}), 6),
    "gspo": (ClippedPGLossFn({"token_level_loss": False, "sequence_level_importance_ratios": True}), 6),
    "nll": (NLLLossFn(), 6),
    "dpo": (DPOLossFn({"sft_loss_weight": 0.5}), 6),
    "distillation": (DistillationLossFn({"zero_outside_topk": True}), 6),
    "mse_value": (MseValueLossFn({"cliprange": 0.2}), 1),
}


@pytest.mark.parametrize("rows,width", [(0, 4), (2, 1), (0, 1)], ids=["B=0", "S=1", "B=0,S=1"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_degenerate_shapes_give_zero_loss_and_sentinels(name, rows, width):
    loss_fn, logit_width = LOSSES[name]
    data = {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "token_mask": torch.ones(rows, width),
        "sample_mask": torch.ones(rows),
        "advantages": torch.ones(rows, width),
        "prev_logprobs": torch.zeros(rows, width),
        "generation_logprobs": torch.zeros(rows, width),
        "reference_policy_logprobs": torch.zeros(rows, width),
        "returns": torch.zeros(rows, width),
        "values": torch.zeros(rows, width),
        "teacher_topk_logits": torch.zeros(rows, width, 2),
        "teacher_topk_indices": torch.zeros(rows, width, 2, dtype=torch.long),
    }
    logits = torch.zeros(rows, width, logit_width, requires_grad=True)
    loss, metrics = wrap_loss_fn_with_input_preparation(
        logits, data, torch.tensor(1.0), torch.tensor(1.0), loss_fn=loss_fn, prepare_fn=prepare_loss_input
    )
    loss.backward()
    evaluated = rows > 0 and (width > 1 or name in ("mse_value", "dpo"))  # DPO: a pair has a reward at any S
    if not evaluated:
        assert loss.item() == 0.0
    assert torch.isfinite(loss)
    for key, value in metrics.items():
        if key.endswith("_min") and not evaluated:
            assert value.item() == float("inf"), key
        elif key.endswith("_max") and not evaluated:
            assert value.item() == float("-inf"), key
        else:
            assert torch.isfinite(value), key
