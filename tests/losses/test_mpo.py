"""MPO (ref §4.4, newer): DPO's preference and chosen-SFT terms plus the BCO quality term
against the driver's reward shift `data["reward_shift"]`, checked against float64 formulas
written here — value, every metric and the gradient — and through both packing wrappers,
torch.compile, pickling, the config checks and the driver's EMA step."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from cases import boundaries, pack_logits
from common import message
from tolerances import close

from compiled_loss.loss_functions import ConfigError, MPOLossConfig, MPOLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.losses import update_reward_shift
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, SequencePackingLossWrapper

F64 = torch.float64
CFG = dict(reference_policy_kl_penalty=0.3, preference_loss_weight=0.7, sft_loss_weight=0.4, bco_loss_weight=1.3)


def _batch(rows: int = 4, width: int = 6, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """`[B, S-1]` float64 log-probs (a leaf) and DPO data with a reward shift; the last pair's
    rejected row is masked out by sample_mask (the pair drops out of the preference terms),
    and token masks vary by row."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(rows, width, dtype=F64)
    for b in range(rows):
        token_mask[b, 2 : 3 + (b % 3) + 1] = 1.0
    sample_mask = torch.ones(rows, dtype=F64)
    sample_mask[-1] = 0.0
    data = {
        "input_ids": torch.randint(0, 9, (rows, width), generator=g),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "reference_policy_logprobs": -torch.rand(rows, width, generator=g, dtype=F64) * 2,
        "reward_shift": torch.full((rows,), 0.15, dtype=F64),
    }
    lp = (-torch.rand(rows, width - 1, generator=g, dtype=F64) * 2).requires_grad_()
    return lp, data


def _expected(lp, data, cfg: dict, average=(False, False, False)):
    """(loss, metrics, dloss/dlp) from the formulas, float64, rows interleaved (c, r)."""
    beta, w_pref, w_sft, w_bco = (
        cfg[k] for k in ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight", "bco_loss_weight")
    )
    pref_avg, sft_avg, quality_avg = average
    lp = lp.detach()
    tm, sm, ref = data["token_mask"][:, 1:], data["sample_mask"], data["reference_policy_logprobs"][:, :-1]
    n_tok = tm.sum(-1).clamp(min=1)
    ratio = ((lp - ref) * tm).sum(-1)
    r = ratio / n_tok if pref_avg else ratio
    q = beta * (ratio / n_tok if quality_avg else ratio)
    nll = -(lp * tm * sm[:, None]).sum(-1)
    if sft_avg:
        nll = nll / (tm * sm[:, None]).sum(-1).clamp(min=1)
    delta = data["reward_shift"]
    gp = sm.sum() / 2 + 1e-8
    c, j = slice(0, None, 2), slice(1, None, 2)
    smc, smr = sm[c], sm[j]
    smp = torch.where(smr > 0, smc, 0.0)  # a pair counts by its chosen row when its rejected row is in
    margin = beta * (r[c] - r[j])
    pref = (-torch.nn.functional.logsigmoid(margin) * smp * smp).sum() / gp
    sft = (nll[c] * smc).sum() / gp
    bco_c = -torch.nn.functional.logsigmoid(q[c] - delta[c]) * smc * smc
    bco_r = -torch.nn.functional.logsigmoid(-(q[j] - delta[j])) * smr * smr
    bco = bco_c.sum() / gp + bco_r.sum() / gp
    loss = w_pref * pref + w_sft * sft + w_bco * bco
    metrics = {
        "loss": loss,
        "sft_loss": sft,
        "preference_loss": pref,
        "bco_loss": bco,
        "accuracy": ((r[c] > r[j]).to(F64) * smp).sum() / gp,
        "rewards_chosen_mean": (r[c] * smc).sum() / gp,
        "rewards_rejected_mean": (r[j] * smr).sum() / gp,
        "bco_rewards_chosen_mean": (q[c] * smc).sum() / gp,
        "bco_rewards_rejected_mean": (q[j] * smr).sum() / gp,
        "num_valid_samples": sm.sum() / 2,
        "bco_reward_sum": (q * sm).sum(),
        "bco_reward_count": sm.sum(),
    }
    # the gradient per token: d/dr of each row's terms, times dr/dlp = tm (/ n_tok)
    d_r, d_q, d_nll = torch.zeros_like(r), torch.zeros_like(r), torch.zeros_like(r)
    s = torch.sigmoid(-margin) * smp * smp / gp  # -d logσ(m)/dm
    d_r[c], d_r[j] = -beta * s * w_pref, beta * s * w_pref
    d_q[c] = -torch.sigmoid(-(q[c] - delta[c])) * smc * smc / gp * w_bco
    d_q[j] = torch.sigmoid(q[j] - delta[j]) * smr * smr / gp * w_bco
    d_nll[c] = smc / gp * w_sft
    grad = (d_r / n_tok if pref_avg else d_r)[:, None] * tm
    grad = grad + (beta * d_q / n_tok if quality_avg else beta * d_q)[:, None] * tm
    sft_den = (tm * sm[:, None]).sum(-1).clamp(min=1) if sft_avg else 1.0
    grad = grad - (d_nll / sft_den)[:, None] * tm * sm[:, None]
    return loss, metrics, grad


