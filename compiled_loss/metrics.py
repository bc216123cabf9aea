"""The one metric-aggregation registry, plus rescaling and host conversion.

Every metric is a 0-d tensor. How a key combines across fragments — the micro-batches of
a step and the data-parallel replicas (`compiled_loss.train.parallel.combine_over`) — is
decided here and nowhere else, for every key a loss, a draft loss or a drafter runtime
emits:

* "sum": fragments of a global mean (a `masked_mean` over `global_valid_*`, whose
  micro-batch values add up to the global mean, ref §1.3) and counts — what NeMo-RL sums
  (ref §1.4, §7.2);
* "min" / "max": extrema; an empty fragment emits `+inf` / `-inf`, which `min` / `max`
  skip. The seed's `_SEQ_METRIC_MIN` / `_SEQ_METRIC_MAX` (re-exported unchanged by
  `compiled_loss.wrapper`) plus the value loss's extrema;
* "mean": a value taken over one micro-batch, not a fragment (a teacher's weight, the
  dynamic loss scale): the mean over every fragment that holds the key.

`AGGREGATION` names fixed keys, `PATTERNS` indexed ones (`weight_t{i}`,
`draft_acc_num@{j}`, …). A key in neither is an error (`aggregation`), never summed by
default. The ratios `with_ratios` derives after combining (`X@k = X_num@k / X_den@k`) and
the step-wide values the step adds (`grad_norm`, `global_valid_*`, `lr`) are not fragments
and are never combined.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch

from compiled_loss.interfaces import MetricNormalizer

Tensor = torch.Tensor

Aggregation = Literal["sum", "mean", "min", "max"]

# The seed's extrema sets (`nemo_rl.algorithms.loss.wrapper`), exactly.
_SEQ_METRIC_MIN: frozenset[str] = frozenset({"probs_ratio_min", "probs_ratio_clamped_min", "opd_full_reverse_kl_min"})
_SEQ_METRIC_MAX: frozenset[str] = frozenset(
    {"probs_ratio_max", "probs_ratio_clamped_max", "opd_full_reverse_kl_max", "opd_full_decomposition_error"}
)

# Fragments and counts, summed as NeMo-RL sums them (VAPO's `positive_nll_loss` is a
# micro-batch-local mean that the reference sums as well).
_SUMMED = (
    "loss",
    "num_valid_samples",
    "num_unmasked_tokens",
    # ClippedPGLossFn and its OPD_FULL branch
    "probs_ratio",
    "probs_ratio_clamped",
    "kl_penalty",
    "sampling_importance_ratio",
    "approx_entropy",
    "positive_nll_loss",
    "is_oob_ratio",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "num_masked_seqs_by_logprob_error",
    "seq_logprob_error_valid_tokens",
    "seq_logprob_error_valid_seqs",
    "opd_full_reverse_kl",
    "opd_full_entropy",
    "opd_full_cross_entropy",
    # PreferenceLossFn, DPOLossFn, MPOLossFn
    "accuracy",
    "rewards_chosen_mean",
    "rewards_rejected_mean",
    "sft_loss",
    "preference_loss",
    "bco_loss",
    "bco_rewards_chosen_mean",
    "bco_rewards_rejected_mean",
    "bco_reward_sum",
    "bco_reward_count",
    # MseValueLossFn
    "returns_mean",
    "values_mean",
    "returns_sq_mean",
    "residual_sq_mean",
    "vf_clipfrac",
    # CrossTokenizerDistillationLossFn
    "kl_loss",
    "ce_loss",
    # draft losses and drafter runtimes (a runtime's loss terms are each micro-batch's share)
    "draft_loss",
    "total_loss",
    "draft_ce_loss",
    "draft_tv_loss",
    "draft_conf_loss",
    "draft_tau_num",
    "draft_tau_den",
    "_draft_step_payload",
)

AGGREGATION: Mapping[str, Aggregation] = MappingProxyType(
    {
        **dict.fromkeys(_SUMMED, "sum"),
        **dict.fromkeys(_SEQ_METRIC_MIN | {"values_min"}, "min"),
        **dict.fromkeys(_SEQ_METRIC_MAX | {"values_max"}, "max"),
        # CrossTokenizerDistillationLossFn: taken over the micro-batch (`selected_teacher`: the
        # mean index chosen; the mean `weight_t{i}` is the share of fragments that chose teacher i)
        **dict.fromkeys(("kl_loss_scale", "selected_teacher"), "mean"),
    }
)

# Indexed keys: (pattern the whole key matches, aggregation).
PATTERNS: tuple[tuple[re.Pattern[str], Aggregation], ...] = (
    (re.compile(r"(kl_loss|kl_common|l1_uncommon)_t\d+"), "sum"),  # a teacher's KD terms
    (re.compile(r"weight_t\d+"), "mean"),  # a teacher's weight in the micro-batch
    (re.compile(r"draft_\w+_(num|den)@\d+"), "sum"),  # a drafter's per-step / per-slot rate counts
)


def aggregation(key: str) -> Aggregation:
    """How `key` combines across fragments: 'sum', 'mean', 'min' or 'max'. ValueError for
    a key the registry does not name, so that no metric is summed by default."""
    how = AGGREGATION.get(key) or next((how for pattern, how in PATTERNS if pattern.fullmatch(key)), None)
    if how is None:
        raise ValueError(
            f"metric {key!r} has no aggregation: register it in compiled_loss.metrics (AGGREGATION, or PATTERNS "
            "for an indexed key) as 'sum', 'mean', 'min' or 'max'"
        )
    return how


def combine_metrics(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine per-fragment metric dicts (micro-batches, replicas) into one, each key by its
    `aggregation`; ValueError for an unregistered key.

    Traceable: sentinels need no special case because `min(+inf, x) == x` and
    `max(-inf, x) == x`. A key missing from some fragments combines over the rest (a mean
    too: it divides by the number of fragments that hold the key).
    """
    out: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            how = aggregation(key)
            if key not in out:
                out[key], counts[key] = value, 1
                continue
            counts[key] += 1
            if how == "min":
                out[key] = torch.minimum(out[key], value)
            elif how == "max":
                out[key] = torch.maximum(out[key], value)
            else:
                out[key] = out[key] + value
    return {key: value / counts[key] if aggregation(key) == "mean" else value for key, value in out.items()}


