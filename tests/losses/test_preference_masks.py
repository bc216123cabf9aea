"""A (chosen, rejected) pair with one row's `sample_mask` 0 (ref §4.3–4.4): the pair drops
out of the pair's terms (loss, accuracy), each reward mean reads its own rows under their
own mask, so a masked row's values — NaN included — reach no loss, metric or gradient
(the reference compares the chosen reward with a masked rejected row). Pairs whose rows
agree keep the reference's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import close

from compiled_loss.loss_functions import DPOLossFn, PreferenceLossFn
from compiled_loss.losses import MPOLossFn

F64 = torch.float64
ROWS, WIDTH, BETA = 6, 5, 0.5
# pair 0 both rows in; pair 1 its rejected row (3) masked; pair 2 its chosen row (4) masked
SAMPLE_MASK = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0], dtype=F64)
MASKED = [3, 4]


def _data(fill: float | None) -> tuple[torch.Tensor, dict]:
    """Log-probs `[B, S-1]` (a leaf) and DPO data; the masked rows hold `fill` (None: random)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(ROWS, WIDTH - 1, generator=g, dtype=F64) * 2
    ref = -torch.rand(ROWS, WIDTH, generator=g, dtype=F64) * 2
    if fill is not None:
        lp[MASKED], ref[MASKED] = fill, fill
    token_mask = torch.ones(ROWS, WIDTH, dtype=F64)
    token_mask[:, 0] = 0
    token_mask[0, -1] = 0
    data = {
        "token_mask": token_mask,
        "sample_mask": SAMPLE_MASK,
        "reference_policy_logprobs": ref,
        "reward_shift": torch.full((ROWS,), 0.1, dtype=F64),
    }
    return lp.requires_grad_(), data


def _run(fn, fill):
    lp, data = _data(fill)
    g_toks = (data["token_mask"][:, 1:] * SAMPLE_MASK[:, None]).sum()
    loss, metrics = fn(lp, data, SAMPLE_MASK.sum(), g_toks)
    loss.backward()
    return loss.detach(), {k: v.item() for k, v in metrics.items()}, lp.grad


LOSSES = {
    "dpo": lambda: DPOLossFn({"reference_policy_kl_penalty": BETA, "sft_loss_weight": 0.5}),
    "mpo": lambda: MPOLossFn({"reference_policy_kl_penalty": BETA, "sft_loss_weight": 0.5}),
}


@pytest.mark.parametrize("name", LOSSES)
def test_a_masked_row_of_a_pair_reaches_nothing(name):
    fn = LOSSES[name]()
    want, want_metrics, want_grad = _run(fn, None)
    for fill in (float("nan"), float("inf"), 1e30):
        loss, metrics, grad = _run(fn, fill)
        assert loss.item() == want.item() and metrics == want_metrics, fill
        torch.testing.assert_close(grad, want_grad, **close(torch.float32, "exact"))
    assert (want_grad[MASKED] == 0).all()
    # row 5, its pair's chosen row masked: only MPO's BCO term, which reads each row on its own
    assert (want_grad[5] == 0).all() == (name == "dpo")
    # the pair's terms read pair 0 only; each reward mean its own rows; G_s / 2 = 2 pairs
    lp, data = _data(None)
    tm = data["token_mask"][:, 1:]
    r = ((lp.detach() - data["reference_policy_logprobs"][:, :-1]) * tm).sum(-1)
    assert want_metrics["preference_loss"] == pytest.approx(-F.logsigmoid(BETA * (r[0] - r[1])).item() / 2)
    assert want_metrics["accuracy"] == float(r[0] > r[1]) / 2
    assert want_metrics["rewards_chosen_mean"] == pytest.approx((r[0] + r[2]).item() / 2)
    assert want_metrics["rewards_rejected_mean"] == pytest.approx((r[1] + r[5]).item() / 2)
    assert want_metrics["sft_loss"] == pytest.approx(-(lp.detach() * tm)[[0, 2]].sum().item() / 2)


def test_a_masked_reward_of_a_pair_reaches_nothing():
    """The reward-model loss: the same pair rule on per-row rewards."""

    def run(fill):
        rewards = torch.tensor([0.3, -0.2, 0.7, fill, fill, 0.1], dtype=F64, requires_grad=True)
        loss, metrics = PreferenceLossFn()(rewards, {"sample_mask": SAMPLE_MASK}, SAMPLE_MASK.sum(), None)
        loss.backward()
        return loss.item(), {k: v.item() for k, v in metrics.items()}, rewards.grad

    want, want_metrics, want_grad = run(0.0)
    assert want == pytest.approx(-F.logsigmoid(torch.tensor(0.5)).item() / 2)
    assert want_metrics["rewards_chosen_mean"] == pytest.approx(0.5)
    assert want_metrics["rewards_rejected_mean"] == pytest.approx(-0.05)
    assert want_grad[2:].eq(0).all()
    for fill in (float("nan"), float("-inf")):
        assert run(fill) == (want, want_metrics, pytest.approx(want_grad))
