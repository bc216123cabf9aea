"""Full-vocabulary on-policy distillation: `ClippedPGLossFn(cfg, opd_full=…)` (ref §4.1.8,
§5.1). The policy-gradient objective is replaced by the per-token reverse KL
`KL(π_student ‖ π_teacher)` over the whole vocabulary, computed by the input preparation
(`OPD_FULL` inputs: `opd_full_divergence [B, S-1]`, optionally `opd_full_entropy`,
`opd_full_cross_entropy`, and `next_token_logprobs` when β ≠ 0) from the student's logits
and the teacher payload in `data` (`compiled_loss.inputs.teacher`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NotRequired

import torch

from compiled_loss.checks import check_fields, require
from compiled_loss.interfaces import MetricNormalizer
from compiled_loss.losses.common import (
    KL_PENALTY_KEY,
    MaskData,
    calculate_kl,
    check_logprob_inputs,
    float_masks,
    masked_max,
    masked_mean,
    masked_min,
    nan_to_zero,
    normalizations,
    reduce_like_loss,
    require_keys,
    require_shape,
    zero_outside,
)

Tensor = torch.Tensor


class OpdFullData(MaskData):
    """What the OPD_FULL objective reads of `ClippedPGLossFn`'s data (`ClippedPGLossData`)."""

    reference_policy_logprobs: NotRequired[Tensor]  # with a reference KL (β ≠ 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OPDFullConfig:
    """Configuration of the full-vocabulary on-policy distillation branch of `ClippedPGLossFn`."""

    teacher_payload: Literal["logits", "hidden_states"] = "logits"
    """What `data["opd_full_teacher_payload"]` holds: the teacher's full logits `[B, S, V]`, or its
    hidden states `[B, S, H]`, projected through the teacher LM head(s) given to the input preparation."""
    chunk_size: int | None = None
    """Rows per tile of the eager reverse-KL pass (>= 1; None: the vocab room's ~4 MiB tiles);
    torch.compile fuses the whole pass and ignores it."""
    compute_entropy: bool = False
    """Report `opd_full_entropy`, the student's mean entropy -Σ p log p over the valid tokens."""
    compute_cross_entropy: bool = False
    """Report `opd_full_cross_entropy`, the mean -Σ p log q (q: the teacher) over the valid tokens."""
    validate_decomposition: bool = False
    """Report `opd_full_decomposition_error` = max |CE - H - KL| over the valid tokens (and both diagnostics)."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(
            self.chunk_size is None or self.chunk_size >= 1,
            f"opd_full.chunk_size must be None or >= 1, got {self.chunk_size}",
        )

    @property
    def with_entropy(self) -> bool:
        return self.compute_entropy or self.validate_decomposition

    @property
    def with_cross_entropy(self) -> bool:
        return self.compute_cross_entropy or self.validate_decomposition


def validate_opd_full(cfg: Any, use_fused_linear_logprobs: bool) -> None:
    """The policy-gradient options the distillation branch cannot honour are refused (ref
    §4.1.8); a reference KL (β ≠ 0) is kept, with a warning."""
    require(not use_fused_linear_logprobs, "opd_full is incompatible with use_fused_linear_logprobs=True")
    require(cfg.disable_ppo_ratio, "opd_full requires disable_ppo_ratio=True (there is no PPO ratio to clip)")
    for field, bad in (
        ("ratio_clip_c (dual clip)", cfg.ratio_clip_c is not None),
        ("use_cispo", cfg.use_cispo),
        ("force_on_policy_ratio", cfg.force_on_policy_ratio),
        ("use_on_policy_kl_approximation", cfg.use_on_policy_kl_approximation),
        ("sequence_level_importance_ratios", cfg.sequence_level_importance_ratios),
        ("use_importance_sampling_correction", cfg.use_importance_sampling_correction),
        ("truncated_importance_sampling_type", cfg.truncated_importance_sampling_type is not None),
        ("truncated_importance_sampling_ratio", cfg.truncated_importance_sampling_ratio is not None),
        ("positive_example_nll_weight != 0", cfg.positive_example_nll_weight != 0),
        ("use_kl_in_reward", cfg.use_kl_in_reward),
        ("seq_logprob_error_in_loss", cfg.seq_logprob_error_in_loss),
    ):
        require(not bad, f"opd_full is incompatible with {field}")
    if cfg.reference_policy_kl_penalty != 0:
        warnings.warn(
            f"opd_full with reference_policy_kl_penalty={cfg.reference_policy_kl_penalty}: the sampled "
            "reference KL is added to the distillation loss",
            stacklevel=4,
        )


def opd_full_normalizations(opd: OPDFullConfig, token_level: bool) -> dict[str, MetricNormalizer]:
    """ref §4.1.3 (the map that replaces the policy-gradient one)."""
    grad = "TOKENS" if token_level else "SEQUENCES"
    tokens = (
        ("opd_full_reverse_kl",)
        + (("opd_full_entropy",) if opd.with_entropy else ())
        + (("opd_full_cross_entropy",) if opd.with_cross_entropy else ())
    )
    none = ("num_valid_samples", "opd_full_reverse_kl_min", "opd_full_reverse_kl_max") + (
        ("opd_full_decomposition_error",) if opd.validate_decomposition else ()
    )
    return {**normalizations(TOKENS=tokens, NONE=none), **normalizations(**{grad: ("loss", KL_PENALTY_KEY)})}


def _checked_inputs(
    opd: OPDFullConfig, data: OpdFullData, inputs: Mapping[str, Tensor | None], who: str
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The divergence, entropy and cross-entropy inputs `[B, S-1]`, each of the batch's shape;
    the last two where the config reports them."""
    divergence = inputs.get("opd_full_divergence")
    if divergence is None:
        raise ValueError(f"{who}: opd_full_divergence ([B, S-1]) is required")
    entropy, cross_entropy = inputs.get("opd_full_entropy"), inputs.get("opd_full_cross_entropy")
    require_keys(data, ("token_mask", "sample_mask"), who)
    rows, width = data["token_mask"].shape
    shape = (rows, max(width - 1, 0))
    for name, value in (
        ("opd_full_divergence", divergence),
        ("opd_full_entropy", entropy),
        ("opd_full_cross_entropy", cross_entropy),
    ):
        if value is not None:
            require_shape(value, shape, f"{name} ([B, S-1])", who)
    for name, needed, value in (
        ("opd_full_entropy", opd.with_entropy, entropy),
        ("opd_full_cross_entropy", opd.with_cross_entropy, cross_entropy),
    ):
        if needed and value is None:
            raise ValueError(f"{who}: the config reports {name}; the input preparation must pass it")
    return divergence, entropy, cross_entropy


