"""Loss functions with NeMo-RL semantics (ref §3–4), as stateless frozen objects.

Every loss is pure tensor math: no `.item()`, no data-dependent Python branching, no
boolean-mask indexing. Each returns `(loss, metrics)` with 0-d tensor metrics under
NeMo-RL's keys; extrema use the ±inf sentinel convention (see `compiled_loss.metrics`).
Configs are frozen dataclasses; every loss also accepts a plain mapping for its config.
Constructor validation raises `ValueError` naming the field (NeMo-RL asserts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F

from compiled_loss.interfaces import LossInputType, LossType, MetricNormalizer
from compiled_loss.vocab import vocab_reduce

Tensor = torch.Tensor

KL_PENALTY_KEY = "kl_penalty"
APPROX_ENTROPY_KEY = "approx_entropy"
DEFAULT_DRAFT_TOKEN_CHUNK_SIZE = 4096

_C = TypeVar("_C")


def as_config(cfg: Any, cls: type[_C], name: str) -> _C:
    """A config dataclass from itself or from a plain mapping (unknown keys rejected)."""
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"{name}: unknown config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**cfg)
    raise TypeError(f"{name}: cfg must be a {cls.__name__} or a mapping, got {type(cfg).__name__}")


def require_keys(data: Mapping[str, Any], keys: tuple[str, ...], who: str) -> None:
    """ValueError naming the first key of `keys` missing from `data`."""
    for key in keys:
        if key not in data:
            raise ValueError(f"{who}: data is missing key {key!r} (present: {sorted(data)})")


def _require_shape(tensor: Tensor, shape: tuple[int, ...], what: str, who: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{who}: {what} must have shape {shape}, got {tuple(tensor.shape)}")


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """`sum(values * mask, dim) / (N + 1e-8)`, `N = sum(mask, dim)` or the global factor.

    An all-zero mask gives exactly 0 (never NaN). With a global factor the result is a
    fragment of the global mean: fragments from micro-batches sum to it.
    """
    masked = values * mask
    num = masked.sum() if dim is None else masked.sum(dim)
    if global_normalization_factor is None:
        den = mask.sum() if dim is None else mask.sum(dim)
    else:
        den = global_normalization_factor
    return num / (den + 1e-8)


def calculate_kl(
    logprobs: Tensor,
    logprobs_reference: Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: Tensor | None = None,
) -> Tensor:
    """Per-element KL estimator (ref §3.1); `logr = logprobs_reference - logprobs`."""
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        clamped = logr.clamp(-input_clamp_value, input_clamp_value)
        if importance_sampling_weights is not None:
            importance_sampling_weights = torch.where(
                logr != clamped,
                importance_sampling_weights.detach(),
                importance_sampling_weights,
            )
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_type must be one of 'k1', 'k2', 'k3', got {kl_type!r}")
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def _masked_min(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, values, float("inf")).amin()


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, values, float("-inf")).amax()


def _nan_to_zero(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _float_masks(data: Mapping[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`token_mask[:, 1:]` and `sample_mask`, as `dtype`."""
    return data["token_mask"][:, 1:].to(dtype), data["sample_mask"].to(dtype)


def _check_logprob_inputs(lp: Tensor, data: Mapping[str, Tensor], keys: tuple[str, ...], who: str):
    require_keys(data, ("token_mask", "sample_mask") + keys, who)
    rows, width = data["token_mask"].shape
    _require_shape(lp, (rows, width - 1), "next_token_logprobs ([B, S-1])", who)
    _require_shape(data["sample_mask"], (rows,), "data['sample_mask'] ([B])", who)
    for key in keys:
        _require_shape(data[key], (rows, width), f"data[{key!r}] ([B, S])", who)


# ---------------------------------------------------------------------------------------
# Clipped policy gradient (PPO / GRPO / DAPO / REINFORCE / GSPO / CISPO / VAPO), ref §4.1
# ---------------------------------------------------------------------------------------

_TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


@dataclasses.dataclass(frozen=True)
class ClippedPGLossConfig:
    disable_ppo_ratio: bool = False
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    use_on_policy_kl_approximation: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0
    seq_logprob_error_in_loss: bool = False

    def __post_init__(self) -> None:
        beta = self.reference_policy_kl_penalty
        if not math.isfinite(beta) or beta < 0:
            raise ValueError(f"reference_policy_kl_penalty must be finite and >= 0, got {beta}")
        if self.reference_policy_kl_type not in ("k1", "k2", "k3"):
            raise ValueError(
                f"reference_policy_kl_type must be one of 'k1', 'k2', 'k3', got "
                f"{self.reference_policy_kl_type!r}"
            )


