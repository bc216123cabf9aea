"""What the two drafters share (`compiled_loss.draft.common`): one rotary helper in the
rotate-half convention, one place for the reference's denominator epsilons (EAGLE3 TTT's
`+1e-5` per step before the DP all-reduce, DSpark / DFlash's `+1e-6` after it, ref §11.3),
and config, builder and batch checks that answer alike for both."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from common import message
from tolerances import close

import compiled_loss.draft.dflash as dflash
import compiled_loss.draft.eagle3 as eagle3
from compiled_loss.draft import DraftBatch
from compiled_loss.draft.common import (
    DFLASH_LOSS_DEN_EPS,
    EAGLE3_LOSS_DEN_EPS,
    rope_tables,
    rotate_half,
)
from compiled_loss.draft.dflash import DFlashConfig, build_dflash_runtime
from compiled_loss.draft.eagle3 import Eagle3Config, build_eagle3_runtime

POLICY = types.SimpleNamespace(vocab_size=11, hidden_size=8, num_layers=2, num_heads=2)
DRAFTERS = {"eagle3": (Eagle3Config, build_eagle3_runtime), "dflash": (DFlashConfig, build_dflash_runtime)}


def _batch(runtime, seed=0, rows=2, length=10):
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([[0] * 6 + [1] * 4, [2] * 8 + [-1] * 2])[:rows, :length]
    return DraftBatch(
        input_ids=torch.randint(0, 11, (rows, length), generator=g),
        hidden_states=torch.randn(rows, length, runtime.drafter.fc.in_features, generator=g),
        teacher_logits=2 * torch.randn(rows, length, 11, generator=g),
        loss_mask=(docs >= 0).float(),
        document_ids=docs,
        position_ids=torch.tensor([list(range(6)) + list(range(4)), list(range(10))])[:rows, :length],
        anchor_noise=torch.rand(rows, length, generator=g),
    )


# ---------------------------------------------------------------------------------------
# RoPE: one helper, one convention


def test_both_drafters_rotate_with_the_one_rotate_half_helper():
    assert eagle3.rotate_half is dflash.rotate_half is rotate_half
    assert eagle3.rope_tables is dflash.rope_tables is rope_tables
    assert not hasattr(eagle3, "_rotate") and not hasattr(dflash, "_rotate")


def test_rotate_half_pairs_feature_i_with_feature_i_plus_half():
    """Rotate-half (Llama / Hugging Face): features (i, i + d/2) are the real and imaginary
    parts of a complex number multiplied by e^{iθ_i}; the full-width form
    `x·[cos, cos] + [-x2, x1]·[sin, sin]` is the same rotation to the bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 6, generator=g)
    positions = torch.tensor([[0, 1, 2, 7, 100], [3, 3, 3, 3, 3], [9, 8, 7, 6, 5]])
    inv_freq = 10000.0 ** -(torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    cos, sin = rope_tables(positions, inv_freq, torch.float32)
    assert cos.shape == (3, 5, 3) and cos.dtype == torch.float32
    got = rotate_half(x, cos, sin)
    angles = positions.double()[..., None] * inv_freq
    z = torch.complex(x[..., :3].double(), x[..., 3:].double()) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(got.double(), torch.cat([z.real, z.imag], -1), **close(torch.float32, "same"))
    x1, x2 = x.chunk(2, -1)
    full = x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)
    assert torch.equal(got, full)


def test_rope_tables_compute_the_angles_in_the_frequencies_dtype_at_least_float32():
    positions = torch.tensor([3001, 4097])  # not exact in bfloat16
    inv_freq = torch.tensor([1.0, 0.001])
    for freq_dtype, work in [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, None)]:
        freq = inv_freq.to(freq_dtype)
        cos, sin = rope_tables(positions, freq, torch.float64)
        angles = positions.to(work or torch.float32)[:, None] * (freq if work else freq.float())
        assert torch.equal(cos, angles.cos().double()) and torch.equal(sin, angles.sin().double())


# ---------------------------------------------------------------------------------------
# The denominator epsilons: one place, each where its reference quantity is