def rescale_loss_metrics(
    metrics: dict[str, Any],
    normalizers: Mapping[str, MetricNormalizer],
    *,
    token_factor: float,
    sequence_factor: float,
) -> dict[str, Any]:
    """Change global loss denominators while preserving raw counts and extrema (ref §6.1).

    Metrics absent from `normalizers` are returned unchanged. Works on floats or tensors.
    """
    factors = {
        MetricNormalizer.TOKENS: token_factor,
        MetricNormalizer.SEQUENCES: sequence_factor,
        MetricNormalizer.NONE: 1.0,
    }
    return {key: value * factors[normalizers[key]] if key in normalizers else value for key, value in metrics.items()}


def with_ratios(metrics: Mapping[str, float]) -> dict[str, float]:
    """Host-side: `metrics` plus the ratio `X[@k] = X_num[@k] / X_den[@k]` of every num/den
    pair (the draft runtimes report their rates as pairs so that they sum across
    micro-batches and ranks); NaN where the denominator is 0."""
    out = dict(metrics)
    for key, num in metrics.items():
        base, at, index = key.partition("@")
        if not base.endswith("_num"):
            continue
        den = metrics.get(f"{base[:-4]}_den{at}{index}")
        if den is not None:
            out[f"{base[:-4]}{at}{index}"] = num / den if den else float("nan")
    return out


def metrics_to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Host-side: 0-d tensor metrics to Python floats, with one device sync in all.

    Call it outside compiled code. ±inf extrema sentinels are kept as they are.
    """
    for key, value in metrics.items():
        if not isinstance(value, (Tensor, int, float)):
            raise ValueError(
                f"metrics[{key!r}] is a {type(value).__name__}, not a number: take it out of the metrics before "
                "converting them (a DraftStepState payload goes to its correct_grads)"
            )
    tensor_keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    for key in tensor_keys:
        if metrics[key].dim() != 0:
            raise ValueError(f"metrics[{key!r}] must be a 0-d tensor, got shape {tuple(metrics[key].shape)}")
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if tensor_keys:
        device = metrics[tensor_keys[0]].device
        stacked = torch.stack([metrics[k].detach().float().to(device) for k in tensor_keys])
        out.update(zip(tensor_keys, stacked.tolist()))  # host
    return {k: out[k] for k in metrics}