@dataclasses.dataclass(frozen=True)
class ClippedPGLossFn:
    """Clipped policy-gradient loss (ref §4.1). `cfg`: `ClippedPGLossConfig` or mapping."""

    cfg: ClippedPGLossConfig
    use_fused_linear_logprobs: bool = False
    opd_full: Any = None
    _: dataclasses.KW_ONLY
    seq_logprob_error_threshold: float | None = None

    def __post_init__(self) -> None:
        cfg = as_config(self.cfg, ClippedPGLossConfig, "ClippedPGLossFn")
        object.__setattr__(self, "cfg", cfg)
        if self.opd_full is not None:
            raise NotImplementedError(
                "ClippedPGLossFn(opd_full=...): the full-vocab on-policy distillation branch is "
                "not implemented in compiled_loss yet"
            )
        seq_level = not cfg.token_level_loss
        if cfg.sequence_level_importance_ratios and not seq_level:
            raise ValueError(
                "sequence_level_importance_ratios=True requires token_level_loss=False "
                "(GSPO is a sequence-level loss)"
            )
        if cfg.use_cispo:
            for field, bad in (
                ("disable_ppo_ratio", cfg.disable_ppo_ratio),
                ("force_on_policy_ratio", cfg.force_on_policy_ratio),
                ("sequence_level_importance_ratios", cfg.sequence_level_importance_ratios),
                ("ratio_clip_c", cfg.ratio_clip_c is not None),
                ("token_level_loss=False", seq_level),
            ):
                if bad:
                    raise ValueError(f"use_cispo=True is incompatible with {field}")
        tis_type = cfg.truncated_importance_sampling_type
        if tis_type is not None:
            if not cfg.use_importance_sampling_correction:
                raise ValueError(
                    "truncated_importance_sampling_type requires "
                    "use_importance_sampling_correction=True"
                )
            if tis_type not in _TIS_TYPES:
                raise ValueError(
                    f"truncated_importance_sampling_type must be one of {list(_TIS_TYPES)}, got "
                    f"{tis_type!r}"
                )
        hi, lo = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
        if tis_type is not None or hi is not None:
            if hi is None or hi <= 0:
                raise ValueError(f"truncated_importance_sampling_ratio must be > 0, got {hi}")
            if lo is not None and lo > hi:
                raise ValueError(
                    "truncated_importance_sampling_ratio_min must be <= "
                    "truncated_importance_sampling_ratio"
                )
            if tis_type in ("icepop", "seq-mask-tis") and lo is None:
                raise ValueError(
                    f"truncated_importance_sampling_type={tis_type!r} requires "
                    "truncated_importance_sampling_ratio_min"
                )
            if tis_type == "seq-mask-tis" and cfg.sequence_level_importance_ratios:
                raise ValueError(
                    "truncated_importance_sampling_type='seq-mask-tis' is incompatible with "
                    "sequence_level_importance_ratios=True"
                )
        if cfg.ratio_clip_c is not None and cfg.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1 for dual clipping, got {cfg.ratio_clip_c}")
        if cfg.seq_logprob_error_in_loss:
            if self.seq_logprob_error_threshold is None:
                raise ValueError(
                    "seq_logprob_error_in_loss requires seq_logprob_error_threshold"
                )
            if not (cfg.force_on_policy_ratio and cfg.token_level_loss):
                raise ValueError(
                    "seq_logprob_error_in_loss requires force_on_policy_ratio=True and "
                    "token_level_loss=True"
                )
            if cfg.positive_example_nll_weight != 0:
                raise ValueError(
                    "seq_logprob_error_in_loss does not support NLL "
                    "(positive_example_nll_weight must be 0)"
                )

    @property
    def loss_type(self) -> LossType:
        return LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    @property
    def input_type(self) -> LossInputType:
        return LossInputType.LOGPROB

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
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        T, S, N = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
        grad = T if self.cfg.token_level_loss else S
        out = {"loss": grad, KL_PENALTY_KEY: grad}
        for key in ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error",
                    "gen_kl_error", "policy_kl_error", "js_divergence_error", APPROX_ENTROPY_KEY):
            out[key] = T
        out["sampling_importance_ratio"] = S if self.cfg.sequence_level_importance_ratios else T
        for key in ("num_valid_samples", "positive_nll_loss", "probs_ratio_min",
                    "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
            out[key] = N
        if self._tis_type is not None:
            out["is_oob_ratio"] = S if self._tis_type == "seq-mask-tis" else T
        if self.cfg.seq_logprob_error_in_loss:
            for key in ("seq_logprob_error_valid_tokens", "seq_logprob_error_valid_seqs",
                        "num_masked_seqs_by_logprob_error"):
                out[key] = N
        return out

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        who = "ClippedPGLossFn"
        beta = self.reference_policy_kl_penalty
        keys = ("advantages", "generation_logprobs")
        if not cfg.force_on_policy_ratio:
            keys += ("prev_logprobs",)
        if beta != 0:
            keys += ("reference_policy_logprobs",)
        _check_logprob_inputs(next_token_logprobs, data, keys, who)
        g_toks, g_seqs = global_valid_toks, global_valid_seqs
        gspo = cfg.sequence_level_importance_ratios

        lp = next_token_logprobs
        tm, sm = _float_masks(data, lp.dtype)
        adv = data["advantages"][:, 1:]
        lp_gen = data["generation_logprobs"][:, 1:]
        lp_ref = data["reference_policy_logprobs"][:, 1:] if beta != 0 else None
        lp_u = data.get("curr_logprobs_unfiltered", lp)
        metrics_extra: dict[str, Tensor] = {}

        if cfg.seq_logprob_error_in_loss:  # in-loss sequence rejection (ref §4.1.8)
            mask0 = tm * sm[:, None]
            err_tok = torch.exp((lp.detach() - lp_gen).abs())
            err = torch.where(mask0 > 0, err_tok, 0.0).sum(-1) / (mask0.sum(-1) + 1e-8)
            keep = (err <= self.seq_logprob_error_threshold).to(sm.dtype)
            new_sm = sm * keep
            survivors = tm * new_sm[:, None] > 0
            lp = torch.where(survivors, lp, 0.0)
            lp_u = torch.where(survivors, lp_u, 0.0)
            lp_gen = torch.where(survivors, lp_gen, 0.0)
            if lp_ref is not None:
                lp_ref = torch.where(survivors, lp_ref, 0.0)
            metrics_extra = {
                "num_masked_seqs_by_logprob_error": (sm * (1 - keep)).sum(),
                "seq_logprob_error_valid_tokens": (tm * new_sm[:, None]).sum(),
                "seq_logprob_error_valid_seqs": new_sm.sum(),
            }
            sm = new_sm
        mask = tm * sm[:, None]
        lp_prev = lp.detach() if cfg.force_on_policy_ratio else data["prev_logprobs"][:, 1:]

        # 1. diagnostics (no gradient)
        d_prev, d_gen, d_lp = lp_prev.detach(), lp_gen.detach(), lp.detach()
        token_mult_prob_error = masked_mean(
            torch.exp((d_gen - d_prev).abs() * mask), mask, global_normalization_factor=g_toks
        )
        gen_kl_error = masked_mean(
            calculate_kl(d_gen, d_prev, cfg.reference_policy_kl_type, None, None),
            mask,
            global_normalization_factor=g_toks,
        )
        policy_kl_error = masked_mean(
            calculate_kl(d_prev, d_gen, cfg.reference_policy_kl_type, None, None),
            mask,
            global_normalization_factor=g_toks,
        )
        log_m = torch.logaddexp(d_prev, d_gen) - math.log(2.0)
        a, b = d_prev - log_m, d_gen - log_m
        js = 0.5 * (torch.exp(a) - a - 1) + 0.5 * (torch.exp(b) - b - 1)
        js_divergence_error = masked_mean(js, mask, global_normalization_factor=g_toks)

        # 2. reference-policy KL
        if beta != 0:
            if cfg.use_on_policy_kl_approximation:
                w_kl = torch.exp(lp_u - lp_gen)
            else:
                w_kl = torch.exp(lp_u - lp_u.detach())
            kl_tok = beta * calculate_kl(
                lp_u, lp_ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value, _nan_to_zero(w_kl),
            )
            kl = self._reduce(kl_tok, tm, sm, mask, g_toks, g_seqs)
        else:
            kl = lp.new_zeros(())

        # 3. ratios
        if cfg.force_on_policy_ratio:
            ratio = torch.exp(lp - lp.detach())
            ratio_c = ratio
        elif not cfg.disable_ppo_ratio:
            log_ratio = lp - lp_prev
            if gspo:
                ratio = torch.exp(masked_mean(log_ratio, tm, dim=-1))[:, None].expand_as(lp)
            else:
                ratio = torch.exp(log_ratio)
            ratio_c = ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        else:  # REINFORCE: the "ratio" is the log-prob itself
            ratio = ratio_c = lp

        # 4. clipped objective
        if cfg.use_cispo:
            clip_loss = -adv * ratio_c.detach() * lp
        else:
            clip_loss = torch.maximum(-adv * ratio, -adv * ratio_c)
        if cfg.ratio_clip_c is not None:
            clip_loss = torch.where(
                adv < 0, torch.minimum(clip_loss, -adv * cfg.ratio_clip_c), clip_loss
            )

        # 5. actor importance weights (always computed; applied only with IS correction)
        if gspo:
            is_w = _nan_to_zero(torch.exp(((lp_prev - lp_gen) * mask).sum(-1, keepdim=True))).detach()
        else:
            is_w = _nan_to_zero(torch.exp(lp_prev - lp_gen))
        tis_type = self._tis_type
        if tis_type is not None:
            hi = cfg.truncated_importance_sampling_ratio
            lo = cfg.truncated_importance_sampling_ratio_min
            if tis_type == "tis":
                lo = 0.0 if lo is None else lo
                oob = (is_w > hi) | (is_w < lo)
                metrics_extra["is_oob_ratio"] = masked_mean(oob.to(lp.dtype), mask, global_normalization_factor=g_toks)
                is_w = is_w.clamp(lo, hi)
            elif tis_type == "icepop":
                keep = (is_w >= lo) & (is_w <= hi)
                metrics_extra["is_oob_ratio"] = masked_mean(
                    (~keep).to(lp.dtype), mask, global_normalization_factor=g_toks
                )
                is_w = torch.where(keep, is_w, 0.0)
            else:  # seq-mask-tis
                seq_ratio = torch.exp(masked_mean(_nan_to_zero(lp_prev - lp_gen), tm, dim=-1)).detach()
                keep_s = ((seq_ratio >= lo) & (seq_ratio <= hi)).to(lp.dtype)
                metrics_extra["is_oob_ratio"] = masked_mean(1 - keep_s, sm, global_normalization_factor=g_seqs)
                is_w = is_w * keep_s[:, None]
        weights = is_w if cfg.use_importance_sampling_correction else torch.ones_like(lp_prev)

        # 6. actor loss
        actor_loss = self._reduce(weights * clip_loss, tm, sm, mask, g_toks, g_seqs)

        # 7. sampling importance ratio (post-truncation weights; squeezed under GSPO)
        if gspo:
            sampling_importance_ratio = masked_mean(is_w.squeeze(-1), sm, global_normalization_factor=g_seqs)
        else:
            sampling_importance_ratio = masked_mean(is_w, mask, global_normalization_factor=g_toks)

        # 8. approximate entropy
        approx_entropy = -masked_mean(torch.exp(d_lp - d_gen) * d_lp, mask, global_normalization_factor=g_toks)

        # 9. VAPO positive-example NLL (local denominator, ref §13.6)
        mu = cfg.positive_example_nll_weight
        if mu > 0 and "rewards" in data:
            correct = mask * (data["rewards"] > 0).to(lp.dtype)[:, None]
            nll = masked_mean(-lp, correct)
        else:
            nll = lp.new_zeros(())

        loss = actor_loss + kl + mu * nll
        r, rc = ratio.detach(), ratio_c.detach()
        metrics = {
            "loss": loss.detach(),
            "probs_ratio": masked_mean(r, mask, global_normalization_factor=g_toks),
            "probs_ratio_clamped": masked_mean(rc, mask, global_normalization_factor=g_toks),
            "probs_ratio_min": _masked_min(r, mask),
            "probs_ratio_max": _masked_max(r, mask),
            "probs_ratio_clamped_min": _masked_min(rc, mask),
            "probs_ratio_clamped_max": _masked_max(rc, mask),
            KL_PENALTY_KEY: kl.detach() / beta if beta != 0 else lp.new_zeros(()),
            "token_mult_prob_error": token_mult_prob_error,
            "gen_kl_error": gen_kl_error,
            "policy_kl_error": policy_kl_error,
            "js_divergence_error": js_divergence_error,
            "sampling_importance_ratio": sampling_importance_ratio.detach(),
            "num_valid_samples": sm.sum(),
            APPROX_ENTROPY_KEY: approx_entropy,
            "positive_nll_loss": nll.detach(),
        }
        metrics.update({k: v.detach() for k, v in metrics_extra.items()})
        return loss, metrics

    def _reduce(self, per_token, tm, sm, mask, g_toks, g_seqs) -> Tensor:
        """Token mean (G_t) or sequence mean of per-sequence token means (G_s), ref §13.16."""
        if self.cfg.token_level_loss:
            return masked_mean(per_token, mask, global_normalization_factor=g_toks)
        return masked_mean(masked_mean(per_token, tm, dim=-1), sm, global_normalization_factor=g_seqs)


# ---------------------------------------------------------------------------------------
# NLL, preference, DPO (ref §4.2–4.4)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NLLLossFn:
    """Token-level negative log-likelihood (ref §4.2)."""

    use_fused_linear_logprobs: bool = False

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return {
            "loss": MetricNormalizer.TOKENS,
            "num_unmasked_tokens": MetricNormalizer.NONE,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        dpo_loss: bool = False,
        dpo_average_log_probs: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _check_logprob_inputs(next_token_logprobs, data, (), "NLLLossFn")
        lp = next_token_logprobs
        tm, sm = _float_masks(data, lp.dtype)
        mask = tm * sm[:, None]
        if dpo_loss:  # per-sample summed (or averaged) NLL, shape [B]
            loss = -(lp * mask).sum(-1)
            if dpo_average_log_probs:
                loss = loss / mask.sum(-1).clamp(min=1)
            loss_metric = loss.detach()
        else:
            loss = -masked_mean(lp, mask, global_normalization_factor=global_valid_toks)
            loss_metric = loss.detach()
        return loss, {
            "loss": loss_metric,
            "num_unmasked_tokens": mask.sum(),
            "num_valid_samples": sm.sum(),
        }


def _preference_loss(
    rewards: Tensor, sample_mask: Tensor, global_valid_seqs: Tensor | None, beta: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss over interleaved (chosen, rejected) rows (ref §4.3), with its
    accuracy / reward metrics and `num_valid_samples` (pairs)."""
    chosen, rejected = rewards[::2], rewards[1::2]
    sm_chosen, sm_rejected = sample_mask[::2], sample_mask[1::2]
    g_pairs = None if global_valid_seqs is None else global_valid_seqs / 2
    per_pair = -F.logsigmoid(beta * (chosen - rejected)) * sm_chosen
    loss = masked_mean(per_pair, sm_chosen, global_normalization_factor=g_pairs)
    return loss, {
        "accuracy": masked_mean(
            (chosen > rejected).to(rewards.dtype), sm_chosen, global_normalization_factor=g_pairs
        ),
        "rewards_chosen_mean": masked_mean(chosen.detach(), sm_chosen, global_normalization_factor=g_pairs),
        "rewards_rejected_mean": masked_mean(
            rejected.detach(), sm_rejected, global_normalization_factor=g_pairs
        ),
        "num_valid_samples": sample_mask.sum() / 2,
    }


def _check_pairs(rows: int, who: str) -> None:
    if rows % 2:
        raise ValueError(
            f"{who}: rows must be interleaved (chosen, rejected) pairs, got an odd batch of {rows}"
        )


def _sequence_normalizations(keys: tuple[str, ...]) -> dict[str, MetricNormalizer]:
    out = {k: MetricNormalizer.SEQUENCES for k in keys}
    out["num_valid_samples"] = MetricNormalizer.NONE
    return out


@dataclasses.dataclass(frozen=True)
class PreferenceLossFn:
    """Reward-model preference loss over interleaved chosen/rejected rows (ref §4.3)."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations(
            ("loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean")
        )

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "PreferenceLossFn"
        require_keys(data, ("sample_mask",), who)
        rewards = logits.squeeze(-1) if logits.dim() > 1 else logits
        sm = data["sample_mask"]
        if rewards.dim() != 1 or rewards.shape[0] != sm.shape[0]:
            raise ValueError(
                f"{who}: logits must hold one reward per row ([B] or [B, 1] with B = "
                f"{sm.shape[0]}), got shape {tuple(logits.shape)}"
            )
        _check_pairs(sm.shape[0], who)
        loss, metrics = _preference_loss(rewards, sm.to(rewards.dtype), global_valid_seqs)
        return loss, {"loss": loss.detach(), **metrics}


@dataclasses.dataclass(frozen=True)
class DPOLossConfig:
    reference_policy_kl_penalty: float = 0.05
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False


@dataclasses.dataclass(frozen=True)
class DPOLossFn:
    """Direct preference optimisation with an optional chosen-row SFT term (ref §4.4).

    `data["reference_policy_logprobs"]` is PRE-ROLLED by the DPO driver (entry t is the
    reference log-prob of token t+1), so it is sliced `[:, :-1]`.
    """

    cfg: DPOLossConfig
    use_fused_linear_logprobs: bool = False

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, DPOLossConfig, "DPOLossFn"))

    @property
    def reference_policy_kl_penalty(self) -> float:
        return self.cfg.reference_policy_kl_penalty

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations(
            ("loss", "sft_loss", "preference_loss", "accuracy", "rewards_chosen_mean",
             "rewards_rejected_mean")
        )

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "DPOLossFn"
        cfg = self.cfg
        lp = next_token_logprobs
        _check_logprob_inputs(lp, data, ("reference_policy_logprobs",), who)
        _check_pairs(lp.shape[0], who)
        tm, sm = _float_masks(data, lp.dtype)
        ref = data["reference_policy_logprobs"][:, :-1]
        reward = ((lp - ref) * tm).sum(-1)
        if cfg.preference_average_log_probs:
            reward = reward / tm.sum(-1).clamp(min=1)
        pref_loss, pref_metrics = _preference_loss(reward, sm, global_valid_seqs, cfg.reference_policy_kl_penalty)
        if cfg.sft_loss_weight > 0:
            if global_valid_toks is None:
                raise ValueError(f"{who}: sft_loss_weight > 0 requires global_valid_toks")
            sft_per_row, _ = NLLLossFn()(
                lp, data, global_valid_seqs, global_valid_toks,
                dpo_loss=True, dpo_average_log_probs=cfg.sft_average_log_probs,
            )
            g_pairs = None if global_valid_seqs is None else global_valid_seqs / 2
            sft = masked_mean(sft_per_row[::2], sm[::2], global_normalization_factor=g_pairs)
        else:
            sft = lp.new_zeros(())
        loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * pref_loss
        return loss, {
            "loss": loss.detach(),
            "sft_loss": sft.detach(),
            "preference_loss": pref_loss.detach(),
            **pref_metrics,
        }