def _globals(data):
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()


def _assert_metrics(got: dict, want: dict, **tol):
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key].to(F64), want[key].to(F64), msg=key, **tol)


@pytest.mark.parametrize(
    "average",
    [(False, False, False), (True, True, False), (False, True, True)],
    ids=["sums", "pref_sft_averaged", "sft_quality_averaged"],
)
def test_value_metrics_and_gradient_match_the_formulas(average):
    lp, data = _batch()
    cfg = {
        **CFG,
        "preference_average_log_probs": average[0],
        "sft_average_log_probs": average[1],
        "quality_average_log_probs": average[2],
    }
    loss, metrics = MPOLossFn(cfg)(lp, data, *_globals(data))
    want, want_metrics, want_grad = _expected(lp, data, CFG, average)
    torch.testing.assert_close(loss, want)
    _assert_metrics(metrics, want_metrics)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, want_grad)
    assert set(MPOLossFn(cfg).metric_normalizations) == set(metrics)


def test_zero_weights_leave_dpo_and_the_bco_term_alone():
    lp, data = _batch(seed=3)
    gs, gt = _globals(data)
    only_bco, metrics = MPOLossFn({"preference_loss_weight": 0.0, "bco_loss_weight": 1.0})(lp, data, gs, gt)
    torch.testing.assert_close(only_bco, metrics["bco_loss"])
    assert metrics["sft_loss"].item() == 0.0
    shifted = {**data, "reward_shift": data["reward_shift"] + 1.0}  # a larger shift: chosen rows lose, rejected gain
    _, more = MPOLossFn({})(lp, shifted, gs, gt)
    assert more["bco_loss"] != metrics["bco_loss"]
    torch.testing.assert_close(more["preference_loss"], metrics["preference_loss"])