def opd_full_objective(
    cfg: Any,
    opd: OPDFullConfig,
    beta: float,
    data: OpdFullData,
    g_seqs: Tensor | None,
    g_toks: Tensor | None,
    inputs: Mapping[str, Tensor | None],
    next_token_logprobs: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss = the reverse KL reduced like the loss (token or sequence level) + the optional
    sampled reference KL `β · KL(π ‖ π_ref)` with score-function weights `exp(lp - lp.detach())`;
    metrics per ref §4.1.8 (min / max with ±inf sentinels). `cfg`: the `ClippedPGLossConfig`;
    `inputs`: the OPD_FULL inputs by name."""
    who = "ClippedPGLossFn(opd_full)"
    divergence, entropy, cross_entropy = _checked_inputs(opd, data, inputs, who)
    tm, sm = float_masks(data, divergence.dtype)
    mask = tm * sm[:, None]
    (divergence,) = zero_outside(mask, divergence)
    entropy = None if entropy is None else zero_outside(mask, entropy)[0]
    cross_entropy = None if cross_entropy is None else zero_outside(mask, cross_entropy)[0]
    token_level = cfg.token_level_loss
    loss = reduce_like_loss(divergence, tm, sm, token_level, g_toks, g_seqs)
    kl = divergence.new_zeros(())
    if beta != 0:
        if next_token_logprobs is None:
            raise ValueError(f"{who}: reference_policy_kl_penalty != 0 needs next_token_logprobs")
        check_logprob_inputs(next_token_logprobs, data, ("reference_policy_logprobs",), who)
        lp, lp_ref = zero_outside(mask, next_token_logprobs, data["reference_policy_logprobs"][:, 1:])
        kl_tok = beta * calculate_kl(
            lp,
            lp_ref,
            cfg.reference_policy_kl_type,
            cfg.kl_input_clamp_value,
            cfg.kl_output_clamp_value,
            nan_to_zero(torch.exp(lp - lp.detach())),
        )
        kl = reduce_like_loss(kl_tok, tm, sm, token_level, g_toks, g_seqs)
    loss = loss + kl
    d = divergence.detach()
    metrics = {
        "loss": loss.detach(),
        KL_PENALTY_KEY: kl.detach() / beta if beta != 0 else d.new_zeros(()),
        "num_valid_samples": sm.sum(),
        "opd_full_reverse_kl": masked_mean(d, mask, global_normalization_factor=g_toks),
        "opd_full_reverse_kl_min": masked_min(d, mask),
        "opd_full_reverse_kl_max": masked_max(d, mask),
    }
    if entropy is not None and opd.with_entropy:
        metrics["opd_full_entropy"] = masked_mean(entropy.detach(), mask, global_normalization_factor=g_toks)
    if cross_entropy is not None and opd.with_cross_entropy:
        metrics["opd_full_cross_entropy"] = masked_mean(
            cross_entropy.detach(), mask, global_normalization_factor=g_toks
        )
    if entropy is not None and cross_entropy is not None and opd.validate_decomposition:
        metrics["opd_full_decomposition_error"] = masked_max((cross_entropy - entropy - d).abs().detach(), mask)
    return loss, metrics