# ---------------------------------------------------------------------------------------
# Top-k distillation (ref §4.5)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistillationLossConfig:
    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    mixed_kl_weight: float = 0.5
    zero_outside_topk: bool = False

    def __post_init__(self) -> None:
        if self.kl_type not in ("forward", "reverse", "mixed"):
            raise ValueError(
                f"kl_type must be one of 'forward', 'reverse', 'mixed', got {self.kl_type!r}"
            )
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise ValueError(f"mixed_kl_weight must be in [0, 1], got {self.mixed_kl_weight}")


@dataclasses.dataclass(frozen=True)
class DistillationLossFn:
    """KL between student and teacher top-k distributions (ref §4.5)."""

    cfg: DistillationLossConfig

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION
    log_infinitesimal = -100.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "cfg", as_config(self.cfg, DistillationLossConfig, "DistillationLossFn")
        )

    @property
    def kl_type(self) -> str:
        return self.cfg.kl_type

    @property
    def mixed_kl_weight(self) -> float:
        return self.cfg.mixed_kl_weight

    @property
    def zero_outside_topk(self) -> bool:
        return self.cfg.zero_outside_topk

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return {"loss": MetricNormalizer.TOKENS, "num_valid_samples": MetricNormalizer.NONE}

    def __call__(
        self,
        student_topk_logprobs: Tensor,
        teacher_topk_logprobs: Tensor,
        H_all: Tensor | None,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "DistillationLossFn"
        s, t = student_topk_logprobs, teacher_topk_logprobs
        if s.shape != t.shape or s.dim() != 3:
            raise ValueError(
                f"{who}: student/teacher top-k log-probs must both be [B, S-1, k], got "
                f"{tuple(s.shape)} and {tuple(t.shape)}"
            )
        kl_type, w = self.cfg.kl_type, self.cfg.mixed_kl_weight
        ps, pt = torch.exp(s), torch.exp(t)
        forward = (pt * (t - s)).sum(-1)
        reverse = (ps * (s - t)).sum(-1)
        if kl_type == "forward":
            per_token = forward
        elif kl_type == "reverse":
            per_token = reverse
        else:
            per_token = w * forward + (1 - w) * reverse
        if self.cfg.zero_outside_topk and kl_type != "forward":
            if H_all is None:
                raise ValueError(f"{who}: zero_outside_topk with kl_type={kl_type!r} needs H_all")
            h_rest = H_all - (ps * s).sum(-1)
            p_rest = 1 - ps.sum(-1)
            correction = h_rest - self.log_infinitesimal * p_rest
            if kl_type == "mixed":
                correction = correction * (1 - w)
            per_token = per_token + correction
        if "token_mask" in data and "sample_mask" in data:
            mask = data["token_mask"][:, 1:][:, : per_token.shape[1]].to(per_token.dtype)
            sm = data["sample_mask"].to(per_token.dtype)
            loss = masked_mean(per_token, mask * sm[:, None], global_normalization_factor=global_valid_toks)
            num_valid = sm.sum()
        else:
            loss = per_token.mean()
            num_valid = per_token.new_tensor(float(per_token.shape[0]))
        return loss, {"loss": loss.detach(), "num_valid_samples": num_valid}


# ---------------------------------------------------------------------------------------
# Draft soft cross-entropy (ref §4.6, §7.7)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DraftLossStats:
    """Raw per-bin numerators, counts and weights of a draft loss (ref §7.7)."""

    numerators: Tensor
    counts: Tensor
    weights: Tensor

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.numerators, self.counts, self.weights)}
        if len(shapes) != 1 or self.numerators.dim() != 1:
            raise ValueError(
                "DraftLossStats: numerators, counts and weights must be 1-D of one shape, got "
                f"{[tuple(t.shape) for t in (self.numerators, self.counts, self.weights)]}"
            )

    def normalized(self, normalization_counts: Tensor) -> Tensor:
        """`Σ(num·w) / (Σ(counts·w) + 1e-8)` with the given (detached, fp32) counts."""
        counts = normalization_counts.detach().float()
        if tuple(counts.shape) != tuple(self.counts.shape):
            raise ValueError(
                f"DraftLossStats.normalized: normalization_counts must have shape "
                f"{tuple(self.counts.shape)}, got {tuple(counts.shape)}"
            )
        return (self.numerators * self.weights).sum() / ((counts * self.weights).sum() + 1e-8)