def test_the_reference_denominator_epsilons():
    assert (EAGLE3_LOSS_DEN_EPS, DFLASH_LOSS_DEN_EPS) == (1e-5, 1e-6)
    assert not hasattr(eagle3, "_DEN_EPS") and not hasattr(dflash, "_DEN_EPS")


def test_eagle3_adds_its_epsilon_to_each_steps_count_before_the_dp_sum(monkeypatch):
    """`loss = Σ_k decay^k num_k / all_reduce(den_k + eps) / n_slots` (two identical DP ranks:
    the all-reduce doubles, so the epsilon is counted once per rank, as in the reference)."""
    torch.manual_seed(0)
    runtime = build_eagle3_runtime(Eagle3Config(ttt_steps=2, hidden_size=8, num_heads=2, aux_layers=(0, 1)), POLICY)
    runtime.dp_group = object()
    monkeypatch.setattr(eagle3, "all_reduce_sum", lambda x, group: 2 * x)
    monkeypatch.setattr(eagle3, "EAGLE3_LOSS_DEN_EPS", 0.5)  # large enough to see
    loss, m = runtime.draft_loss(_batch(runtime), 3)
    want = sum(0.8**k * m[f"draft_ttt_loss_num@{k}"] / (2 * (m[f"draft_ttt_loss_den@{k}"] + 0.5)) for k in range(2)) / 3
    torch.testing.assert_close(loss, want, **close(torch.float32, "same"))


def test_dflash_adds_its_epsilon_to_the_dp_summed_denominators(monkeypatch):
    """`W = all_reduce(Σ w) + eps` and `E = all_reduce(Σ eval) + eps` (two identical DP ranks)."""
    torch.manual_seed(0)
    cfg = DFlashConfig(block_size=3, num_anchors=4, loss_decay_gamma=2.0, confidence_head_alpha=0.5)
    runtime = build_dflash_runtime(dataclasses.replace(cfg, hidden_size=8, num_heads=2), POLICY)
    runtime.dp_group = object()
    monkeypatch.setattr(dflash, "all_reduce_sum", lambda x, group: 2 * x)
    batch = _batch(runtime)
    terms = {}
    for eps in (0.0, 3.0):
        monkeypatch.setattr(dflash, "DFLASH_LOSS_DEN_EPS", eps)
        terms[eps] = runtime.draft_loss(batch, 1)[1]
    m = terms[0.0]
    evals = [m[f"draft_accept_rate_den@{j}"] for j in (1, 2)]
    weights = 2 * (evals[0] + evals[1] * torch.exp(torch.tensor(-0.5)))  # Σ w over both ranks
    assert evals[0] > 0 and evals[1] > 0
    torch.testing.assert_close(
        terms[3.0]["draft_ce_loss"], m["draft_ce_loss"] * weights / (weights + 3), **close(torch.float32, "same")
    )
    counts = 2 * (evals[0] + evals[1])  # Σ eval over both ranks
    torch.testing.assert_close(
        terms[3.0]["draft_conf_loss"], m["draft_conf_loss"] * counts / (counts + 3), **close(torch.float32, "same")
    )


# ---------------------------------------------------------------------------------------
# Config, builder and batch checks: one answer for both drafters


SHARED_FIELD_CASES = {
    "loss_weight=-1": dict(loss_weight=-1.0),
    "loss_weight=1e7": dict(loss_weight=1e7),
    "hidden_size=0": dict(hidden_size=0),
    "num_heads=0": dict(num_heads=0),
    "draft_vocab_size=0": dict(draft_vocab_size=0),
    "aux_layers=()": dict(aux_layers=()),
    "aux_layers=(1, 1)": dict(aux_layers=(1, 1)),
    "aux_layers=(-1,)": dict(aux_layers=(-1,)),
    "heads": dict(hidden_size=12, num_heads=4),
}


