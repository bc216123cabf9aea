"""The one metric-aggregation registry, plus rescaling and host conversion.

Every metric is a 0-d tensor. How a key combines across sequences, micro-batches and
data-parallel ranks is decided here and nowhere else:

* keys `AGGREGATION` maps to "min" reduce with `min`; empty inputs emit `+inf` (skipped);
* keys it maps to "max" reduce with `max`; empty inputs emit `-inf` (skipped);
* every other key is a fragment or a count and is summed.

`AGGREGATION` holds the seed's `_SEQ_METRIC_MIN` / `_SEQ_METRIC_MAX` (re-exported unchanged
by `compiled_loss.wrapper`) plus the extrema of the losses those sets do not cover.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from compiled_loss.interfaces import MetricNormalizer

Tensor = torch.Tensor

# The seed's extrema sets (`nemo_rl.algorithms.loss.wrapper`), exactly.
_SEQ_METRIC_MIN: frozenset[str] = frozenset(
    {"probs_ratio_min", "probs_ratio_clamped_min", "opd_full_reverse_kl_min"}
)
_SEQ_METRIC_MAX: frozenset[str] = frozenset(
    {"probs_ratio_max", "probs_ratio_clamped_max", "opd_full_reverse_kl_max", "opd_full_decomposition_error"}
)

# Every key that does not sum: the seed's extrema plus those of losses the seed's sets do
# not cover (the value loss's `values_min` / `values_max`).
AGGREGATION: Mapping[str, str] = MappingProxyType(
    {
        **{key: "min" for key in _SEQ_METRIC_MIN | {"values_min"}},
        **{key: "max" for key in _SEQ_METRIC_MAX | {"values_max"}},
    }
)


def aggregation(key: str) -> str:
    """'min', 'max' or 'sum': how `key` combines across fragments."""
    return AGGREGATION.get(key, "sum")


def combine_metrics(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine per-fragment metric dicts (micro-batches, sequences) into one.

    Traceable: sentinels need no special case because `min(+inf, x) == x` and
    `max(-inf, x) == x`. A key missing from some fragments combines over the rest.
    """
    out: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
                continue
            how = aggregation(key)
            if how == "min":
                out[key] = torch.minimum(out[key], value)
            elif how == "max":
                out[key] = torch.maximum(out[key], value)
            else:
                out[key] = out[key] + value
    return out


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
    return {
        key: value * factors[normalizers[key]] if key in normalizers else value
        for key, value in metrics.items()
    }


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
            raise ValueError(
                f"metrics[{key!r}] must be a 0-d tensor, got shape {tuple(metrics[key].shape)}"
            )
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if tensor_keys:
        device = metrics[tensor_keys[0]].device
        stacked = torch.stack([metrics[k].detach().float().to(device) for k in tensor_keys])
        out.update(zip(tensor_keys, stacked.tolist()))  # host
    return {k: out[k] for k in metrics}
