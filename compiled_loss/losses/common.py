"""What every loss family shares: the reference's numeric helpers (`masked_mean`,
`calculate_kl`, ref §1.3, §3.1), mask and shape helpers, and the config checks.

Config errors are `compiled_loss.checks.ConfigError`. Single-field checks run when a config
object is constructed (`check_fields` plus each config's ranges); cross-field checks run
when the loss is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

import torch

from compiled_loss.checks import ConfigError
from compiled_loss.interfaces import MetricNormalizer

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Tensor = torch.Tensor

_C = TypeVar("_C", bound="DataclassInstance")

KL_PENALTY_KEY = "kl_penalty"


# ---- configs ------------------------------------------------------------------------


def as_config(cfg: Any, cls: type[_C], who: str) -> _C:
    """A config dataclass from itself or from a plain mapping (unknown keys rejected)."""
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(f"{who}: unknown config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**cfg)
    raise TypeError(f"{who}: cfg must be a {cls.__name__} or a mapping, got {type(cfg).__name__}")


# ---- data ---------------------------------------------------------------------------


def require_keys(data: Mapping[str, Any], keys: tuple[str, ...], who: str) -> None:
    """ValueError naming the first key of `keys` missing from `data`."""
    for key in keys:
        if key not in data:
            raise ValueError(f"{who}: data is missing key {key!r} (present: {sorted(data)})")


def require_shape(tensor: Tensor, shape: tuple[int, ...], what: str, who: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{who}: {what} must have shape {shape}, got {tuple(tensor.shape)}")


class MaskData(TypedDict):
    """The masks a loss's data holds: `token_mask [B, S]`, `sample_mask [B]` (every loss's data
    TypedDict with these keys is one)."""

    token_mask: Tensor
    sample_mask: Tensor


def check_logprob_inputs(lp: Tensor, data: MaskData, keys: tuple[str, ...], who: str) -> None:
    """`[B, S-1]` log-probs, `[B, S]` token mask and `keys`, `[B]` sample mask."""
    require_keys(data, ("token_mask", "sample_mask") + keys, who)
    rows, width = data["token_mask"].shape
    require_shape(lp, (rows, max(width - 1, 0)), "next_token_logprobs ([B, S-1])", who)
    require_shape(data["sample_mask"], (rows,), "data['sample_mask'] ([B])", who)
    for key in keys:
        require_shape(cast(Mapping[str, Tensor], data)[key], (rows, width), f"data[{key!r}] ([B, S])", who)


def float_masks(data: MaskData, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`token_mask[:, 1:]` and `sample_mask`, as `dtype`."""
    return data["token_mask"][:, 1:].to(dtype), data["sample_mask"].to(dtype)


# ---- numerics -----------------------------------------------------------------------


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
    den: Tensor | float
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


def reduce_like_loss(
    per_token: Tensor, tm: Tensor, sm: Tensor, token_level: bool, g_toks: Tensor | None, g_seqs: Tensor | None
) -> Tensor:
    """A per-token `[B, S-1]` term reduced as a loss is: the token mean over `tm * sm` (G_t),
    or the mean over `sm` of per-sequence token means over `tm` (G_s), ref §13.16."""
    if token_level:
        return masked_mean(per_token, tm * sm[:, None], global_normalization_factor=g_toks)
    return masked_mean(masked_mean(per_token, tm, dim=-1), sm, global_normalization_factor=g_seqs)


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Min over `mask > 0`; `+inf` (the skipped sentinel) when the mask is empty."""
    return torch.where(mask > 0, values, float("inf")).amin() if values.numel() else values.new_tensor(float("inf"))


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max over `mask > 0`; `-inf` (the skipped sentinel) when the mask is empty."""
    return torch.where(mask > 0, values, float("-inf")).amax() if values.numel() else values.new_tensor(float("-inf"))


def zero_outside(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor with every entry outside `mask > 0` set to 0 (`mask` broadcast over
    trailing dims), before any math: a NaN or ±inf there then reaches no value and no
    gradient (a masked mean alone multiplies it by 0, which is NaN, and so is its gradient
    through an infinite derivative)."""
    out = []
    for t in tensors:
        keep = (mask > 0).reshape(mask.shape + (1,) * (t.dim() - mask.dim()))
        out.append(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)))
    return tuple(out)


def nan_to_zero(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def normalizations(**by_normalizer: tuple[str, ...]) -> dict[str, MetricNormalizer]:
    """`{key: MetricNormalizer[NAME]}` from `NAME=(keys...)` groups."""
    return {key: MetricNormalizer[name] for name, keys in by_normalizer.items() for key in keys}