def test_the_configs_check_their_shared_fields_alike():
    for name, kwargs in SHARED_FIELD_CASES.items():
        got = {kind: message(config, **kwargs) for kind, (config, _) in DRAFTERS.items()}
        assert got["eagle3"] == got["dflash"], name
    assert "\n".join(message(Eagle3Config, **kw) for kw in SHARED_FIELD_CASES.values()) == (
        "ConfigError: loss_weight must be >= 0, got -1.0\n"
        "ConfigError: loss_weight=10000000.0 is outside [1e-06, 1e+06]: it scales the draft loss, and float32 squares "
        "of the gradient overflow (grad_norm inf, no update) or vanish outside that range\n"
        "ConfigError: hidden_size must be None or >= 1, got 0\n"
        "ConfigError: num_heads must be None or >= 1, got 0\n"
        "ConfigError: draft_vocab_size must be None or >= 1, got 0\n"
        "ConfigError: aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got ()\n"
        "ConfigError: aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got (1, 1)\n"
        "ConfigError: aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got (-1,)\n"
        "ConfigError: hidden_size (12) must be divisible by num_heads (4) into an even head size"
    )


@pytest.mark.parametrize("kind", DRAFTERS)
def test_the_builders_check_the_policy_alike(kind):
    config, build = DRAFTERS[kind]
    got = [
        message(build, config(aux_layers=(0, 2)), POLICY),
        message(build, config(draft_vocab_size=8), POLICY),
        message(build, config(draft_vocab_size=4), POLICY, d2t=torch.tensor([1, 1, 2])),
        message(build, config(), POLICY, d2t=torch.tensor([0, 5, 9])),
        message(build, config(), types.SimpleNamespace(**{**POLICY.__dict__, "hidden_size": 12, "num_heads": 4})),
    ]
    assert got == [
        "ConfigError: aux_layers (0, 2) must name decoder layers of the policy, [0, 2)",
        "ConfigError: draft_vocab_size (8) differs from the policy's vocabulary (11): pass a d2t map",
        "ConfigError: draft_vocab_size (4) must equal the size of the d2t map (3)",
        "ValueError: d2t maps draft index 2 to target id 11 outside the target vocabulary [0, 11) (1 such entries)",
        "ConfigError: hidden_size (12) must be divisible by num_heads (4) into an even head size",
    ]
    runtime = build(config(aux_layers=[1, 0]), POLICY)  # any order (a Hydra list): read ascending
    assert runtime.aux_layers == (0, 1) and runtime.drafter.fc.in_features == 2 * POLICY.hidden_size


@pytest.mark.parametrize("kind", DRAFTERS)
def test_the_runtimes_check_batches_alike(kind):
    config, build = DRAFTERS[kind]
    runtime = build(config(aux_layers=(0, 1)), POLICY)
    batch = _batch(runtime)
    got = [
        message(runtime.draft_loss, batch, 0),
        message(runtime.draft_loss, dataclasses.replace(batch, input_ids=batch.input_ids[0])),
        message(runtime.draft_loss, dataclasses.replace(batch, hidden_states=batch.hidden_states[..., :3])),
        message(runtime.draft_loss, dataclasses.replace(batch, teacher_logits=None)),
        message(runtime.draft_loss, dataclasses.replace(batch, position_ids=batch.position_ids[:1])),
    ]
    assert got == [
        "ValueError: n_slots must be an int >= 1, got 0",
        "ValueError: DraftBatch.input_ids must be [R, L], got shape (10,)",
        "ValueError: DraftBatch.hidden_states must have shape (2, 10, 16), got (2, 10, 3)",
        "ValueError: DraftBatch.teacher_logits must have shape (2, 10, 11), got None",
        "ValueError: DraftBatch.position_ids must have shape (2, 10), got (1, 10)",
    ]
    noise = dataclasses.replace(batch, anchor_noise=batch.anchor_noise[:, :3])  # only DFlash draws anchors
    if kind == "dflash":
        assert message(runtime.draft_loss, noise) == (
            "ValueError: DraftBatch.anchor_noise must have shape (2, 10), got (2, 3)"
        )
    else:
        torch.testing.assert_close(
            runtime.draft_loss(noise)[0], runtime.draft_loss(batch)[0], **close(torch.float32, "exact")
        )
