"""Ports of NeMo-RL's CPU-applicable loss unit tests (behaviour reference §12.1, §12.5).

Every test asserts the reference's numbers (or, where those depend on CUDA RNG, properties
and hand-computed values on small fixed inputs). Conventions (ref §12): `clipped_pg_data`
gives B rows of width S=4 whose token_mask is 1 except column 0, so the three "masked"
positions are `[:, 1:]` and the test denominator is `G_t = sum(token_mask * sample_mask)`.

Deliberate API deviations followed here (see the brief): configs are mappings / frozen
dataclasses, constructor validation raises ValueError, metrics are 0-d tensors, the GSPO
`sampling_importance_ratio` is the newer squeezed value, DistillationLossFn's
`num_valid_samples` is `sum(sample_mask)`, and a TIS ratio without a type behaves as "tis".
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from common import clipped_pg_data, exact_logits
from tolerances import approx, close
from torch.testing import assert_close

from compiled_loss.interfaces import MetricNormalizer
from compiled_loss.loss_functions import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    NLLLossFn,
    calculate_kl,
    masked_mean,
)
from compiled_loss.loss_input import get_distillation_topk_logprobs_from_logits, prepare_loss_input
from compiled_loss.metrics import combine_metrics, metrics_to_python
from compiled_loss.utils import rescale_loss_metrics
from compiled_loss.vocab import vocab_reduce

T, S, N = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE

# The reference tests' base ClippedPG config (β = 0, symmetric 0.2 clip, no IS).
BASE = {
    "reference_policy_kl_penalty": 0.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "disable_ppo_ratio": False,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "token_level_loss": True,
}

# The PPO fixture of test_clipped_pg_loss_ppo_clipping: r = exp(curr - prev) = [0.5, 1, 1.5].
PPO_ADV = [1.0, -1.0, 2.0]
PPO_PREV = [-1.0, -1.0, -1.0]
PPO_CURR = [-1.69315, -1.0, -0.59453]
PPO_GEN = [-0.5, -1.5, -0.8]


def cfg(**overrides):
    return {**BASE, **overrides}


def pg_data(rows=1, width=4, *, adv=None, prev=None, gen=None, ref=None):
    """`clipped_pg_data` with the masked positions `[:, 1:]` filled in (rows broadcast)."""
    data = clipped_pg_data(rows, width)
    for key, values in (
        ("advantages", adv),
        ("prev_logprobs", prev),
        ("generation_logprobs", gen),
        ("reference_policy_logprobs", ref),
    ):
        if values is not None:
            data[key][:, 1:] = torch.as_tensor(values, dtype=torch.float32)
    return data


def leaf(values, rows=None):
    """A grad-carrying float32 leaf (next-token log-probs; `rows` broadcasts one row)."""
    x = torch.as_tensor(values, dtype=torch.float32)
    if rows is not None:
        x = x.expand(rows, -1)
    return x.clone().requires_grad_(True)


def _denominators(data):
    return (
        data["sample_mask"].sum(),
        (data["token_mask"] * data["sample_mask"][:, None]).sum(),
    )


def run_pg(config, lp, data, g_seqs=None, g_toks=None, **fn_kwargs):
    fn = ClippedPGLossFn(config, **fn_kwargs)
    default_seqs, default_toks = _denominators(data)
    loss, metrics = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=default_seqs if g_seqs is None else torch.as_tensor(float(g_seqs)),
        global_valid_toks=default_toks if g_toks is None else torch.as_tensor(float(g_toks)),
    )
    assert loss.dim() == 0
    return loss, metrics_to_python(metrics)


def t(x):
    return torch.as_tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# ClippedPG: PPO / REINFORCE / forced on-policy ratio
# ---------------------------------------------------------------------------------------


def test_clipped_pg_loss_ppo_clipping_through_exact_logits():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    logits = exact_logits(t([PPO_CURR]), data["input_ids"], vocab=8).requires_grad_(True)
    fn = ClippedPGLossFn(cfg())
    loss_input, data = prepare_loss_input(logits, data, fn)
    assert_close(loss_input["next_token_logprobs"], t([PPO_CURR]), **close(torch.float32, "reordered"))
    loss, metrics = fn(data=data, global_valid_seqs=t(1.0), global_valid_toks=t(3.0), **loss_input)
    m = metrics_to_python(metrics)

    ratios = torch.tensor([0.5, 1.0, 1.5])
    clamped = torch.tensor([0.8, 1.0, 1.2])
    adv = t(PPO_ADV)
    per_token = torch.maximum(-adv * ratios, -adv * clamped)
    assert_close(per_token, torch.tensor([-0.5, 1.0, -2.4]))
    assert_close(loss, per_token.mean(), **close(torch.float32, "reordered"))
    assert_close(loss, t(-0.6333), **close(torch.float32, "printed"))
    assert m["probs_ratio"] == approx(1.0, torch.float32, "printed")
    assert m["probs_ratio_clamped"] == approx(1.0, torch.float32, "printed")
    assert m["probs_ratio_min"] == approx(0.5, torch.float32, "printed")
    assert m["probs_ratio_max"] == approx(1.5, torch.float32, "printed")
    assert m["probs_ratio_clamped_min"] == approx(0.8, torch.float32, "same")
    assert m["probs_ratio_clamped_max"] == approx(1.2, torch.float32, "same")
    assert m["num_valid_samples"] == 1.0
    assert m["kl_penalty"] == 0.0
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_clipped_pg_loss_asymmetric_clip():
    # ε_low = 0.1, ε_high = 0.3: bounds [0.9, 1.3] (ref §4.1.1)
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    loss, m = run_pg(cfg(ratio_clip_min=0.1, ratio_clip_max=0.3), leaf([PPO_CURR]), data)
    assert_close(loss, t((-0.5 + 1.0 - 2.6) / 3), **close(torch.float32, "reordered"))
    assert m["probs_ratio_clamped_min"] == approx(0.9, torch.float32, "same")
    assert m["probs_ratio_clamped_max"] == approx(1.3, torch.float32, "same")


def test_clipped_pg_loss_reinforce_mode():
    curr = [-0.5, -1.0, -1.5]
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    lp = leaf([curr])
    loss, m = run_pg(cfg(disable_ppo_ratio=True), lp, data)
    expected = (-t(PPO_ADV) * t(curr)).mean()
    assert_close(loss, expected)
    assert_close(loss, t(0.8333), **close(torch.float32, "printed"))
    # REINFORCE: the "ratios" are the log-probs themselves
    assert m["probs_ratio"] == approx(-1.0, torch.float32, "same")
    assert m["probs_ratio_min"] == pytest.approx(-1.5) and m["probs_ratio_max"] == pytest.approx(-0.5)
    loss.backward()
    assert_close(lp.grad, (-t(PPO_ADV) / 3)[None])


def test_clipped_pg_loss_force_on_policy_ratio():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    lp = leaf([PPO_CURR])
    loss, m = run_pg(cfg(force_on_policy_ratio=True), lp, data)
    assert_close(loss, (-t(PPO_ADV)).mean())
    assert_close(loss, t(-0.6667), **close(torch.float32, "printed"))
    for key in (
        "probs_ratio",
        "probs_ratio_clamped",
        "probs_ratio_min",
        "probs_ratio_max",
        "probs_ratio_clamped_min",
        "probs_ratio_clamped_max",
    ):
        assert m[key] == 1.0, key
    loss.backward()  # ratio ≡ 1 with gradient 1·lp'
    assert_close(lp.grad, (-t(PPO_ADV) / 3)[None])


def test_clipped_pg_loss_force_on_policy_ratio_ignores_prev_logprobs():
    losses = []
    for prev in (-1.0, -10.0):
        data = pg_data(adv=PPO_ADV, prev=[prev] * 3)
        loss, m = run_pg(cfg(force_on_policy_ratio=True), leaf([PPO_CURR]), data)
        assert m["probs_ratio"] == 1.0
        losses.append(loss)
    data = pg_data(adv=PPO_ADV)
    del data["prev_logprobs"]  # never read
    loss, _ = run_pg(cfg(force_on_policy_ratio=True), leaf([PPO_CURR]), data)
    losses.append(loss)
    assert losses[0].item() == losses[1].item() == losses[2].item()
    assert_close(losses[0], t(-2.0 / 3.0))


# ---------------------------------------------------------------------------------------
# CISPO
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"disable_ppo_ratio": True}, "disable_ppo_ratio"),
        ({"force_on_policy_ratio": True}, "force_on_policy_ratio"),
        ({"ratio_clip_c": 3.0}, "ratio_clip_c"),
        (
            {"sequence_level_importance_ratios": True, "token_level_loss": False},
            "sequence_level_importance_ratios",
        ),
    ],
)
def test_clipped_pg_loss_cispo_incompatibility_asserts(overrides, field):
    with pytest.raises(ValueError, match=f"use_cispo=True is incompatible with {field}"):
        ClippedPGLossFn(cfg(use_cispo=True, **overrides))


def test_clipped_pg_loss_cispo():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    lp = leaf([PPO_CURR])
    loss, _ = run_pg(cfg(use_cispo=True), lp, data)
    adv, curr = t(PPO_ADV), t(PPO_CURR)
    r_c = torch.exp(curr - t(PPO_PREV)).clamp(0.8, 1.2)
    assert_close(r_c, torch.tensor([0.8, 1.0, 1.2]), **close(torch.float32, "reordered"))
    expected = (-adv * r_c * curr).mean()
    assert_close(loss, expected, **close(torch.float32, "reordered"))
    assert_close(loss, t(0.593797), **close(torch.float32, "printed_rel"))
    loss.backward()  # the clamped ratio is detached: d/dlp = -A·r_c / G_t
    assert_close(lp.grad, (-adv * r_c / 3)[None], **close(torch.float32, "reordered"))


def test_clipped_pg_loss_cispo_with_importance_sampling_correction():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN)
    loss, m = run_pg(cfg(use_cispo=True, use_importance_sampling_correction=True), leaf([PPO_CURR]), data)
    adv, curr = t(PPO_ADV), t(PPO_CURR)
    r_c = torch.exp(curr - t(PPO_PREV)).clamp(0.8, 1.2)
    w = torch.exp(t(PPO_PREV) - t(PPO_GEN))
    assert_close(w, torch.tensor([0.6065, 1.6487, 0.8187]), **close(torch.float32, "printed"))
    assert_close(loss, (w * (-adv * r_c * curr)).mean(), **close(torch.float32, "reordered"))
    assert m["sampling_importance_ratio"] == approx(w.mean().item(), torch.float32, "reordered")


# ---------------------------------------------------------------------------------------
# calculate_kl / masked_mean
# ---------------------------------------------------------------------------------------

KL_LP = [-1.0, -1.0, -1.0]
KL_REF = [0.0, -15.0, -30.0]


@pytest.mark.parametrize(
    "kl_type, unclamped, clamped",
    [
        ("k1", [-1.0, 14.0, 29.0], [-1.0, 10.0, 10.0]),
        ("k2", [0.5, 98.0, 420.5], [0.5, 10.0, 10.0]),
        ("k3", [0.7183, 13.0, 28.0], [0.7183, 10.0, 10.0]),
    ],
)
def test_calculate_kl(kl_type, unclamped, clamped):
    lp, ref = t(KL_LP), t(KL_REF)
    raw = calculate_kl(lp, ref, kl_type, input_clamp_value=None, output_clamp_value=None)
    assert_close(raw, t(unclamped), **close(torch.float32, "printed_rel"))
    out = calculate_kl(lp, ref, kl_type, input_clamp_value=20.0, output_clamp_value=10.0)
    assert_close(out, t(clamped), **close(torch.float32, "printed_rel"))
    assert_close(calculate_kl(lp, ref, kl_type), out)  # (20, 10) are the defaults


def test_calculate_kl_rejects_unknown_type():
    with pytest.raises(ValueError, match="kl_type"):
        calculate_kl(t([0.0]), t([0.0]), "k4")


def test_calculate_kl_detaches_importance_sampling_when_input_clamped():
    lp = leaf([-3.0, -1.0])
    w = torch.exp(lp - lp.detach())
    kl = calculate_kl(
        lp, torch.zeros(2), "k3", input_clamp_value=2.0, output_clamp_value=None, importance_sampling_weights=w
    )
    assert_close(kl, torch.tensor([4.389056, 0.7182818]))
    kl.sum().backward()
    assert_close(lp.grad, torch.tensor([0.0, -1.0]))


def test_calculate_kl_output_clamp_includes_importance_sampling_weight():
    lp = leaf([-1.0])
    w = 100.0 * torch.exp(lp - lp.detach())
    kl = calculate_kl(lp, torch.zeros(1), "k3", output_clamp_value=1.0, importance_sampling_weights=w)
    assert kl.item() == 1.0
    kl.sum().backward()
    assert lp.grad.item() == 0.0


def test_masked_mean_all_zeros():
    values = torch.ones(2, 3)
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0
    one_hot = torch.zeros(2, 3)
    one_hot[1, 2] = 1.0
    assert masked_mean(values, one_hot).item() == 1.0
    per_row = masked_mean(values, torch.zeros(2, 3), dim=1)
    assert per_row.tolist() == [0.0, 0.0]
    # exact NeMo epsilon: sum / (N + 1e-8), also with a global factor
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    m = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    assert masked_mean(v, m).item() == 4.0 / (2.0 + 1e-8)
    assert masked_mean(v, m, global_normalization_factor=8.0).item() == 4.0 / (8.0 + 1e-8)


# ---------------------------------------------------------------------------------------
# reference KL penalty
# ---------------------------------------------------------------------------------------


def test_clipped_pg_loss_kl_penalty_through_exact_logits():
    curr = [0.0, -1.0, -2.0]
    data = pg_data(adv=[0.0] * 3, prev=[0.0] * 3, ref=[-1.0] * 3)
    logits = exact_logits(t([curr]), data["input_ids"], vocab=8)
    fn = ClippedPGLossFn(cfg(reference_policy_kl_penalty=0.1))
    loss_input, data = prepare_loss_input(logits, data, fn)
    loss, metrics = fn(data=data, global_valid_seqs=t(1.0), global_valid_toks=t(3.0), **loss_input)
    logr = t([-1.0] * 3) - t(curr)
    k3 = torch.exp(logr) - logr - 1
    assert_close(loss, 0.1 * k3.mean(), **close(torch.float32, "reordered"))
    assert_close(loss, t(0.0362), **close(torch.float32, "printed"))
    assert metrics["kl_penalty"].item() == approx(k3.mean().item(), torch.float32, "reordered")


@pytest.mark.parametrize("on_policy", [False, True])
def test_clipped_pg_loss_kl_gradient_includes_sampling_term(on_policy):
    curr, prev, gen, ref, adv = [-1.2, -0.7], [-1.0, -0.8], [-1.5, -0.4], [-0.9, -1.1], [0.4, -0.2]
    data = pg_data(width=3, adv=adv, prev=prev, gen=gen, ref=ref)
    beta = 0.3
    grads = []
    for b in (beta, 0.0):
        lp = leaf([curr])
        loss, _ = run_pg(
            cfg(reference_policy_kl_penalty=b, use_on_policy_kl_approximation=on_policy), lp, data, g_toks=2.0
        )
        loss.backward()
        grads.append(lp.grad[0])
    logr = t(ref) - t(curr)
    kl = torch.exp(logr) - 1 - logr
    w = torch.exp(t(curr) - t(gen)) if on_policy else torch.ones(2)
    expected = beta * w * (kl + 1 - torch.exp(logr)) / 2
    assert_close(grads[0] - grads[1], expected, **close(torch.float32, "reordered"))


def test_clipped_pg_loss_on_policy_kl_importance_sampling():
    # Ref §13.8: the NeMo test's cfg has β = 0, so the expected total is the actor loss.
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN, ref=[-1.0] * 3)
    loss, m = run_pg(
        cfg(use_on_policy_kl_approximation=True, use_importance_sampling_correction=True),
        leaf([PPO_CURR]),
        data,
    )
    adv, curr, prev, gen = t(PPO_ADV), t(PPO_CURR), t(PPO_PREV), t(PPO_GEN)
    w = torch.exp(prev - gen)
    assert_close(w, torch.tensor([0.6065, 1.6487, 0.8187]), **close(torch.float32, "printed"))
    r = torch.exp(curr - prev)
    actor = (w * torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))).mean()
    assert_close(loss, actor, **close(torch.float32, "reordered"))
    assert_close(loss, t(-0.2065), **close(torch.float32, "printed"))
    assert m["kl_penalty"] == 0.0
    assert m["sampling_importance_ratio"] == approx(w.mean().item(), torch.float32, "reordered")


def test_clipped_pg_loss_on_policy_kl_importance_sampling_with_beta():
    beta, ref = 0.1, [-1.2, -0.9, -0.7]
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN, ref=ref)
    lp = leaf([PPO_CURR])
    loss, m = run_pg(
        cfg(
            reference_policy_kl_penalty=beta,
            use_on_policy_kl_approximation=True,
            use_importance_sampling_correction=True,
        ),
        lp,
        data,
    )
    actor = (math.exp(-0.5) * -0.5 + math.exp(0.5) * 1.0 + math.exp(-0.2) * -2.4) / 3  # w_IS · max(-A r, -A r_c)
    kl_terms = []
    for c, g, rf in zip(PPO_CURR, PPO_GEN, ref):
        logr = rf - c
        kl_terms.append(math.exp(c - g) * (math.exp(logr) - 1 - logr))
    kl = sum(kl_terms) / 3
    assert_close(loss, t(actor + beta * kl), **close(torch.float32, "reordered"))
    assert m["kl_penalty"] == approx(kl, torch.float32, "reordered")


# ---------------------------------------------------------------------------------------
# masking
# ---------------------------------------------------------------------------------------


def _random_pg(rows=2, width=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = clipped_pg_data(rows, width)
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = -torch.rand(rows, width, generator=g) * 2
    data["advantages"] = torch.randn(rows, width, generator=g)
    lp = -torch.rand(rows, width - 1, generator=g) * 2
    return data, lp


def test_clipped_pg_loss_masking():
    data, lp0 = _random_pg()
    adv, prev = data["advantages"][:, 1:], data["prev_logprobs"][:, 1:]
    r = torch.exp(lp0 - prev)
    per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    g_toks = 8.0

    loss, _ = run_pg(cfg(), leaf(lp0), data, g_toks=g_toks)
    assert_close(loss, per_token.sum() / g_toks, **close(torch.float32, "reordered"))

    masked = {k: v.clone() for k, v in data.items()}
    masked["token_mask"][0, 2] = 0  # next-token position 1 of row 0
    loss_masked, _ = run_pg(cfg(), leaf(lp0), masked, g_toks=g_toks)
    assert abs(loss_masked.item() - loss.item()) > 1e-4
    assert_close(loss - loss_masked, per_token[0, 1] / g_toks, **close(torch.float32, "reordered"))

    # sample_mask = [1, 0] equals running on row 0 alone (with β ≠ 0 too)
    for beta in (0.0, 0.1):
        c = cfg(reference_policy_kl_penalty=beta)
        half = {k: v.clone() for k, v in data.items()}
        half["sample_mask"] = torch.tensor([1.0, 0.0])
        loss_half, m_half = run_pg(c, leaf(lp0), half, g_seqs=1.0, g_toks=4.0)
        row0 = {k: v[:1].clone() for k, v in data.items()}
        loss_row0, m_row0 = run_pg(c, leaf(lp0[:1]), row0, g_seqs=1.0, g_toks=4.0)
        assert_close(loss_half, loss_row0)
        assert m_half == pytest.approx(m_row0)
        if beta == 0.0:
            assert_close(loss_half, per_token[0].sum() / 4.0, **close(torch.float32, "reordered"))


def test_clipped_pg_loss_zero_mask():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN, ref=[-2.0] * 3)
    data["token_mask"].zero_()
    lp = leaf([PPO_CURR])
    loss, m = run_pg(cfg(reference_policy_kl_penalty=0.1), lp, data)  # G_t = 0
    assert loss.item() == 0.0
    assert m["probs_ratio_min"] == math.inf and m["probs_ratio_clamped_min"] == math.inf
    assert m["probs_ratio_max"] == -math.inf and m["probs_ratio_clamped_max"] == -math.inf
    assert m["probs_ratio"] == 0.0 and m["kl_penalty"] == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))


# ---------------------------------------------------------------------------------------
# truncated importance sampling (tis / icepop / seq-mask-tis)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sequence_level", [False, True])
def test_clipped_pg_loss_on_policy_truncated_importance_sampling(sequence_level):
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN)
    c = cfg(
        use_on_policy_kl_approximation=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=0.8,
    )
    if sequence_level:
        c.update(sequence_level_importance_ratios=True, token_level_loss=False)
    loss, m = run_pg(c, leaf([PPO_CURR]), data)
    adv = t(PPO_ADV)
    if not sequence_level:
        w = torch.exp(t(PPO_PREV) - t(PPO_GEN)).clamp(max=0.8)
        r = torch.exp(t(PPO_CURR) - t(PPO_PREV))
        expected = (w * torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))).mean()
        assert_close(loss, expected, **close(torch.float32, "reordered"))
        assert_close(loss, t(-0.4744), **close(torch.float32, "printed"))
        assert m["is_oob_ratio"] == pytest.approx(2.0 / 3.0)  # 1.6487, 0.8187 > 0.8
    else:
        seq_ratio = math.exp((math.log(0.5) + 0.0 + math.log(1.5)) / 3)
        assert seq_ratio == approx(0.9086, torch.float32, "printed")
        assert m["probs_ratio"] == approx(seq_ratio, torch.float32, "reordered")
        seq_is = math.exp(-0.2)
        assert seq_is == approx(0.8187, torch.float32, "printed")
        expected = min(seq_is, 0.8) * (-seq_ratio * sum(PPO_ADV) / 3)
        assert_close(loss, t(expected), **close(torch.float32, "reordered"))
        assert_close(loss, t(-0.4846), **close(torch.float32, "printed"))
        assert m["sampling_importance_ratio"] == approx(0.8, torch.float32, "reordered")
        # TOKENS-normalised: the [B, 1] sequence weight is out of bounds on all 3 tokens
        assert m["is_oob_ratio"] == pytest.approx(1.0)


def test_clipped_pg_loss_icepop_importance_sampling():
    gen = [-0.5, -3.5, -0.8]
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=gen)
    c = cfg(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=5.0,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, m = run_pg(c, leaf([PPO_PREV]), data)  # ratio 1
    raw = torch.exp(t(PPO_PREV) - t(gen))
    assert_close(raw, torch.tensor([0.6065, 12.1825, 0.8187]), **close(torch.float32, "printed"))
    w = torch.tensor([math.exp(-0.5), 0.0, math.exp(-0.2)])
    assert_close(loss, (w * -t(PPO_ADV)).mean(), **close(torch.float32, "reordered"))
    assert m["is_oob_ratio"] == pytest.approx(1.0 / 3.0)
    assert m["sampling_importance_ratio"] == approx(w.mean().item(), torch.float32, "reordered")


def test_clipped_pg_loss_reports_is_oob_ratio_tis():
    prev = [0.0, math.log(3.0), math.log(0.5)]
    data = pg_data(adv=PPO_ADV, prev=prev, gen=[0.0] * 3)
    c = cfg(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )
    _, m = run_pg(c, leaf([prev]), data)
    assert m["is_oob_ratio"] == pytest.approx(1.0 / 3.0)
    assert m["sampling_importance_ratio"] == approx((1.0 + 2.0 + 0.5) / 3, torch.float32, "reordered")


def test_tis_ratio_without_type_behaves_as_tis():
    prev = [0.0, math.log(3.0), math.log(0.5)]
    data = pg_data(adv=PPO_ADV, prev=prev, gen=[0.0] * 3)
    base = dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0)
    loss_none, m_none = run_pg(cfg(**base), leaf([prev]), data)
    loss_tis, m_tis = run_pg(cfg(truncated_importance_sampling_type="tis", **base), leaf([prev]), data)
    assert loss_none.item() == loss_tis.item()
    assert m_none == m_tis
    assert m_none["is_oob_ratio"] == pytest.approx(1.0 / 3.0)
    assert_close(loss_none, (t([1.0, 2.0, 0.5]) * -t(PPO_ADV)).mean())
    assert ClippedPGLossFn(cfg(**base)).metric_normalizations["is_oob_ratio"] == T


@pytest.mark.parametrize("tis_type", ["tis", "icepop", "seq-mask-tis"])
def test_clipped_pg_loss_rejects_tis_min_above_max(tis_type):
    msg = "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ClippedPGLossFn(
            cfg(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type=tis_type,
                truncated_importance_sampling_ratio=1.0,
                truncated_importance_sampling_ratio_min=2.0,
            )
        )


@pytest.mark.parametrize(
    "ratio_min, weights, oob",
    [(None, [0.1, 1.0, 2.0], 1.0 / 3.0), (0.5, [0.5, 1.0, 2.0], 2.0 / 3.0)],
)
def test_clipped_pg_loss_tis_min_bound_defaults_to_zero(ratio_min, weights, oob):
    data = pg_data(adv=[1.0] * 3, gen=[0.0] * 3)
    c = cfg(
        force_on_policy_ratio=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=ratio_min,
    )
    lp = leaf([[math.log(0.1), 0.0, math.log(3.0)]])
    loss, m = run_pg(c, lp, data)
    assert_close(loss, -t(weights).mean(), **close(torch.float32, "reordered"))
    assert m["is_oob_ratio"] == pytest.approx(oob)
    assert m["sampling_importance_ratio"] == approx(sum(weights) / 3, torch.float32, "reordered")


def test_clipped_pg_loss_seq_mask_tis():
    c = cfg(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.002,
        truncated_importance_sampling_ratio_min=0.999,
    )
    adv = t(PPO_ADV)
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=[-1.0005] * 3)
    loss, m = run_pg(c, leaf([PPO_PREV]), data)  # ratio 1
    assert math.exp(0.0005) == approx(1.0005, torch.float32, "same")  # geometric mean, kept
    assert_close(loss, (math.exp(0.0005) * -adv).mean(), **close(torch.float32, "reordered"))
    assert m["is_oob_ratio"] == 0.0

    # -inf generation log-prob: token weight nan_to_num'd to 0, log-ratio zeroed in the mean
    data["generation_logprobs"][0, 1] = -math.inf
    loss_inf, m_inf = run_pg(c, leaf([PPO_PREV]), data)
    assert torch.isfinite(loss_inf)
    expected = (0.0 * -1.0 + math.exp(0.0005) * 1.0 + math.exp(0.0005) * -2.0) / 3
    assert_close(loss_inf, t(expected), **close(torch.float32, "reordered"))
    assert m_inf["is_oob_ratio"] == 0.0

    # geometric mean 1.01 > 1.002: the whole sequence is masked
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=[-1.01] * 3)
    loss_out, m_out = run_pg(c, leaf([PPO_PREV]), data)
    assert loss_out.item() == 0.0
    assert m_out["is_oob_ratio"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------
# dual clip, entropy, GSPO
# ---------------------------------------------------------------------------------------


def test_clipped_pg_loss_dual_clip():
    adv, prev = [1.0, -1.0, -4.0], [-1.0, -1.0, -3.0]
    ratios = [0.5, 1.0, 10.0]
    curr = [p + math.log(r) for p, r in zip(prev, ratios)]
    data = pg_data(adv=adv, prev=prev)
    lp = leaf([curr])
    loss, m = run_pg(cfg(ratio_clip_c=3.0), lp, data)
    clip_loss = [-0.5, 1.0, 12.0]  # max(40, 4.8) = 40 → min(40, 4·3) = 12
    assert_close(loss, t(sum(clip_loss) / 3), **close(torch.float32, "reordered"))
    assert_close(loss, t(4.1667), **close(torch.float32, "printed"))
    assert m["probs_ratio_max"] == approx(10.0, torch.float32, "reordered")
    loss.backward()  # token 0: -A·r wins (unclipped); token 1: tie; token 2: dual-clipped constant
    assert_close(lp.grad, torch.tensor([[-0.5 / 3, 1.0 / 3, 0.0]]), **close(torch.float32, "reordered"))


def test_clipped_pg_loss_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLossFn(cfg(ratio_clip_c=1.0))


def test_clipped_pg_loss_entropy():
    curr, gen = [-0.5, -1.0, -1.5], [-0.6, -1.1, -1.6]
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=gen)
    _, m = run_pg(cfg(), leaf([curr]), data)
    expected = -(torch.exp(t(curr) - t(gen)) * t(curr)).mean()
    assert m["approx_entropy"] == approx(expected.item(), torch.float32, "reordered")
    assert m["approx_entropy"] == approx(math.exp(0.1), torch.float32, "reordered")


def test_clipped_pg_loss_diagnostic_metrics():
    # ref §4.1.5 step 1, hand-computed on the PPO fixture with generation log-probs
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN)
    _, m = run_pg(cfg(), leaf([PPO_CURR]), data)
    d = [p - g for p, g in zip(PPO_PREV, PPO_GEN)]  # prev - gen = [-0.5, 0.5, -0.2]
    assert m["token_mult_prob_error"] == approx(sum(math.exp(abs(x)) for x in d) / 3, torch.float32, "reordered")
    # gen_kl_error: k3 with logr = prev - gen; policy_kl_error: k3 with logr = gen - prev
    assert m["gen_kl_error"] == approx(sum(math.exp(x) - 1 - x for x in d) / 3, torch.float32, "reordered")
    assert m["policy_kl_error"] == approx(sum(math.exp(-x) - 1 + x for x in d) / 3, torch.float32, "reordered")
    js = 0.0
    for p, g in zip(PPO_PREV, PPO_GEN):
        log_m = math.log(0.5 * math.exp(p) + 0.5 * math.exp(g))
        a, b = p - log_m, g - log_m
        js += 0.5 * (math.exp(a) - a - 1) + 0.5 * (math.exp(b) - b - 1)
    assert m["js_divergence_error"] == approx(js / 3, torch.float32, "reordered")
    assert m["positive_nll_loss"] == 0.0


GSPO = dict(sequence_level_importance_ratios=True, token_level_loss=False)


def test_clipped_pg_loss_gspo():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV)
    loss, m = run_pg(cfg(**GSPO), leaf([PPO_CURR]), data)
    seq_ratio = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    assert seq_ratio == approx(0.9086, torch.float32, "printed")
    for key in ("probs_ratio", "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped"):
        assert m[key] == approx(seq_ratio, torch.float32, "reordered")
    assert_close(loss, t(-seq_ratio * 2 / 3), **close(torch.float32, "reordered"))
    assert_close(loss, t(-0.6057), **close(torch.float32, "printed"))
    # squeezed (newer) sampling_importance_ratio: Σ w·sm / G_s, w = exp(Σ (prev - gen)) = e^-3
    assert m["sampling_importance_ratio"] == approx(math.exp(-3.0), torch.float32, "reordered")


def test_clipped_pg_loss_gspo_batch_size_2():
    data = pg_data(rows=2, adv=PPO_ADV)
    data["prev_logprobs"][0, 1:] = -1.0
    data["prev_logprobs"][1, 1:] = -2.0
    loss, m = run_pg(cfg(**GSPO), leaf([PPO_CURR], rows=2), data)
    r0 = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    r1 = math.exp(sum(c + 2.0 for c in PPO_CURR) / 3)
    assert r1 == approx(2.4697, torch.float32, "printed")
    row0 = -r0 * 2 / 3
    row1 = (-1.2 + r1 - 2.4) / 3  # r1 clipped to 1.2 where A > 0
    assert_close(loss, t((row0 + row1) / 2), **close(torch.float32, "reordered"))
    assert_close(loss, t(-0.4912), **close(torch.float32, "printed"))
    assert m["probs_ratio_clamped_max"] == approx(1.2, torch.float32, "same")
    # newer squeezed semantics: Σ_i w_i sm_i / G_s (older release: (Σw)(Σsm)/G_s)
    expected_sir = (math.exp(-3.0) + math.exp(-6.0)) / 2
    assert m["sampling_importance_ratio"] == approx(expected_sir, torch.float32, "reordered")


def test_clipped_pg_loss_gspo_importance_sampling_correction():
    data = pg_data(adv=PPO_ADV, prev=PPO_PREV, gen=PPO_GEN)
    loss, m = run_pg(cfg(use_importance_sampling_correction=True, **GSPO), leaf([PPO_CURR]), data)
    seq_ratio = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    seq_is = math.exp(-0.2)
    assert_close(loss, t(seq_is * -seq_ratio * 2 / 3), **close(torch.float32, "reordered"))
    assert_close(loss, t(-0.4959), **close(torch.float32, "printed"))
    assert m["sampling_importance_ratio"] == approx(seq_is, torch.float32, "reordered")


def test_gspo_requires_sequence_level_loss():
    with pytest.raises(ValueError, match="token_level_loss=False"):
        ClippedPGLossFn(cfg(sequence_level_importance_ratios=True))


# ---------------------------------------------------------------------------------------
# NLL / DPO
# ---------------------------------------------------------------------------------------


def test_nll_loss():
    vocab = 8
    data = {
        "input_ids": torch.tensor([[0, 1, 2, 3]]),
        "token_mask": torch.tensor([[0.0, 0.0, 1.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
    }
    g_toks = (data["token_mask"] * data["sample_mask"][:, None]).sum()
    fn = NLLLossFn()
    right = torch.zeros(1, 4, vocab)
    wrong = torch.zeros(1, 4, vocab)
    for pos in range(3):
        right[0, pos, pos + 1] = 999.0
        wrong[0, pos, (pos + 2) % vocab] = 999.0
    loss_input, d = prepare_loss_input(right, data, fn)
    loss, m = fn(data=d, global_valid_seqs=t(1.0), global_valid_toks=g_toks, **loss_input)
    assert_close(loss, t(0.0), **close(torch.float32, "same"))
    assert m["num_unmasked_tokens"].item() == 2
    assert m["num_valid_samples"].item() == 1
    loss_input, d = prepare_loss_input(wrong, data, fn)
    loss, m = fn(data=d, global_valid_seqs=t(1.0), global_valid_toks=g_toks, **loss_input)
    assert_close(loss, t(999.0))
    assert m["loss"].item() == pytest.approx(999.0)


def _dpo_data(rows, width, token_mask):
    return {
        "input_ids": torch.arange(rows * width).reshape(rows, width) % 7,
        "token_mask": torch.as_tensor(token_mask, dtype=torch.float32),
        "sample_mask": torch.ones(rows),
        "reference_policy_logprobs": torch.zeros(rows, width),
    }


def _run_dpo(config, logits, data):
    fn = DPOLossFn(config)
    loss_input, d = prepare_loss_input(logits, data, fn)
    g_seqs, g_toks = _denominators(d)
    loss, metrics = fn(data=d, global_valid_seqs=g_seqs, global_valid_toks=g_toks, **loss_input)
    return loss, metrics_to_python(metrics)


def test_dpo_loss():
    vocab = 16
    data = _dpo_data(2, 4, [[0, 0, 1, 1], [0, 0, 1, 1]])
    logits = torch.zeros(2, 4, vocab)
    base = {
        "reference_policy_kl_penalty": 0.0,
        "preference_loss_weight": 1.0,
        "sft_loss_weight": 0.0,
        "preference_average_log_probs": False,
        "sft_average_log_probs": False,
    }
    loss, m = _run_dpo(base, logits, data)
    assert_close(loss, t(-torch.nn.functional.logsigmoid(torch.tensor(0.0)).item()))
    assert_close(loss, t(math.log(2.0)))
    assert m["accuracy"] == 0.0 and m["sft_loss"] == 0.0 and m["num_valid_samples"] == 1.0

    loss, m = _run_dpo({**base, "sft_loss_weight": 0.5}, logits, data)
    assert_close(loss, t(0.5 * (2 * math.log(16.0)) + math.log(2.0)))
    assert m["sft_loss"] == approx(2 * math.log(16.0), torch.float32, "same")
    assert m["preference_loss"] == approx(math.log(2.0), torch.float32, "same")

    # a fragment of a larger global batch: every term is normalised by G_s / 2
    fn = DPOLossFn({**base, "sft_loss_weight": 0.5})
    loss_input, d = prepare_loss_input(logits, data, fn)
    frag, fm = fn(data=d, global_valid_seqs=t(8.0), global_valid_toks=t(16.0), **loss_input)
    assert_close(frag, t((0.5 * (2 * math.log(16.0)) + math.log(2.0)) / 4))
    assert fm["sft_loss"].item() == approx(2 * math.log(16.0) / 4, torch.float32, "same")
    assert fm["num_valid_samples"].item() == 1.0


def test_dpo_preference_average_and_pre_rolled_reference():
    vocab, ln_v = 16, math.log(16.0)
    data = _dpo_data(2, 4, [[0, 0, 1, 1], [0, 0, 0, 1]])  # chosen 2 tokens, rejected 1
    logits = torch.zeros(2, 4, vocab)
    base = {"reference_policy_kl_penalty": 0.1, "preference_loss_weight": 1.0, "sft_loss_weight": 0.0}
    # summed rewards: chosen -2 ln16, rejected -ln16
    loss, m = _run_dpo({**base, "preference_average_log_probs": False}, logits, data)
    assert_close(loss, t(math.log1p(math.exp(0.1 * ln_v))))  # -logsigmoid(-0.1 ln16)
    assert (m["rewards_chosen_mean"], m["rewards_rejected_mean"]) == pytest.approx((-2 * ln_v, -ln_v))
    # averaged rewards: both -ln16 → ln 2
    loss, m = _run_dpo({**base, "preference_average_log_probs": True}, logits, data)
    assert_close(loss, t(math.log(2.0)))
    assert (m["rewards_chosen_mean"], m["rewards_rejected_mean"]) == pytest.approx((-ln_v, -ln_v))
    # the reference log-probs are pre-rolled by the driver: entry t scores token t+1
    data["reference_policy_logprobs"] = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0, -8.0]])
    loss, m = _run_dpo({**base, "preference_average_log_probs": False}, logits, data)
    chosen = (-ln_v + 2.0) + (-ln_v + 3.0)  # next-token positions 1, 2 → ref[:, 1], ref[:, 2]
    rejected = -ln_v + 7.0  # position 2 → ref[1, 2]
    assert (m["rewards_chosen_mean"], m["rewards_rejected_mean"]) == pytest.approx((chosen, rejected))
    assert_close(loss, t(math.log1p(math.exp(-0.1 * (chosen - rejected)))))
    assert m["accuracy"] == 0.0


@pytest.mark.parametrize("average", [False, True])
def test_dpo_loss_varying_sequence_lengths(average):
    vocab, lengths, width = 10, [3, 5, 4, 6], 6
    token_mask = [[1.0 if j < n else 0.0 for j in range(width)] for n in lengths]
    data = _dpo_data(4, width, token_mask)
    logits = torch.zeros(4, width, vocab)
    config = {
        "reference_policy_kl_penalty": 0.1,
        "preference_loss_weight": 1.0,
        "sft_loss_weight": 0.5,
        "preference_average_log_probs": False,
        "sft_average_log_probs": average,
    }
    loss, m = _run_dpo(config, logits, data)
    ln_v = math.log(vocab)
    counts = [n - 1 for n in lengths]  # next-token positions per row
    chosen = counts[::2]
    if average:  # == total / num chosen tokens: uniform log-probs
        sft = sum(c * ln_v for c in chosen) / sum(chosen)
    else:  # mean over chosen rows of per-row token sums
        sft = sum(c * ln_v for c in chosen) / len(chosen)
    assert m["sft_loss"] == approx(sft, torch.float32, "reordered")
    rewards = [-c * ln_v for c in counts]
    pref = sum(-math.log(1.0 / (1.0 + math.exp(-0.1 * (rewards[i] - rewards[i + 1])))) for i in (0, 2)) / 2
    assert m["preference_loss"] == approx(pref, torch.float32, "reordered")
    assert m["accuracy"] == 1.0
    assert m["rewards_chosen_mean"] == approx((rewards[0] + rewards[2]) / 2, torch.float32, "reordered")
    assert m["rewards_rejected_mean"] == approx((rewards[1] + rewards[3]) / 2, torch.float32, "reordered")
    assert_close(loss, t(0.5 * sft + pref), **close(torch.float32, "reordered"))
    assert m["num_valid_samples"] == 2.0


def test_dpo_sft_matches_nll_loss():
    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 4, 5, 11
    logits = torch.randn(rows, width, vocab, generator=g)
    token_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.float32)
    data = _dpo_data(rows, width, token_mask)
    data["input_ids"] = torch.randint(0, vocab, (rows, width), generator=g)
    config = {"reference_policy_kl_penalty": 0.1, "preference_loss_weight": 0.0, "sft_loss_weight": 1.0}
    dpo_loss, _ = _run_dpo(config, logits, data)

    sm_chosen = data["sample_mask"][::2]
    odd_den = (sm_chosen * data["token_mask"][::2].sum(-1)).sum()
    chosen = {k: v[::2] for k, v in data.items()}
    nll = NLLLossFn()
    loss_input, d = prepare_loss_input(logits[::2], chosen, nll)
    nll_loss, _ = nll(data=d, global_valid_seqs=sm_chosen.sum(), global_valid_toks=odd_den, **loss_input)
    assert_close(dpo_loss * sm_chosen.sum() / odd_den, nll_loss, **close(torch.float32, "reordered"))
    # and the hand value: total chosen NLL over the odd denominator
    lp = torch.log_softmax(logits[::2], -1)[:, :-1].gather(-1, chosen["input_ids"][:, 1:, None])[..., 0]
    expected = -(lp * chosen["token_mask"][:, 1:]).sum() / odd_den
    assert_close(nll_loss, expected, **close(torch.float32, "reordered"))


# ---------------------------------------------------------------------------------------
# Top-k distillation (CUDA-RNG numbers replaced by hand-computed values and properties)
# ---------------------------------------------------------------------------------------


def ref_distillation(student_logits, teacher_topk_logits, idx, kl_type, w, zero_outside, mask, g_toks):
    """Independent float64 formula for DistillationLossFn∘prepare (ref §4.5, §8.9)."""
    x = student_logits.double()
    full = torch.log_softmax(x, -1)
    if zero_outside:
        s = full.gather(-1, idx)
    else:
        s = torch.log_softmax(x.gather(-1, idx), -1)
    tt = torch.log_softmax(teacher_topk_logits.double(), -1)
    s, tt = s[:, :-1], tt[:, :-1]
    ps, pt = s.exp(), tt.exp()
    fwd = (pt * (tt - s)).sum(-1)
    rev = (ps * (s - tt)).sum(-1)
    per = {"forward": fwd, "reverse": rev, "mixed": w * fwd + (1 - w) * rev}[kl_type]
    if zero_outside and kl_type != "forward":
        h_all = (full.exp() * full).sum(-1)[:, :-1]
        corr = (h_all - (ps * s).sum(-1)) + 100.0 * (1 - ps.sum(-1))
        per = per + (corr * (1 - w) if kl_type == "mixed" else corr)
    return (per * mask).sum() / g_toks


def _distill_inputs(rows=2, width=4, vocab=8, k=3, seed=42, distinct=True):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, width, vocab, generator=g)
    teacher_logits = torch.randn(rows, width, k, generator=g)
    if distinct:
        idx = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(rows * width)])
        idx = idx.reshape(rows, width, k)
    else:
        idx = torch.randint(0, vocab, (rows, width, k), generator=g)
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width), generator=g),
        "token_mask": torch.ones(rows, width),
        "sample_mask": torch.ones(rows),
        "teacher_topk_logits": teacher_logits,
        "teacher_topk_indices": idx,
    }
    return student, data


def _run_distill(config, student, data, g_toks=None):
    fn = DistillationLossFn(config)
    loss_input, d = prepare_loss_input(student, data, fn)
    if g_toks is None:  # the reference test's denominator: Σ token_mask·sample_mask (incl. col 0)
        g_toks = (d["token_mask"] * d["sample_mask"][:, None]).sum()
    loss, metrics = fn(data=d, global_valid_seqs=d["sample_mask"].sum(), global_valid_toks=g_toks, **loss_input)
    return loss, metrics, g_toks


def _distill_mask(data):
    return data["token_mask"][:, 1:] * data["sample_mask"][:, None]


def test_distillation_loss_hand_computed_single_token():
    # V = 3 uniform student, teacher top-2 indices [0, 1] with probabilities [1/4, 3/4].
    student = torch.zeros(1, 2, 3)
    data = {
        "input_ids": torch.tensor([[0, 1]]),
        "token_mask": torch.tensor([[0.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "teacher_topk_logits": torch.tensor([[[0.0, math.log(3.0)]] * 2]),
        "teacher_topk_indices": torch.tensor([[[0, 1]] * 2]),
    }
    w = 0.3
    fwd_k = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    rev_k = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    fwd_zo = 0.25 * math.log(0.25 / (1 / 3)) + 0.75 * math.log(0.75 / (1 / 3))
    # reverse KL against a teacher with log-prob -100 on the non-top-k token
    rev_zo = (math.log((1 / 3) / 0.25) + math.log((1 / 3) / 0.75) + math.log(1 / 3) + 100.0) / 3
    expected = {
        ("forward", False): fwd_k,
        ("reverse", False): rev_k,
        ("mixed", False): w * fwd_k + (1 - w) * rev_k,
        ("forward", True): fwd_zo,
        ("reverse", True): rev_zo,
        ("mixed", True): w * fwd_zo + (1 - w) * rev_zo,
    }
    for (kl_type, zo), value in expected.items():
        config = {"kl_type": kl_type, "mixed_kl_weight": w, "zero_outside_topk": zo}
        loss, metrics, _ = _run_distill(config, student, data, g_toks=t(1.0))
        assert_close(loss, t(value), **close(torch.float32, "reordered"), msg=f"{kl_type} zero_outside={zo}")
        assert metrics["loss"].item() == approx(value, torch.float32, "reordered")


@pytest.mark.parametrize("zero_outside", [True, False])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_distillation_loss_different_settings(kl_type, zero_outside):
    student, data = _distill_inputs(k=3)
    config = {"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero_outside}
    loss, metrics, g_toks = _run_distill(config, student, data)
    assert g_toks.item() == 8.0
    expected = ref_distillation(
        student,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        kl_type,
        0.3,
        zero_outside,
        _distill_mask(data),
        8.0,
    )
    assert_close(loss, expected.float(), **close(torch.float32, "reordered"))
    assert loss.dim() == 0 and torch.isfinite(loss)
    if not zero_outside:  # KL between two k-point distributions
        assert loss.item() >= 0.0
    m = metrics_to_python(metrics)
    assert m["num_valid_samples"] == 2.0


def test_distillation_zero_outside_forward_bounds_renormalised_forward():
    # distinct indices: full-vocab student log-probs ≤ renormalised ones ⇒ fwd_zo ≥ fwd ≥ 0
    student, data = _distill_inputs(k=3)
    fwd_zo, _, _ = _run_distill({"kl_type": "forward", "zero_outside_topk": True}, student, data)
    fwd, _, _ = _run_distill({"kl_type": "forward", "zero_outside_topk": False}, student, data)
    assert fwd_zo.item() >= fwd.item() >= 0.0


def test_distillation_duplicated_indices_make_zero_outside_reverse_negative():
    # ref §4.5: duplicated teacher indices ⇒ Σ ps > 1, P_rest < 0 ⇒ strongly negative losses
    student, data = _distill_inputs(k=64, distinct=False)
    for kl_type in ("reverse", "mixed"):
        config = {"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": True}
        loss, _, _ = _run_distill(config, student, data)
        expected = ref_distillation(
            student,
            data["teacher_topk_logits"],
            data["teacher_topk_indices"],
            kl_type,
            0.3,
            True,
            _distill_mask(data),
            8.0,
        )
        assert_close(loss, expected.float(), **close(torch.float32, "reordered"))
        assert loss.item() < -100.0


@pytest.mark.parametrize("zero_outside", [True, False])
@pytest.mark.parametrize("k", [1, 32, 64, 1_000_000])
def test_distillation_loss_topk_filtering(k, zero_outside):
    student, data = _distill_inputs(k=k, distinct=False)
    config = {"kl_type": "mixed", "mixed_kl_weight": 0.3, "zero_outside_topk": zero_outside}
    loss, _, _ = _run_distill(config, student, data)
    assert loss.dim() == 0 and torch.isfinite(loss)
    expected = ref_distillation(
        student,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        "mixed",
        0.3,
        zero_outside,
        _distill_mask(data),
        8.0,
    )
    assert_close(loss, expected.float(), **close(torch.float32, "reordered"))
    if k == 1 and not zero_outside:
        assert loss.item() == 0.0  # both distributions are a single point
    if k >= 32:
        assert abs(loss.item()) > 1e-3


def test_distillation_loss_invalid_k_zero():
    student, data = _distill_inputs(k=3)
    data["teacher_topk_logits"] = data["teacher_topk_logits"][..., :0]
    data["teacher_topk_indices"] = data["teacher_topk_indices"][..., :0]
    fn = DistillationLossFn({"kl_type": "forward"})
    with pytest.raises(ValueError, match="topk must be positive"):
        prepare_loss_input(student, data, fn)


@pytest.mark.parametrize("kl_type, zero_outside", [("mixed", True), ("reverse", False)])
def test_distillation_loss_gradient_flow(kl_type, zero_outside):
    student, data = _distill_inputs(k=3)
    student = student.requires_grad_(True)
    config = {"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero_outside}
    loss, _, _ = _run_distill(config, student, data)
    loss.backward()
    assert student.grad is not None and student.grad.abs().sum().item() > 1e-3
    x = student.detach().double().requires_grad_(True)
    ref = ref_distillation(
        x,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        kl_type,
        0.3,
        zero_outside,
        _distill_mask(data),
        8.0,
    )
    ref.backward()
    assert_close(student.grad, x.grad.float(), **close(torch.float32, "reordered"))
    assert student.grad[:, -1].abs().sum().item() == 0.0  # last position predicts nothing


@pytest.mark.parametrize("value", [0.0, 100.0, -100.0])
@pytest.mark.parametrize("kl_type, zero_outside", [("forward", False), ("mixed", True), ("reverse", True)])
def test_distillation_loss_edge_cases(value, kl_type, zero_outside):
    student, data = _distill_inputs(k=3)
    student = torch.full_like(student, value)
    data["teacher_topk_logits"] = torch.full_like(data["teacher_topk_logits"], value)
    config = {"kl_type": kl_type, "mixed_kl_weight": 0.5, "zero_outside_topk": zero_outside}
    loss, _, _ = _run_distill(config, student, data)
    assert torch.isfinite(loss)
    # constant logits: student uniform over V = 8, teacher uniform over k = 3 (6 positions / 8)
    vocab, k = 8, 3
    if not zero_outside:
        per = 0.0
    else:
        fwd = math.log(vocab / k)
        rev = (k / vocab) * math.log(k / vocab) + (-math.log(vocab)) * (1 - k / vocab) + 100.0 * (1 - k / vocab)
        per = {"forward": fwd, "reverse": rev, "mixed": 0.5 * fwd + 0.5 * rev}[kl_type]
    tol = close(torch.float32, "reordered")  # terms of size |value| cancel: the error is relative to them
    assert_close(loss, t(per * 6 / 8), rtol=tol["rtol"], atol=tol["rtol"] * max(1.0, abs(value)))


def test_distillation_loss_fn_initialization():
    fn = DistillationLossFn({"kl_type": "reverse", "mixed_kl_weight": 0.2, "zero_outside_topk": True})
    assert (fn.kl_type, fn.mixed_kl_weight, fn.zero_outside_topk) == ("reverse", 0.2, True)
    assert fn.log_infinitesimal == -100.0
    default = DistillationLossFn({})
    assert (default.kl_type, default.mixed_kl_weight, default.zero_outside_topk) == ("mixed", 0.5, False)
    with pytest.raises(ValueError, match="kl_type"):
        DistillationLossFn({"kl_type": "js"})
    with pytest.raises(ValueError, match="mixed_kl_weight"):
        DistillationLossFn({"mixed_kl_weight": 1.5})


def test_distillation_loss_fn_call():
    student, data = _distill_inputs(k=3)
    data["sample_mask"] = torch.tensor([1.0, 0.0])
    config = {"kl_type": "forward", "zero_outside_topk": False}
    loss, metrics, g_toks = _run_distill(config, student, data)
    assert loss.dim() == 0 and "loss" in metrics
    assert g_toks.item() == 4.0
    expected = ref_distillation(
        student,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        "forward",
        0.5,
        False,
        _distill_mask(data),
        4.0,
    )
    assert_close(loss, expected.float(), **close(torch.float32, "reordered"))
    # deliberate deviation: num_valid_samples = sum(sample_mask), not the row count
    assert metrics["num_valid_samples"].item() == 1.0


# ---------------------------------------------------------------------------------------
# Vocab gather / subset softmax (single-process mapping of the vocab-parallel checks)
# ---------------------------------------------------------------------------------------


def test_vocab_parallel_gather_columns_no_tp():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 50, (6, 5), generator=g)
    picked = vocab_reduce(logits, idx).picked
    assert picked.dtype == torch.float32
    assert_close(picked, logits.gather(-1, idx).float(), **close(torch.float32, "exact"))


def test_subset_softmax_matches_full_vocab_reference():
    g = torch.Generator().manual_seed(5)
    rows, width, vocab, k = 2, 4, 16, 5
    logits = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(rows * width)])
    idx = idx.reshape(rows, width, k)
    a = logits.clone().float().requires_grad_(True)
    student, _, _ = get_distillation_topk_logprobs_from_logits(
        a, torch.zeros(rows, width, k), idx, zero_outside_topk=False, calculate_entropy=False
    )
    b = logits.clone().float().requires_grad_(True)
    full_slice = torch.log_softmax(b, -1).gather(-1, idx)
    renorm = (full_slice - torch.logsumexp(full_slice, -1, keepdim=True))[:, :-1]
    assert_close(student, renorm, **close(torch.float32, "same"))
    weights = torch.randn(student.shape, generator=g)
    (student * weights).sum().backward()
    (renorm * weights).sum().backward()
    assert_close(a.grad, b.grad, **close(torch.float32, "same"))


# ---------------------------------------------------------------------------------------
# metric_normalizations and split-API rescaling
# ---------------------------------------------------------------------------------------


def _pg_norms(grad, sir, oob=None):
    out = {"loss": grad, "kl_penalty": grad}
    for key in (
        "probs_ratio",
        "probs_ratio_clamped",
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "approx_entropy",
    ):
        out[key] = T
    out["sampling_importance_ratio"] = sir
    for key in (
        "num_valid_samples",
        "positive_nll_loss",
        "probs_ratio_min",
        "probs_ratio_max",
        "probs_ratio_clamped_min",
        "probs_ratio_clamped_max",
    ):
        out[key] = N
    if oob is not None:
        out["is_oob_ratio"] = oob
    return out


class TestMetricNormalizationAdvertisement:
    def test_default(self):
        assert ClippedPGLossFn({}).metric_normalizations == _pg_norms(T, T)

    def test_gspo(self):
        assert ClippedPGLossFn(GSPO).metric_normalizations == _pg_norms(S, S)

    def test_seq_mask_tis_token_level(self):
        fn = ClippedPGLossFn(
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.7,
            }
        )
        assert fn.metric_normalizations == _pg_norms(T, T, oob=S)

    def test_tis_sequence_level(self):
        fn = ClippedPGLossFn(
            {
                "token_level_loss": False,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
            }
        )
        assert fn.metric_normalizations == _pg_norms(S, T, oob=T)

    def test_seq_logprob_error_in_loss_adds_counts(self):
        fn = ClippedPGLossFn(
            {"force_on_policy_ratio": True, "seq_logprob_error_in_loss": True}, seq_logprob_error_threshold=2.0
        )
        expected = _pg_norms(T, T)
        for key in (
            "seq_logprob_error_valid_tokens",
            "seq_logprob_error_valid_seqs",
            "num_masked_seqs_by_logprob_error",
        ):
            expected[key] = N
        assert fn.metric_normalizations == expected

    def test_nll(self):
        assert NLLLossFn().metric_normalizations == {
            "loss": T,
            "num_unmasked_tokens": N,
            "num_valid_samples": N,
        }


def _split_batch(seed=1234, micro=2, rows=4, width=8):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(micro):
        lp = -torch.rand(rows, width - 1, generator=g) * 2 - 0.1
        prev = torch.zeros(rows, width)
        prev[:, 1:] = lp + 0.1 * torch.randn(rows, width - 1, generator=g)
        gen = prev + 0.15 * torch.randn(rows, width, generator=g)
        if not batches:
            gen[1] -= 0.6  # geometric IS ratio ≈ e^0.6 > 1.5: one sequence masked by seq-mask-tis
        ref = prev + 0.2 * torch.randn(rows, width, generator=g)
        token_mask = torch.ones(rows, width)
        token_mask[:, 0] = 0
        token_mask[0, -2:] = 0
        data = {
            "input_ids": torch.zeros(rows, width, dtype=torch.long),
            "token_mask": token_mask,
            "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
            "advantages": torch.randn(rows, width, generator=g),
            "prev_logprobs": prev,
            "generation_logprobs": gen,
            "reference_policy_logprobs": ref,
        }
        batches.append((lp, data))
    return batches


@pytest.mark.parametrize("token_level", [True, False])
def test_split_rescale_matches_sync_normalization(token_level):
    fn = ClippedPGLossFn(
        {
            "reference_policy_kl_penalty": 0.05,
            "token_level_loss": token_level,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.5,
            "truncated_importance_sampling_ratio_min": 0.7,
        }
    )
    batches = _split_batch()
    g_seqs = sum(d["sample_mask"].sum() for _, d in batches)
    g_toks = sum((d["token_mask"][:, 1:] * d["sample_mask"][:, None]).sum() for _, d in batches)
    assert (g_seqs.item(), g_toks.item()) == (6.0, 2 * (3 * 7 - 2))

    def run(gs, gt):
        leaves, parts = [], []
        for lp, data in batches:
            x = lp.clone().requires_grad_(True)
            loss, metrics = fn(next_token_logprobs=x, data=data, global_valid_seqs=gs, global_valid_toks=gt)
            loss.backward()
            leaves.append(x.grad)
            parts.append(metrics)
        return leaves, combine_metrics(parts)

    sync_grads, sync = run(g_seqs, g_toks)
    one = torch.tensor(1.0)
    raw_grads, raw = run(one, one)
    norms = fn.metric_normalizations
    assert set(raw) <= set(norms)
    rescaled = rescale_loss_metrics(raw, norms, token_factor=1.0 / g_toks, sequence_factor=1.0 / g_seqs)
    for key, value in sync.items():
        assert_close(rescaled[key], value, **close(torch.float32, "reordered"), msg=key)
    assert raw["num_valid_samples"].item() == sync["num_valid_samples"].item() == 6.0
    assert raw["is_oob_ratio"].item() == 1.0  # exactly the shifted sequence is masked
    grad_factor = 1.0 / (g_toks if token_level else g_seqs)
    for rg, sg in zip(raw_grads, sync_grads):
        assert_close(rg * grad_factor, sg, **close(torch.float32, "reordered"))


# ---------------------------------------------------------------------------------------
# §12.5 in-loss sequence filter (seq_logprob_error_in_loss)
# ---------------------------------------------------------------------------------------

FILTER_THRESHOLD = 2.0


def _filter_batch():
    """4 rows, curr = -2, delta = curr - gen:
    row 0 [0, 0, 0]               error 1   kept
    row 1 [log4, -log4, (masked)] error 4   rejected (geometric IS ratio 1)
    row 2 [log1.3]                error 1.3 kept by the filter, masked by TIS (> 1.2)
    row 3 sample_mask 0.
    """
    rows, width = 4, 4
    curr = torch.full((rows, width - 1), -2.0)
    delta = torch.zeros(rows, width - 1)
    delta[1, :2] = torch.tensor([math.log(4.0), -math.log(4.0)])
    delta[2, 0] = math.log(1.3)
    delta[3] = torch.tensor([3.0, -3.0, 3.0])
    gen = torch.zeros(rows, width)
    gen[:, 1:] = curr - delta
    token_mask = torch.zeros(rows, width)
    token_mask[0, 1:] = 1
    token_mask[1, 1:3] = 1
    token_mask[2, 1] = 1
    token_mask[3, 1:] = 1
    ref = torch.zeros(rows, width)
    ref[:, 1:] = torch.tensor([[-1.5, -2.5, -2.2], [-1.0, -3.0, -2.0], [-2.3, -2.0, -2.0], [-2.0, -1.0, -3.0]])
    adv = torch.zeros(rows, width)
    adv[:, 1:] = torch.tensor([[1.0, -0.5, 2.0], [0.7, 1.5, -1.0], [-1.2, 0.3, 0.4], [0.9, 0.9, 0.9]])
    data = {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "advantages": adv,
        "generation_logprobs": gen,
        "reference_policy_logprobs": ref,
    }
    return curr, data


def _filter_cfg(beta, filtered=True, tis_type="seq-mask-tis"):
    return {
        "reference_policy_kl_penalty": beta,
        "force_on_policy_ratio": True,
        "token_level_loss": True,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": tis_type,
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.8,
        "seq_logprob_error_in_loss": filtered,
    }


def _run_splits(fn, curr, data, splits, g_seqs, g_toks):
    x = curr.clone().requires_grad_(True)
    parts, total, start = [], 0.0, 0
    for n in splits:
        sl = slice(start, start + n)
        loss, metrics = fn(
            next_token_logprobs=x[sl],
            data={k: v[sl] for k, v in data.items()},
            global_valid_seqs=t(g_seqs),
            global_valid_toks=t(g_toks),
        )
        total = total + loss
        parts.append(metrics)
        start += n
    total.backward()
    return total, x.grad, combine_metrics(parts)


@pytest.mark.parametrize("tis_type", ["seq-mask-tis", "tis"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("splits", [[4], [1, 1, 1, 1], [2, 2], [1, 3]])
def test_seq_logprob_error_in_loss_chunked_accumulation(splits, beta, tis_type):
    curr, data = _filter_batch()
    fn = ClippedPGLossFn(_filter_cfg(beta, tis_type=tis_type), seq_logprob_error_threshold=FILTER_THRESHOLD)
    assert fn.requires_survivor_normalization
    g_seqs, g_toks = 3.0, 6.0  # original counts: rows 0, 1, 2 with 3 + 2 + 1 tokens
    loss, grad, m = _run_splits(fn, curr, data, splits, g_seqs, g_toks)
    kept_toks = m["seq_logprob_error_valid_tokens"].item()
    kept_seqs = m["seq_logprob_error_valid_seqs"].item()
    assert (kept_toks, kept_seqs) == (4.0, 2.0)
    assert m["num_masked_seqs_by_logprob_error"].item() == 1.0

    # reference: the legacy loss on the pre-masked batch, normalised by the survivor counts
    pre = dict(data)
    pre["sample_mask"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    legacy = ClippedPGLossFn(_filter_cfg(beta, filtered=False, tis_type=tis_type))
    x_ref = curr.clone().requires_grad_(True)
    ref_loss, ref_metrics = legacy(
        next_token_logprobs=x_ref, data=pre, global_valid_seqs=t(kept_seqs), global_valid_toks=t(kept_toks)
    )
    ref_loss.backward()
    assert_close(grad * (g_toks / kept_toks), x_ref.grad, **close(torch.float32, "reordered"))
    assert torch.equal(grad[1], torch.zeros(3)) and torch.equal(grad[3], torch.zeros(3))

    rescaled = rescale_loss_metrics(
        m, fn.metric_normalizations, token_factor=g_toks / kept_toks, sequence_factor=g_seqs / kept_seqs
    )
    for key in ("loss", "is_oob_ratio", "probs_ratio", "kl_penalty", "num_valid_samples"):
        assert_close(rescaled[key], ref_metrics[key], **close(torch.float32, "reordered"), msg=key)
    assert_close(loss * (g_toks / kept_toks), ref_loss, **close(torch.float32, "reordered"))
    # hand values: row 2 (ratio 1.3 > 1.2) is out of bounds
    if tis_type == "seq-mask-tis":
        assert rescaled["is_oob_ratio"].item() == pytest.approx(0.5)
        # only row 0 contributes: w = 1, ratio 1 → loss = -ΣA_row0 / 4 + β·KL
        actor = -(1.0 - 0.5 + 2.0) / 4
    else:
        assert rescaled["is_oob_ratio"].item() == pytest.approx(0.25)
        actor = (-(1.0 - 0.5 + 2.0) - 1.2 * -1.2) / 4  # row 2's weight clamped to 1.2
    kl = 0.0
    if beta:
        lr = [-1.5 + 2.0, -2.5 + 2.0, -2.2 + 2.0, -2.3 + 2.0]
        kl = beta * sum(math.exp(v) - 1 - v for v in lr) / 4
    assert_close(ref_loss, t(actor + kl), **close(torch.float32, "reordered"))


@pytest.mark.parametrize(
    "where, value",
    [
        ("curr", math.nan),
        ("curr", math.inf),
        ("ref", math.inf),
        ("ref", -math.inf),
        ("ref", math.nan),
        ("gen", -math.inf),
    ],
)
def test_seq_logprob_error_in_loss_nonfinite_rejected_rows(where, value):
    curr, data = _filter_batch()
    fn = ClippedPGLossFn(_filter_cfg(0.1), seq_logprob_error_threshold=FILTER_THRESHOLD)
    clean_loss, clean_grad, clean_m = _run_splits(fn, curr, data, [4], 3.0, 6.0)

    bad_curr, bad = curr.clone(), {k: v.clone() for k, v in data.items()}
    for row in (1, 3):  # the rejected row and the sample_mask-0 row
        if where == "curr":
            bad_curr[row, 1] = value
        elif where == "ref":
            bad["reference_policy_logprobs"][row, 2] = value
        else:
            bad["generation_logprobs"][row, 2] = value
    loss, grad, m = _run_splits(fn, bad_curr, bad, [4], 3.0, 6.0)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[1], torch.zeros(3)) and torch.equal(grad[3], torch.zeros(3))
    assert_close(loss, clean_loss, **close(torch.float32, "same"))
    assert_close(grad, clean_grad, **close(torch.float32, "same"))
    for key, v in m.items():
        assert math.isfinite(v.item()), key
    assert m["num_masked_seqs_by_logprob_error"].item() == 1.0
    assert m["seq_logprob_error_valid_tokens"].item() == 4.0


@pytest.mark.parametrize(
    "threshold, kept_rows",
    [(0.999, []), (1.0, [0]), (1.2999, [0]), (1.3001, [0, 2]), (3.999, [0, 2]), (4.001, [0, 1, 2])],
)
def test_seq_logprob_error_definition(threshold, kept_rows):
    # errors (mean over masked tokens of exp|curr - gen|): row 0 1.0, row 1 4.0 (its masked
    # third token is excluded), row 2 1.3; row 3 has sample_mask 0 and is never counted.
    # Keep iff error <= threshold.
    curr, data = _filter_batch()
    fn = ClippedPGLossFn(_filter_cfg(0.0), seq_logprob_error_threshold=threshold)
    _, grad, m = _run_splits(fn, curr, data, [4], 3.0, 6.0)
    tokens = {0: 3, 1: 2, 2: 1}
    assert m["seq_logprob_error_valid_seqs"].item() == len(kept_rows)
    assert m["seq_logprob_error_valid_tokens"].item() == sum(tokens[r] for r in kept_rows)
    assert m["num_masked_seqs_by_logprob_error"].item() == 3 - len(kept_rows)
    assert m["num_valid_samples"].item() == len(kept_rows)
    for row in range(4):
        nonzero = bool(grad[row].abs().sum() > 0)
        # row 2 is kept by the filter but masked by seq-mask-tis (ratio 1.3 > 1.2): no gradient
        assert nonzero == (row in kept_rows and row != 2), row


def test_seq_logprob_error_in_loss_all_rejected():
    curr, data = _filter_batch()
    fn = ClippedPGLossFn(_filter_cfg(0.1), seq_logprob_error_threshold=0.5)
    loss, grad, m = _run_splits(fn, curr, data, [4], 3.0, 6.0)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m["seq_logprob_error_valid_tokens"].item() == 0.0
    assert m["seq_logprob_error_valid_seqs"].item() == 0.0
    assert m["num_masked_seqs_by_logprob_error"].item() == 3.0
    assert m["num_valid_samples"].item() == 0.0
    assert m["probs_ratio_min"].item() == math.inf and m["probs_ratio_max"].item() == -math.inf


def test_seq_logprob_error_in_loss_disabled_matches_legacy():
    curr, data = _filter_batch()
    plain = ClippedPGLossFn(_filter_cfg(0.1, filtered=False))
    with_threshold = ClippedPGLossFn(_filter_cfg(0.1, filtered=False), seq_logprob_error_threshold=2.0)
    assert not with_threshold.requires_survivor_normalization
    loss_a, grad_a, m_a = _run_splits(plain, curr, data, [4], 3.0, 6.0)
    loss_b, grad_b, m_b = _run_splits(with_threshold, curr, data, [4], 3.0, 6.0)
    assert loss_a.item() == loss_b.item()
    assert torch.equal(grad_a, grad_b)
    assert metrics_to_python(m_a) == metrics_to_python(m_b)
    for key in ("seq_logprob_error_valid_tokens", "seq_logprob_error_valid_seqs", "num_masked_seqs_by_logprob_error"):
        assert key not in m_b
    # the legacy loss sees row 1 (error 4): it differs from the filtered loss
    filtered = ClippedPGLossFn(_filter_cfg(0.1), seq_logprob_error_threshold=2.0)
    loss_f, _, _ = _run_splits(filtered, curr, data, [4], 3.0, 6.0)
    assert abs(loss_f.item() - loss_a.item()) > 1e-3


@pytest.mark.parametrize(
    "overrides, kwargs, match",
    [
        ({}, {}, "requires seq_logprob_error_threshold"),
        ({"force_on_policy_ratio": False}, {"seq_logprob_error_threshold": 2.0}, "force_on_policy_ratio"),
        ({"positive_example_nll_weight": 0.1}, {"seq_logprob_error_threshold": 2.0}, "does not support NLL"),
    ],
)
def test_seq_logprob_error_in_loss_validation(overrides, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClippedPGLossFn({**_filter_cfg(0.0), **overrides}, **kwargs)