def test_named_pairs_in_any_order_give_the_interleaved_result():
    lp, data = _batch(seed=1)
    order = [3, 0, 2, 1]
    named = {"pair_index": torch.arange(4) // 2, "is_chosen": (torch.arange(4) % 2 == 0).long(), **data}
    named = {k: v[order] for k, v in named.items()}
    shuffled = lp.detach()[order].requires_grad_()
    want, want_metrics = MPOLossFn(CFG)(lp, data, *_globals(data))
    got, got_metrics = MPOLossFn(CFG)(shuffled, named, *_globals(data))
    torch.testing.assert_close(got, want)
    _assert_metrics(got_metrics, want_metrics)
    torch.testing.assert_close(torch.autograd.grad(got, shuffled)[0], torch.autograd.grad(want, lp)[0][order])


def _exact_logits(lp: torch.Tensor, input_ids: torch.Tensor, vocab: int = 9) -> torch.Tensor:
    """`[B, S, V]` logits whose next-token log-prob is `lp` (two finite entries per row)."""
    rows, width = input_ids.shape
    logits = torch.full((rows, width, vocab), -30.0, dtype=F64)
    target = input_ids[:, 1:]
    b, t = torch.meshgrid(torch.arange(rows), torch.arange(width - 1), indexing="ij")
    logits[b, t, target] = 0.0
    logits[b, t, (target + 1) % vocab] = torch.log(torch.expm1(-lp.detach()))
    return logits


_CALL = CompileRecorder("aot_eager")
_COMPILED = _CALL.compile(lambda w, *a: w(*a), fullgraph=True)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
def test_packed_with_bucket_padding_equals_unpacked_and_compiles_once(wrapper_cls):
    lp, data = _batch(seed=2)
    data = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    logits = _exact_logits(lp, data["input_ids"]).float().requires_grad_()
    gs, gt = _globals(data)
    loss_fn = MPOLossFn(CFG)
    want_input, _ = prepare_loss_input(logits, data, loss_fn)
    want, want_metrics = loss_fn(data=data, global_valid_seqs=gs, global_valid_toks=gt, **want_input)
    (want_grad,) = torch.autograd.grad(want, logits)
    lengths = [4, 5, 6, 5]
    cu, cup = boundaries(lengths, [1, 0, 2, 1])
    prepare = prepare_packed_loss_input if wrapper_cls is SequencePackingFusionLossWrapper else prepare_loss_input
    wrapper = wrapper_cls(loss_fn, prepare, cu, cup, bucket=BucketGrid(tokens=32, rows=6, width=8))
    packed = pack_logits(logits.detach(), cu, cup, wrapper.layout.tokens, seed=2)
    before = _CALL.report.compiles
    got, got_metrics = _COMPILED(wrapper, packed, wrapper.layout.pad_data(data), gs, gt)
    _assert_metrics(got_metrics, want_metrics, **close(torch.float32, "compiled"))
    torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad(got, packed)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(grad[0, cup[i] : cup[i] + n], want_grad[i, :n])
    assert _CALL.report.compiles - before == 1 and _CALL.report.problems() == []


def test_pickle_and_deepcopy_give_identical_results():
    lp, data = _batch(seed=4)
    loss_fn = MPOLossFn(CFG)
    want, want_metrics = loss_fn(lp, data, *_globals(data))
    for copied in (pickle.loads(pickle.dumps(loss_fn)), copy.deepcopy(loss_fn)):
        assert copied.cfg == loss_fn.cfg
        got, got_metrics = copied(lp, data, *_globals(data))
        assert torch.equal(got, want)
        assert all(torch.equal(got_metrics[k], want_metrics[k]) for k in want_metrics)


def test_the_driver_ema_over_micro_batches():
    """The summed `bco_reward_sum` / `bco_reward_count` fragments of two micro-batches are the
    whole batch's; `update_reward_shift` is the EMA step, unchanged on an empty batch."""
    lp, data = _batch(rows=8, seed=5)
    gs, gt = _globals(data)
    loss_fn = MPOLossFn(CFG)
    _, whole = loss_fn(lp, data, gs, gt)
    parts = [loss_fn(lp[a:b], {k: v[a:b] for k, v in data.items()}, gs, gt)[1] for a, b in ((0, 4), (4, 8))]
    for key in ("bco_reward_sum", "bco_reward_count", "bco_loss"):
        torch.testing.assert_close(parts[0][key] + parts[1][key], whole[key])
    total, count = float(whole["bco_reward_sum"]), float(whole["bco_reward_count"])
    assert update_reward_shift(0.15, total, count, 0.9) == pytest.approx(0.9 * 0.15 + 0.1 * total / count)
    assert update_reward_shift(0.15, 0.0, 0.0, 0.9) == 0.15


@pytest.mark.parametrize(
    ("cfg", "text"),
    [
        (dict(reward_shift_momentum=1.0), "reward_shift_momentum must be in [0, 1), got 1.0"),
        (dict(reward_shift_momentum=-0.1), "reward_shift_momentum must be in [0, 1), got -0.1"),
        (dict(bco_loss_weight=-1.0), "bco_loss_weight must be finite and >= 0, got -1.0"),
        (dict(reference_policy_kl_penalty=math.nan), "reference_policy_kl_penalty must be finite, got nan"),
        (dict(reward_shift=math.inf), "reward_shift must be finite, got inf"),
        (dict(quality_average_log_probs=1), "quality_average_log_probs must be a bool, got int 1"),
        (
            dict(reward_shift_mom=0.9),
            "MPOLossFn: unknown config keys ['reward_shift_mom']; valid keys: "
            "['bco_loss_weight', 'preference_average_log_probs', 'preference_loss_weight', "
            "'quality_average_log_probs', 'reference_policy_kl_penalty', 'reward_shift', "
            "'reward_shift_momentum', 'sft_average_log_probs', 'sft_loss_weight']",
        ),
    ],
)
def test_config_errors_name_the_field(cfg, text):
    with pytest.raises(ConfigError) as info:
        MPOLossFn(cfg)
    assert str(info.value) == text
    assert isinstance(info.value, AssertionError)


def test_plain_dict_config_and_keyword_only():
    assert MPOLossFn({"bco_loss_weight": 0.5}).cfg == MPOLossConfig(bco_loss_weight=0.5)
    with pytest.raises(TypeError):
        MPOLossConfig(0.1)


def test_bad_inputs_name_the_argument():
    lp, data = _batch()
    gs, gt = _globals(data)
    loss_fn = MPOLossFn(CFG)
    missing = {k: v for k, v in data.items() if k != "reward_shift"}
    assert message(loss_fn, lp, missing, gs, gt).startswith("ValueError: MPOLossFn: data is missing key 'reward_shift'")
    assert message(loss_fn, lp, {**data, "reward_shift": torch.tensor(0.1)}, gs, gt) == (
        "ValueError: MPOLossFn: data['reward_shift'] ([B]) must have shape (4,), got ()"
    )
    assert message(loss_fn, lp[:, :-1], data, gs, gt) == (
        "ValueError: MPOLossFn: next_token_logprobs ([B, S-1]) must have shape (4, 5), got (4, 4)"
    )
    odd = {k: v[:3] for k, v in data.items()}
    assert message(loss_fn, lp[:3], odd, gs, gt) == (
        "ValueError: MPOLossFn: rows must be interleaved (chosen, rejected) pairs, got an odd batch of 3"
    )


def test_hydra_option():
    from compiled_loss.app import compose_config
    from compiled_loss.config import build_loss, loss_family

    cfg = compose_config("loss=mpo", "loss.bco_loss_weight=0.5", "loss.reward_shift_momentum=0.9")
    assert loss_family(cfg.loss) == "dpo"
    assert build_loss(cfg.loss).cfg == MPOLossConfig(bco_loss_weight=0.5, reward_shift_momentum=0.9)
