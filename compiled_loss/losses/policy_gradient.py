"""Clipped policy gradient: PPO / GRPO / DAPO / REINFORCE / GSPO / CISPO / TIS / VAPO and
the in-loss sequence filter (ref §4.1), one named step per part of the objective."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, NotRequired, TypedDict

import torch

from compiled_loss.checks import FLOAT32, check_factor, check_fields, check_value, require
from compiled_loss.compile import compile_loss
from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import (
    KL_PENALTY_KEY,
    as_config,
    calculate_kl,
    check_logprob_inputs,
    float_masks,
    masked_max,
    masked_mean,
    masked_min,
    nan_to_zero,
    normalizations,
    reduce_like_loss,
    zero_outside,
)
from compiled_loss.losses.opd import OPDFullConfig, opd_full_normalizations, opd_full_objective, validate_opd_full

Tensor = torch.Tensor

_OPD_FULL_INPUTS = frozenset({"opd_full_divergence", "opd_full_entropy", "opd_full_cross_entropy"})

APPROX_ENTROPY_KEY = "approx_entropy"

TISType = Literal["tis", "icepop", "seq-mask-tis"]

_EXP_MAX = math.log(FLOAT32.max)  # the largest x whose exp is finite in float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClippedPGLossConfig:
    """Configuration of `ClippedPGLossFn` (ref §4.1.1; defaults are the reference's)."""

    disable_ppo_ratio: bool = False
    """REINFORCE / RLOO: the "ratio" is the log-prob itself (no clipping)."""
    token_level_loss: bool = True
    """True: token mean over the global batch (G_t); False: mean of per-sequence means (G_s)."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, the geometric mean of its token ratios."""
    ratio_clip_min: float = 0.2
    """ε_low >= 0: the ratio is clipped below at 1 - ε_low."""
    ratio_clip_max: float = 0.2
    """ε_high >= 0: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher)."""
    ratio_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages; None disables."""
    reference_policy_kl_penalty: float = 0.01
    """β of the reference-policy KL term: 0 or in [1e-6, 1e6] (it scales the term's gradient, `FACTOR_MAX`)."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the reference term (ref §3.1)."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of the log-ratio before the KL estimator, in (0, log(float32 max) ≈ 88.72]: k3 exponentiates
    it, and a larger clamp lets exp overflow to inf; None disables."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the per-token KL (> 0); None disables."""
    use_kl_in_reward: bool = False
    """The KL is folded into the reward by the trainer: the loss-side β is 0."""
    use_importance_sampling_correction: bool = False
    """Multiply the actor loss by π_prev / π_gen (off-policy generation correction)."""
    truncated_importance_sampling_type: TISType | None = None
    """'tis' clamps, 'icepop' zeroes out-of-range token weights, 'seq-mask-tis' drops sequences."""
    truncated_importance_sampling_ratio: float | None = None
    """Upper bound of the importance weights, in [1e-6, 1e6] (they scale the gradient, `FACTOR_MAX`); a
    value without a type means 'tis'."""
    truncated_importance_sampling_ratio_min: float | None = None
    """Lower bound, 0 or in [1e-6, 1e6] (tis: default 0; required by icepop and seq-mask-tis)."""
    use_on_policy_kl_approximation: bool = False
    """Weight the reference KL by π / π_gen instead of 1."""
    force_on_policy_ratio: bool = False
    """Ratio ≡ 1 with the policy gradient; prev_logprobs are not read."""
    use_cispo: bool = False
    """CISPO: clipped, detached ratio times the log-prob."""
    positive_example_nll_weight: float = 0.0
    """VAPO μ: weight of the NLL on positive-reward responses (local denominator); 0 or in [1e-6, 1e6]."""
    seq_logprob_error_in_loss: bool = False
    """Drop sequences whose mean exp|lp - lp_gen| exceeds seq_logprob_error_threshold."""
    metrics_level: Literal["full", "minimal"] = "full"
    """'minimal': only loss, kl_penalty, num_valid_samples, positive_nll_loss (+ sampling_importance_ratio
    with IS correction, is_oob_ratio with truncated IS, the in-loss filter's counts); same loss and gradients."""
    enable_torch_compile: bool = False
    """The loss compiles its own objective (torch.compile, fullgraph) on its first call, also after unpickling."""

    def __post_init__(self) -> None:
        check_fields(self)
        beta = self.reference_policy_kl_penalty
        require(beta >= 0, f"reference_policy_kl_penalty must be finite and >= 0, got {beta}")
        c = self.ratio_clip_c
        require(c is None or c > 1, f"ratio_clip_c must be > 1 for dual clipping, got {c}")
        for name in ("kl_input_clamp_value", "kl_output_clamp_value", "truncated_importance_sampling_ratio"):
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be > 0 (or None), got {value}")
        for name in (
            "ratio_clip_min",
            "ratio_clip_max",
            "truncated_importance_sampling_ratio_min",
            "positive_example_nll_weight",
        ):
            value = getattr(self, name)
            require(value is None or value >= 0, f"{name} must be >= 0, got {value}")
        clamp = self.kl_input_clamp_value
        require(
            clamp is None or clamp <= _EXP_MAX,
            f"kl_input_clamp_value must be <= log(float32 max) = {_EXP_MAX:.4f}, got {clamp}: the k3 estimator "
            "exponentiates the clamped log-ratio, and exp of a larger value overflows float32 to inf",
        )
        check_factor("reference_policy_kl_penalty", beta, "it scales the reference KL term")
        check_factor("positive_example_nll_weight", self.positive_example_nll_weight, "it scales the NLL term")
        for name in ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min"):
            check_factor(name, getattr(self, name), "it clamps the importance weights that scale the gradient")

    def validate(self, seq_logprob_error_threshold: float | None = None) -> None:
        """Cross-field checks (ref §4.1.2, §4.1.8), run by `ClippedPGLossFn`'s constructor."""
        if self.sequence_level_importance_ratios:
            require(
                not self.token_level_loss,
                "sequence_level_importance_ratios=True requires token_level_loss=False (GSPO is a sequence-level loss)",
            )
        if self.use_cispo:
            for field, bad in (
                ("disable_ppo_ratio", self.disable_ppo_ratio),
                ("force_on_policy_ratio", self.force_on_policy_ratio),
                ("sequence_level_importance_ratios", self.sequence_level_importance_ratios),
                ("ratio_clip_c", self.ratio_clip_c is not None),
                ("token_level_loss=False", not self.token_level_loss),
            ):
                require(not bad, f"use_cispo=True is incompatible with {field}")
        tis_type = self.truncated_importance_sampling_type
        hi, lo = self.truncated_importance_sampling_ratio, self.truncated_importance_sampling_ratio_min
        if tis_type is not None:
            require(
                self.use_importance_sampling_correction,
                "truncated_importance_sampling_type requires use_importance_sampling_correction=True",
            )
            require(hi is not None, f"truncated_importance_sampling_ratio must be > 0, got {hi}")
            if tis_type in ("icepop", "seq-mask-tis"):
                require(
                    lo is not None,
                    f"truncated_importance_sampling_type={tis_type!r} requires truncated_importance_sampling_ratio_min",
                )
            if tis_type == "seq-mask-tis":
                require(
                    not self.sequence_level_importance_ratios,
                    "truncated_importance_sampling_type='seq-mask-tis' is incompatible with "
                    "sequence_level_importance_ratios=True",
                )
        if hi is not None and lo is not None:
            require(
                lo <= hi,
                "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio",
            )
        if seq_logprob_error_threshold is not None:
            check_value("seq_logprob_error_threshold", seq_logprob_error_threshold, float)
            require(
                seq_logprob_error_threshold >= 0,
                f"seq_logprob_error_threshold must be >= 0, got {seq_logprob_error_threshold}",
            )
        if self.seq_logprob_error_in_loss:
            require(
                seq_logprob_error_threshold is not None,
                "seq_logprob_error_in_loss requires seq_logprob_error_threshold",
            )
            require(
                self.force_on_policy_ratio and self.token_level_loss,
                "seq_logprob_error_in_loss requires force_on_policy_ratio=True and token_level_loss=True",
            )
            require(
                self.positive_example_nll_weight == 0,
                "seq_logprob_error_in_loss does not support NLL (positive_example_nll_weight must be 0)",
            )


class ClippedPGLossData(TypedDict):
    """The data `ClippedPGLossFn` reads: `[B, S]` unless noted."""

    token_mask: Tensor
    sample_mask: Tensor  # [B]
    advantages: Tensor
    generation_logprobs: Tensor
    prev_logprobs: NotRequired[Tensor]  # not with force_on_policy_ratio
    reference_policy_logprobs: NotRequired[Tensor]  # with a reference KL (β ≠ 0)
    rewards: NotRequired[Tensor]  # [B], for positive_example_nll_weight
    curr_logprobs_unfiltered: NotRequired[Tensor]  # [B, S-1]; NeMo-RL's key (the loss input wins)
    opd_full_teacher_payload: NotRequired[Tensor]  # [B, S, D], with opd_full
    opd_full_teacher_index: NotRequired[Tensor]  # [B], with opd_full hidden-state payloads


class _Tokens(NamedTuple):
    """The per-token `[B, S-1]` inputs, aligned (ref §4.1.4)."""

    lp: Tensor  # current log-probs (grad-carrying)
    lp_u: Tensor  # unfiltered current log-probs (reference KL under top-k/top-p)
    lp_prev: Tensor
    lp_gen: Tensor
    lp_ref: Tensor | None
    adv: Tensor
    tm: Tensor  # token_mask[:, 1:]
    sm: Tensor  # sample_mask [B]
    mask: Tensor  # tm * sm[:, None]


@dataclasses.dataclass(frozen=True)
class ClippedPGLossFn:
    """Clipped policy-gradient loss (ref §4.1). `cfg`: `ClippedPGLossConfig` or mapping;
    `opd_full` (`OPDFullConfig` or mapping): full-vocabulary on-policy distillation instead
    of the policy-gradient objective (OPD_FULL inputs, `compiled_loss.losses.opd`).

    With `cfg.enable_torch_compile` the objective is compiled on the first call; the
    compiled function is never pickled or deep-copied (a copy compiles its own)."""

    cfg: ClippedPGLossConfig
    use_fused_linear_logprobs: bool = False
    opd_full: OPDFullConfig | None = None
    _: dataclasses.KW_ONLY
    seq_logprob_error_threshold: float | None = None
    _compiled: Callable[..., tuple[Tensor, dict[str, Tensor]]] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        cfg = as_config(self.cfg, ClippedPGLossConfig, "ClippedPGLossFn")
        object.__setattr__(self, "cfg", cfg)
        cfg.validate(self.seq_logprob_error_threshold)
        if self.opd_full is not None:
            object.__setattr__(self, "opd_full", as_config(self.opd_full, OPDFullConfig, "ClippedPGLossFn(opd_full)"))
            validate_opd_full(cfg, self.use_fused_linear_logprobs)
        object.__setattr__(self, "_compiled", None)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _compiled=None)

    @property
    def input_type(self) -> LossInputType:
        return LossInputType.LOGPROB if self.opd_full is None else LossInputType.OPD_FULL

    @property
    def input_spec(self) -> InputSpec:
        return InputSpec(
            self.input_type,
            unfiltered_logprobs=self.reference_policy_kl_penalty != 0,
            fused_linear_logprobs=self.use_fused_linear_logprobs,
            opd_full=self.opd_full,
            token_separable=not (self.cfg.sequence_level_importance_ratios or self.cfg.seq_logprob_error_in_loss),
            data=ClippedPGLossData,
        )

    @property
    def loss_type(self) -> LossType:
        return LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    @property
    def reference_policy_kl_penalty(self) -> float:
        """The loss-side β (0 when the KL is folded into the reward)."""
        return 0.0 if self.cfg.use_kl_in_reward else self.cfg.reference_policy_kl_penalty

    @property
    def requires_survivor_normalization(self) -> bool:
        return self.cfg.seq_logprob_error_in_loss

    @property
    def _tis_type(self) -> str | None:
        cfg = self.cfg
        if cfg.truncated_importance_sampling_ratio is None:
            return None
        return cfg.truncated_importance_sampling_type or "tis"

    @property
    def _minimal_metrics(self) -> frozenset[str]:
        """The metrics `metrics_level='minimal'` keeps."""
        keys = {
            "loss",
            KL_PENALTY_KEY,
            "num_valid_samples",
            "positive_nll_loss",
            "is_oob_ratio",
            "seq_logprob_error_valid_tokens",
            "seq_logprob_error_valid_seqs",
            "num_masked_seqs_by_logprob_error",
        }
        if self.cfg.use_importance_sampling_correction:
            keys.add("sampling_importance_ratio")
        return frozenset(keys)

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        """ref §4.1.3 (only the keys the metrics level reports)."""
        out = self._normalizations()
        if self.cfg.metrics_level == "minimal":
            out = {k: v for k, v in out.items() if k in self._minimal_metrics}
        return out

    def _normalizations(self) -> dict[str, MetricNormalizer]:
        if self.opd_full is not None:
            return opd_full_normalizations(self.opd_full, self.cfg.token_level_loss)
        grad = "TOKENS" if self.cfg.token_level_loss else "SEQUENCES"
        out = normalizations(
            TOKENS=(
                "probs_ratio",
                "probs_ratio_clamped",
                "token_mult_prob_error",
                "gen_kl_error",
                "policy_kl_error",
                "js_divergence_error",
                APPROX_ENTROPY_KEY,
            ),
            NONE=(
                "num_valid_samples",
                "positive_nll_loss",
                "probs_ratio_min",
                "probs_ratio_max",
                "probs_ratio_clamped_min",
                "probs_ratio_clamped_max",
            ),
        )
        out.update(normalizations(**{grad: ("loss", KL_PENALTY_KEY)}))
        seq_is = self.cfg.sequence_level_importance_ratios
        out["sampling_importance_ratio"] = MetricNormalizer.SEQUENCES if seq_is else MetricNormalizer.TOKENS
        if self._tis_type is not None:
            seq_tis = self._tis_type == "seq-mask-tis"
            out["is_oob_ratio"] = MetricNormalizer.SEQUENCES if seq_tis else MetricNormalizer.TOKENS
        if self.cfg.seq_logprob_error_in_loss:
            out.update(
                normalizations(
                    NONE=(
                        "seq_logprob_error_valid_tokens",
                        "seq_logprob_error_valid_seqs",
                        "num_masked_seqs_by_logprob_error",
                    )
                )
            )
        return out

    def __call__(
        self,
        next_token_logprobs: Tensor | None = None,
        data: ClippedPGLossData | None = None,
        global_valid_seqs: Tensor | None = None,
        global_valid_toks: Tensor | None = None,
        curr_logprobs_unfiltered: Tensor | None = None,
        **opd_full_inputs: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)`. LOGPROB inputs: `next_token_logprobs [B, S-1]`, and — top-k /
        top-p filtered log-probs with a reference KL — `curr_logprobs_unfiltered [B, S-1]` (or
        NeMo-RL's `data["curr_logprobs_unfiltered"]`; the keyword wins). OPD_FULL inputs
        (keywords): `opd_full_divergence`, `opd_full_entropy`, `opd_full_cross_entropy` `[B, S-1]`
        and `next_token_logprobs` when β ≠ 0."""
        objective: Callable[..., tuple[Tensor, dict[str, Tensor]]] = self._objective
        if self.cfg.enable_torch_compile and not torch.compiler.is_compiling():
            if self._compiled is None:
                object.__setattr__(self, "_compiled", compile_loss(self._objective, fullgraph=True))
            objective = self._compiled or objective
        return objective(
            next_token_logprobs, data, global_valid_seqs, global_valid_toks, curr_logprobs_unfiltered, **opd_full_inputs
        )

    def _objective(
        self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, unfiltered, **opd_full_inputs
    ):
        if data is None:
            raise ValueError("ClippedPGLossFn: data is required")
        unknown = sorted(set(opd_full_inputs) - _OPD_FULL_INPUTS)
        if unknown:
            raise TypeError(f"ClippedPGLossFn: unexpected inputs {unknown}")
        if self.opd_full is not None:
            loss, metrics = opd_full_objective(
                self.cfg,
                self.opd_full,
                self.reference_policy_kl_penalty,
                data,
                global_valid_seqs,
                global_valid_toks,
                opd_full_inputs,
                next_token_logprobs,
            )
        else:
            if any(v is not None for v in opd_full_inputs.values()):
                raise ValueError("ClippedPGLossFn: OPD_FULL inputs given to a loss built without opd_full")
            if next_token_logprobs is None:
                raise ValueError("ClippedPGLossFn: next_token_logprobs ([B, S-1]) is required")
            loss, metrics = self._policy_gradient(
                next_token_logprobs, data, global_valid_seqs, global_valid_toks, unfiltered
            )
        if self.cfg.metrics_level == "minimal":
            metrics = {k: v for k, v in metrics.items() if k in self._minimal_metrics}
        return loss, metrics

    def _policy_gradient(
        self,
        next_token_logprobs: Tensor,
        data: ClippedPGLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        unfiltered: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, beta = self.cfg, self.reference_policy_kl_penalty
        g_toks, g_seqs = global_valid_toks, global_valid_seqs
        x, extra = self._tokens(next_token_logprobs, data, unfiltered)
        diagnostics = self._diagnostics(x, g_toks) if cfg.metrics_level == "full" else {}
        kl = self._reference_kl(x, g_toks, g_seqs)
        ratio, ratio_c = self._ratios(x)
        is_w, tis_metrics = self._importance_weights(x, g_toks, g_seqs)
        weights = is_w if cfg.use_importance_sampling_correction else torch.ones_like(x.lp_prev)
        actor_loss = self._reduce(weights * self._clipped_objective(x, ratio, ratio_c), x, g_toks, g_seqs)
        nll = self._positive_nll(x, data)
        loss = actor_loss + kl + cfg.positive_example_nll_weight * nll
        r, rc = ratio.detach(), ratio_c.detach()
        if cfg.sequence_level_importance_ratios:  # post-truncation weights, squeezed (ref §13.3)
            sampling_ratio = masked_mean(is_w.squeeze(-1), x.sm, global_normalization_factor=g_seqs)
        else:
            sampling_ratio = masked_mean(is_w, x.mask, global_normalization_factor=g_toks)
        d_lp, d_gen = x.lp.detach(), x.lp_gen.detach()
        metrics = {
            "loss": loss.detach(),
            "probs_ratio": masked_mean(r, x.mask, global_normalization_factor=g_toks),
            "probs_ratio_clamped": masked_mean(rc, x.mask, global_normalization_factor=g_toks),
            "probs_ratio_min": masked_min(r, x.mask),
            "probs_ratio_max": masked_max(r, x.mask),
            "probs_ratio_clamped_min": masked_min(rc, x.mask),
            "probs_ratio_clamped_max": masked_max(rc, x.mask),
            KL_PENALTY_KEY: kl.detach() / beta if beta != 0 else x.lp.new_zeros(()),
            **diagnostics,
            "sampling_importance_ratio": sampling_ratio.detach(),
            "num_valid_samples": x.sm.sum(),
            APPROX_ENTROPY_KEY: -masked_mean(
                torch.exp(d_lp - d_gen) * d_lp, x.mask, global_normalization_factor=g_toks
            ),
            "positive_nll_loss": nll.detach(),
        }
        metrics.update({k: v.detach() for k, v in {**tis_metrics, **extra}.items()})
        return loss, metrics

    def token_objective(self, next_token_logprobs: Tensor, data: ClippedPGLossData) -> Tensor:
        """The actor objective per token, `[B, S-1]` like `next_token_logprobs`: the clipped
        surrogate (PPO with the dual clip, CISPO, REINFORCE, GSPO's sequence ratio), times the
        importance weights with `use_importance_sampling_correction`, 0 outside the mask. The
        loss's actor term is its reduction (`reduce_like_loss`); the reference KL and the NLL
        term are not in it. For front-ends that reduce tokens their own way (verl's
        `agg_loss`)."""
        x, _ = self._tokens(next_token_logprobs, data, None)
        per_token = self._clipped_objective(x, *self._ratios(x))
        if self.cfg.use_importance_sampling_correction:
            per_token = self._importance_weights(x, None, None)[0] * per_token
        return per_token

    # ---- the steps, in the reference's order -------------------------------------------

    def _tokens(
        self, lp: Tensor, data: ClippedPGLossData, unfiltered: Tensor | None
    ) -> tuple[_Tokens, dict[str, Tensor]]:
        """Check and align the inputs, zeroed outside the mask; apply the in-loss sequence
        filter (ref §4.1.8). `unfiltered`: the unfiltered log-probs (else NeMo-RL's data key,
        else `lp`)."""
        cfg, beta = self.cfg, self.reference_policy_kl_penalty
        keys: tuple[str, ...] = ("advantages", "generation_logprobs")
        keys += () if cfg.force_on_policy_ratio else ("prev_logprobs",)
        keys += ("reference_policy_logprobs",) if beta != 0 else ()
        check_logprob_inputs(lp, data, keys, "ClippedPGLossFn")
        tm, sm = float_masks(data, lp.dtype)
        mask0 = tm * sm[:, None]
        lp_u = data.get("curr_logprobs_unfiltered", lp) if unfiltered is None else unfiltered
        lp, lp_u, lp_gen, adv = zero_outside(
            mask0, lp, lp_u, data["generation_logprobs"][:, 1:], data["advantages"][:, 1:]
        )
        # with force_on_policy_ratio the previous policy is the current one (set once filtered, below)
        lp_prev = lp if cfg.force_on_policy_ratio else zero_outside(mask0, data["prev_logprobs"][:, 1:])[0]
        lp_ref = zero_outside(mask0, data["reference_policy_logprobs"][:, 1:])[0] if beta != 0 else None
        extra: dict[str, Tensor] = {}
        if cfg.seq_logprob_error_in_loss:
            err_tok = torch.exp((lp.detach() - lp_gen).abs())
            err = torch.where(mask0 > 0, err_tok, 0.0).sum(-1) / (mask0.sum(-1) + 1e-8)
            threshold = self.seq_logprob_error_threshold
            assert threshold is not None  # `validate`: the filter needs its threshold
            keep = (err <= threshold).to(sm.dtype)
            new_sm = sm * keep
            lp, lp_u, lp_gen = zero_outside(tm * new_sm[:, None], lp, lp_u, lp_gen)
            lp_ref = None if lp_ref is None else zero_outside(tm * new_sm[:, None], lp_ref)[0]
            extra = {
                "num_masked_seqs_by_logprob_error": (sm * (1 - keep)).sum(),
                "seq_logprob_error_valid_tokens": (tm * new_sm[:, None]).sum(),
                "seq_logprob_error_valid_seqs": new_sm.sum(),
            }
            sm = new_sm
        if cfg.force_on_policy_ratio:
            lp_prev = lp.detach()
        return _Tokens(lp, lp_u, lp_prev, lp_gen, lp_ref, adv, tm, sm, tm * sm[:, None]), extra

    def _diagnostics(self, x: _Tokens, g_toks: Tensor | None) -> dict[str, Tensor]:
        """Generation-vs-previous-policy mismatch metrics (ref §4.1.5 step 1), no gradient."""
        kl_type = self.cfg.reference_policy_kl_type
        prev, gen = x.lp_prev.detach(), x.lp_gen.detach()
        log_m = torch.logaddexp(prev, gen) - math.log(2.0)
        a, b = prev - log_m, gen - log_m
        js = 0.5 * (torch.exp(a) - a - 1) + 0.5 * (torch.exp(b) - b - 1)
        per_token = {
            "token_mult_prob_error": torch.exp((gen - prev).abs() * x.mask),
            "gen_kl_error": calculate_kl(gen, prev, kl_type, None, None),
            "policy_kl_error": calculate_kl(prev, gen, kl_type, None, None),
            "js_divergence_error": js,
        }
        return {k: masked_mean(v, x.mask, global_normalization_factor=g_toks) for k, v in per_token.items()}

    def _reference_kl(self, x: _Tokens, g_toks: Tensor | None, g_seqs: Tensor | None) -> Tensor:
        """β · KL(π ‖ π_ref) with the score-function weights (ref §4.1.5 step 2, §13.5)."""
        cfg, beta = self.cfg, self.reference_policy_kl_penalty
        if x.lp_ref is None:  # β = 0
            return x.lp.new_zeros(())
        if cfg.use_on_policy_kl_approximation:
            w_kl = torch.exp(x.lp_u - x.lp_gen)
        else:
            w_kl = torch.exp(x.lp_u - x.lp_u.detach())
        kl_tok = beta * calculate_kl(
            x.lp_u,
            x.lp_ref,
            cfg.reference_policy_kl_type,
            cfg.kl_input_clamp_value,
            cfg.kl_output_clamp_value,
            nan_to_zero(w_kl),
        )
        return self._reduce(kl_tok, x, g_toks, g_seqs)

    def _ratios(self, x: _Tokens) -> tuple[Tensor, Tensor]:
        """Probability ratio and its clipped version (ref §4.1.5 step 3)."""
        cfg = self.cfg
        if cfg.force_on_policy_ratio:
            ratio = torch.exp(x.lp - x.lp.detach())
            return ratio, ratio
        if cfg.disable_ppo_ratio:  # REINFORCE: the "ratio" is the log-prob itself
            return x.lp, x.lp
        log_ratio = x.lp - x.lp_prev
        if cfg.sequence_level_importance_ratios:  # GSPO: geometric mean over `tm` (not `mask`)
            ratio = torch.exp(masked_mean(log_ratio, x.tm, dim=-1))[:, None].expand_as(x.lp)
        else:
            ratio = torch.exp(log_ratio)
        return ratio, ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)

    def _clipped_objective(self, x: _Tokens, ratio: Tensor, ratio_c: Tensor) -> Tensor:
        """Per-token clipped surrogate, CISPO or PPO, with the dual clip (steps 4)."""
        cfg, adv = self.cfg, x.adv
        if cfg.use_cispo:
            clip_loss = -adv * ratio_c.detach() * x.lp
        else:
            clip_loss = torch.maximum(-adv * ratio, -adv * ratio_c)
        if cfg.ratio_clip_c is not None:
            clip_loss = torch.where(adv < 0, torch.minimum(clip_loss, -adv * cfg.ratio_clip_c), clip_loss)
        return clip_loss

    def _importance_weights(
        self, x: _Tokens, g_toks: Tensor | None, g_seqs: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """π_prev / π_gen weights with their truncation (ref §4.1.5 step 5): `[B, S-1]`, or
        `[B, 1]` under GSPO; plus `is_oob_ratio` when truncated."""
        cfg, tis_type = self.cfg, self._tis_type
        if cfg.sequence_level_importance_ratios:
            is_w = nan_to_zero(torch.exp(((x.lp_prev - x.lp_gen) * x.mask).sum(-1, keepdim=True))).detach()
        else:
            is_w = nan_to_zero(torch.exp(x.lp_prev - x.lp_gen))
        if tis_type is None:
            return is_w, {}
        hi, lo = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
        assert hi is not None  # `validate`: a truncation type needs its ratio
        dtype = x.lp.dtype
        if tis_type == "tis":
            lo = 0.0 if lo is None else lo
            oob = masked_mean(((is_w > hi) | (is_w < lo)).to(dtype), x.mask, global_normalization_factor=g_toks)
            return is_w.clamp(lo, hi), {"is_oob_ratio": oob}
        assert lo is not None  # `validate`: icepop and seq-mask-tis need the minimum
        if tis_type == "icepop":
            keep = (is_w >= lo) & (is_w <= hi)
            oob = masked_mean((~keep).to(dtype), x.mask, global_normalization_factor=g_toks)
            return torch.where(keep, is_w, 0.0), {"is_oob_ratio": oob}
        # seq-mask-tis: drop whole sequences; kept ones keep their untruncated token weights
        seq_ratio = torch.exp(masked_mean(nan_to_zero(x.lp_prev - x.lp_gen), x.tm, dim=-1)).detach()
        keep_s = ((seq_ratio >= lo) & (seq_ratio <= hi)).to(dtype)
        oob = masked_mean(1 - keep_s, x.sm, global_normalization_factor=g_seqs)
        return is_w * keep_s[:, None], {"is_oob_ratio": oob}

    def _positive_nll(self, x: _Tokens, data: ClippedPGLossData) -> Tensor:
        """VAPO: NLL over positive-reward responses, LOCAL denominator (ref §13.6); exactly
        0 when the micro-batch holds no positive-reward token (as the reference skips it)."""
        if not (self.cfg.positive_example_nll_weight > 0 and "rewards" in data):
            return x.lp.new_zeros(())
        correct = x.mask * (data["rewards"] > 0).to(x.lp.dtype)[:, None]
        return masked_mean(torch.where(correct > 0, -x.lp, 0.0), correct)

    def _reduce(self, per_token: Tensor, x: _Tokens, g_toks: Tensor | None, g_seqs: Tensor | None) -> Tensor:
        """Token mean (G_t) or sequence mean of per-sequence token means (G_s)."""
        return reduce_like_loss(per_token, x.tm, x.sm, self.cfg.token_level_loss, g_toks, g_seqs)