def soft_cross_entropy_sum(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, token_chunk_size: int | None
) -> Tensor:
    """`Σ_t mask_t · H(softmax(teacher_t), log_softmax(student_t))` over `[..., V]` rows.

    The teacher is detached; the gradient w.r.t. the student is `(q - p)·mask` per row.
    """
    vocab = student_logits.shape[-1]
    stats = vocab_reduce(
        student_logits.reshape(-1, vocab),
        teacher=teacher_logits.reshape(-1, vocab),
        chunk_size=token_chunk_size,
    )
    ce = stats.lse - stats.cross
    m = mask.reshape(-1).to(ce.dtype)
    return torch.where(m > 0, ce * m, 0.0).sum()


@dataclasses.dataclass(frozen=True)
class DraftCrossEntropyLossFn:
    """EAGLE draft soft cross-entropy against the (shifted) policy distribution (ref §4.6).

    `__call__` returns ONLY the scalar loss `Σ mask·CE / (G_t + 1e-8)`, where
    `mask = token_mask * sample_mask[:, None]` and `token_mask` is already aligned.
    """

    vocab_parallel_group: Any = None
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DRAFT

    def __post_init__(self) -> None:
        if self.token_chunk_size < 1:
            raise ValueError(f"token_chunk_size must be >= 1, got {self.token_chunk_size}")

    def loss_stats(
        self,
        teacher_logits: Tensor,
        student_logits: Tensor,
        token_mask: Tensor,
        data: Mapping[str, Tensor],
    ) -> DraftLossStats:
        who = "DraftCrossEntropyLossFn"
        if teacher_logits.shape != student_logits.shape:
            raise ValueError(
                f"{who}: teacher_logits and student_logits must have the same shape, got "
                f"{tuple(teacher_logits.shape)} and {tuple(student_logits.shape)}"
            )
        _require_shape(token_mask, tuple(student_logits.shape[:-1]), "token_mask", who)
        require_keys(data, ("sample_mask",), who)
        mask = token_mask * data["sample_mask"].reshape((-1,) + (1,) * (token_mask.dim() - 1))
        numerator = soft_cross_entropy_sum(
            student_logits, teacher_logits, mask, self.token_chunk_size
        )
        one = numerator.new_ones(1)
        return DraftLossStats(numerator.reshape(1), mask.sum().to(one.dtype).reshape(1), one)

    def __call__(
        self,
        teacher_logits: Tensor,
        student_logits: Tensor,
        token_mask: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> Tensor:
        if global_valid_toks is None:
            raise ValueError("DraftCrossEntropyLossFn: global_valid_toks must not be None")
        stats = self.loss_stats(teacher_logits, student_logits, token_mask, data)
        return stats.normalized(torch.as_tensor(global_valid_toks).reshape(1))


# ---------------------------------------------------------------------------------------
# PPO critic (ref §4.7)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MseValueLossConfig:
    scale: float = 1.0
    cliprange: float | None = None


@dataclasses.dataclass(frozen=True)
class MseValueLossFn:
    """Clipped / plain MSE value loss over per-position values (ref §4.7)."""

    cfg: MseValueLossConfig = MseValueLossConfig()

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, MseValueLossConfig, "MseValueLossFn"))

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        out = {
            k: MetricNormalizer.TOKENS
            for k in ("loss", "returns_mean", "values_mean", "returns_sq_mean",
                      "residual_sq_mean", "vf_clipfrac")
        }
        for key in ("values_min", "values_max", "num_valid_samples"):
            out[key] = MetricNormalizer.NONE
        return out

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "MseValueLossFn"
        cfg = self.cfg
        clipped = cfg.cliprange is not None and cfg.cliprange > 0
        require_keys(data, ("token_mask", "sample_mask", "returns") + (("values",) if clipped else ()), who)
        values = logits.squeeze(-1) if logits.shape[-1] == 1 else logits
        tm = data["token_mask"]
        _require_shape(values, tuple(tm.shape), "values (logits squeezed, [B, S])", who)
        values = values.float()
        returns = data["returns"].to(values.dtype)
        mask = tm.to(values.dtype) * data["sample_mask"].to(values.dtype)[:, None]
        g = global_valid_toks
        unclipped = (values - returns).square()
        if clipped:
            old = data["values"].to(values.dtype)
            v_clipped = torch.minimum(torch.maximum(values, old - cfg.cliprange), old + cfg.cliprange)
            clipped_sq = (v_clipped - returns).square()
            per_token = torch.maximum(unclipped, clipped_sq)
            clipfrac = masked_mean((clipped_sq > unclipped).to(values.dtype), mask, global_normalization_factor=g)
        else:
            per_token = unclipped
            clipfrac = values.new_zeros(())
        loss = 0.5 * cfg.scale * masked_mean(per_token, mask, global_normalization_factor=g)
        v = values.detach()
        return loss, {
            "loss": loss.detach(),
            "returns_mean": masked_mean(returns, mask, global_normalization_factor=g),
            "values_mean": masked_mean(v, mask, global_normalization_factor=g),
            "returns_sq_mean": masked_mean(returns.square(), mask, global_normalization_factor=g),
            "residual_sq_mean": masked_mean((returns - v).square(), mask, global_normalization_factor=g),
            "values_min": _masked_min(v, mask),
            "values_max": _masked_max(v, mask),
            "vf_clipfrac": clipfrac.detach(),
            "num_valid_samples": data["sample_mask"].to(values.dtype).sum(),
        }
