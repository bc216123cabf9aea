"""Loss configs read like torchtitan's and fail like NeMo-RL's: keyword-only dataclasses
with a docstring under each field; single-field checks when the config is constructed,
cross-field checks when the loss is — raising `ConfigError`, both a ValueError and an
AssertionError, so code written against the reference's asserts still catches it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest

from compiled_loss.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    ConfigError,
    CrossTokenizerDistillationLossConfig,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    MPOLossConfig,
    MseValueLossConfig,
    OPDFullConfig,
)

CONFIGS = [
    ClippedPGLossConfig,
    DPOLossConfig,
    DistillationLossConfig,
    MseValueLossConfig,
    MPOLossConfig,
    CrossTokenizerDistillationLossConfig,
    OPDFullConfig,
]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_keyword_only_with_a_docstring_under_each_field(cls):
    with pytest.raises(TypeError):
        cls(0.1)
    body = ast.parse(inspect.getsource(cls)).body[0].body
    documented = {
        stmt.target.id
        for stmt, after in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("beta", [-0.01, math.nan, math.inf, -math.inf])
def test_out_of_range_or_non_finite_beta_fails_when_the_config_is_constructed(beta):
    with pytest.raises(ValueError) as info:
        ClippedPGLossConfig(reference_policy_kl_penalty=beta)
    assert isinstance(info.value, AssertionError)
    assert "reference_policy_kl_penalty must be finite" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ratio_clip_c", math.nan, "ratio_clip_c must be finite, got nan"),
        ("ratio_clip_c", 1.0, "ratio_clip_c must be > 1 for dual clipping, got 1.0"),
        (
            "truncated_importance_sampling_ratio",
            math.nan,
            "truncated_importance_sampling_ratio must be finite, got nan",
        ),
        (
            "truncated_importance_sampling_ratio_min",
            math.nan,
            "truncated_importance_sampling_ratio_min must be finite, got nan",
        ),
        (
            "truncated_importance_sampling_ratio",
            0.0,
            "truncated_importance_sampling_ratio must be > 0 (or None), got 0.0",
        ),
        (
            "truncated_importance_sampling_type",
            "tiss",
            "truncated_importance_sampling_type must be one of 'tis', 'icepop', 'seq-mask-tis', got 'tiss'",
        ),
        ("ratio_clip_min", "0.2", "ratio_clip_min must be a float, got str '0.2'"),
        ("use_cispo", 1, "use_cispo must be a bool, got int 1"),
        ("kl_output_clamp_value", -1.0, "kl_output_clamp_value must be > 0 (or None), got -1.0"),
    ],
)
def test_single_field_checks_run_at_config_construction(field, value, message):
    with pytest.raises(ConfigError) as info:
        ClippedPGLossConfig(**{field: value})
    assert str(info.value) == message


def test_distillation_weight_and_dpo_weights():
    with pytest.raises(ConfigError, match="mixed_kl_weight must be finite, got nan"):
        DistillationLossConfig(mixed_kl_weight=math.nan)
    with pytest.raises(ConfigError, match="sft_loss_weight must be finite and >= 0, got -1"):
        DPOLossConfig(sft_loss_weight=-1)
    with pytest.raises(ConfigError, match="cliprange must be >= 0"):
        MseValueLossConfig(cliprange=-0.2)


CROSS_FIELD = [
    (dict(use_cispo=True, disable_ppo_ratio=True), "use_cispo=True is incompatible with disable_ppo_ratio"),
    (dict(use_cispo=True, force_on_policy_ratio=True), "use_cispo=True is incompatible with force_on_policy_ratio"),
    (dict(use_cispo=True, ratio_clip_c=3.0), "use_cispo=True is incompatible with ratio_clip_c"),
    (
        dict(sequence_level_importance_ratios=True),
        "sequence_level_importance_ratios=True requires token_level_loss=False (GSPO is a sequence-level loss)",
    ),
    (
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=1.0,
            truncated_importance_sampling_ratio_min=2.0,
        ),
        "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio",
    ),
    (
        dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0),
        "truncated_importance_sampling_type requires use_importance_sampling_correction=True",
    ),
    (dict(seq_logprob_error_in_loss=True), "seq_logprob_error_in_loss requires seq_logprob_error_threshold"),
]


@pytest.mark.parametrize(("fields", "message"), CROSS_FIELD, ids=[m for _, m in CROSS_FIELD])
def test_cross_field_checks_run_at_loss_construction(fields, message):
    cfg = ClippedPGLossConfig(**fields)  # constructing the config must not raise
    for caught in (AssertionError, ValueError):  # code written against either catches it
        with pytest.raises(caught) as info:
            ClippedPGLossFn(cfg)
        assert str(info.value) == message


def test_a_plain_dict_gets_both_kinds_of_check_at_loss_construction():
    with pytest.raises(AssertionError, match="reference_policy_kl_penalty must be finite, got nan"):
        ClippedPGLossFn({"reference_policy_kl_penalty": math.nan})
    with pytest.raises(AssertionError, match="use_cispo=True is incompatible with force_on_policy_ratio"):
        ClippedPGLossFn({"use_cispo": True, "force_on_policy_ratio": True})
    with pytest.raises(ValueError, match="kl_type must be one of 'forward', 'reverse', 'mixed', got 'jsd'"):
        DistillationLossFn({"kl_type": "jsd"})
    assert ClippedPGLossFn({"ratio_clip_max": 0.28}).cfg.ratio_clip_max == 0.28


BOUNDS = [
    (
        ClippedPGLossConfig,
        dict(kl_input_clamp_value=89.0),
        "kl_input_clamp_value must be <= log(float32 max) = 88.7228, got 89.0: the k3 estimator exponentiates the "
        "clamped log-ratio, and exp of a larger value overflows float32 to inf",
    ),
    (
        ClippedPGLossConfig,
        dict(reference_policy_kl_penalty=2e6),
        "reference_policy_kl_penalty=2000000.0 is outside [1e-06, 1e+06]: it scales the reference KL term, and float32 "
        "squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range",
    ),
    (
        ClippedPGLossConfig,
        dict(truncated_importance_sampling_ratio_min=1e7),
        "truncated_importance_sampling_ratio_min=10000000.0 is outside [1e-06, 1e+06]: it clamps the importance weights "
        "that scale the gradient, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish "
        "outside that range",
    ),
    (
        DPOLossConfig,
        dict(reference_policy_kl_penalty=1e-7),
        "reference_policy_kl_penalty=1e-07 is outside [1e-06, 1e+06]: it scales the loss's gradient, and float32 squares "
        "of the gradient overflow (grad_norm inf, no update) or vanish outside that range",
    ),
    (
        MPOLossConfig,
        dict(reward_shift=1e39),
        "reward_shift must be 0 or of magnitude in [1.1754944e-38, 3.4028235e+38] (float32, the dtype the losses and the "
        "model compute in), got 1e+39",
    ),
    (
        MPOLossConfig,
        dict(bco_loss_weight=1e-40),
        "bco_loss_weight must be 0 or of magnitude in [1.1754944e-38, 3.4028235e+38] (float32, the dtype the losses and "
        "the model compute in), got 1e-40",
    ),
    (
        CrossTokenizerDistillationLossConfig,
        dict(temperature=2e6),
        "temperature=2000000.0 is outside [1e-06, 1e+06]: the logits are scaled by 1/temperature and the KD term's "
        "gradient by temperature, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish "
        "outside that range",
    ),
    (
        CrossTokenizerDistillationLossConfig,
        dict(teacher_weights=(1.0, 1e7)),
        "teacher_weights[1]=10000000.0 is outside [1e-06, 1e+06]: it scales its teacher's KD term, and float32 squares of "
        "the gradient overflow (grad_norm inf, no update) or vanish outside that range",
    ),
    (
        MseValueLossConfig,
        dict(scale=1e-7),
        "scale=1e-07 is outside [1e-06, 1e+06]: it scales the loss's gradient, and float32 squares of the gradient "
        "overflow (grad_norm inf, no update) or vanish outside that range",
    ),
]


@pytest.mark.parametrize(("cls", "fields", "message"), BOUNDS, ids=[m.split(" ")[0] for _, _, m in BOUNDS])
def test_floats_are_bounded_in_the_dtype_they_are_used_in(cls, fields, message):
    """float32's range, the factors of the gradient (`compiled_loss.checks.FACTOR_MAX`), exp()."""
    with pytest.raises(ConfigError) as info:
        cls(**fields)
    assert str(info.value) == message


def test_seq_logprob_error_threshold_is_checked_whenever_given():
    with pytest.raises(ConfigError) as info:
        ClippedPGLossFn(ClippedPGLossConfig(), seq_logprob_error_threshold=-1.0)
    assert str(info.value) == "seq_logprob_error_threshold must be >= 0, got -1.0"
