"""PPO critic: clipped / plain MSE value loss (ref §4.7)."""

from __future__ import annotations

import dataclasses
from typing import NotRequired, TypedDict

import torch

from compiled_loss.checks import check_factor, check_fields, require
from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import (
    as_config,
    masked_max,
    masked_mean,
    masked_min,
    normalizations,
    require_keys,
    require_shape,
    zero_outside,
)

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class MseValueLossConfig:
    """Configuration of `MseValueLossFn` (ref §4.7; defaults are the reference's)."""

    scale: float = 1.0
    """Multiplies the loss (0.5 · scale · mean squared error); 0 or in [1e-6, 1e6] (`FACTOR_MAX`)."""
    cliprange: float | None = None
    """Clip the new values to old ± cliprange (PPO value clipping); None or 0 disables."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.scale >= 0, f"scale must be >= 0, got {self.scale}")
        check_factor("scale", self.scale)
        c = self.cliprange
        require(c is None or c >= 0, f"cliprange must be >= 0 (or None), got {c}")


class MseValueLossData(TypedDict):
    """The data `MseValueLossFn` reads: `[B, S]` unless noted."""

    token_mask: Tensor
    sample_mask: Tensor  # [B]
    returns: Tensor
    values: NotRequired[Tensor]  # the rollout's values, with cliprange


@dataclasses.dataclass(frozen=True)
class MseValueLossFn:
    """Clipped / plain MSE value loss over per-position values (ref §4.7)."""

    cfg: MseValueLossConfig = MseValueLossConfig()

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGIT
    # per-position values: every tensor-parallel rank holds them whole
    input_spec = InputSpec(LossInputType.LOGIT, data=MseValueLossData)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, MseValueLossConfig, "MseValueLossFn"))

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return normalizations(
            TOKENS=("loss", "returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean", "vf_clipfrac"),
            NONE=("values_min", "values_max", "num_valid_samples"),
        )

    def __call__(
        self,
        logits: Tensor,
        data: MseValueLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "MseValueLossFn"
        cfg = self.cfg
        clip = cfg.cliprange if cfg.cliprange is not None and cfg.cliprange > 0 else None
        require_keys(data, ("token_mask", "sample_mask", "returns") + (("values",) if clip is not None else ()), who)
        values = logits.squeeze(-1) if logits.shape[-1] == 1 else logits
        tm = data["token_mask"]
        require_shape(values, tuple(tm.shape), "values (logits squeezed, [B, S])", who)
        mask = tm.to(torch.float32) * data["sample_mask"].to(torch.float32)[:, None]
        values, returns = zero_outside(mask, values.float(), data["returns"].float())
        g = global_valid_toks
        unclipped = (values - returns).square()
        if clip is not None:
            (old,) = zero_outside(mask, data["values"].float())
            v_clipped = torch.minimum(torch.maximum(values, old - clip), old + clip)
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
            "values_min": masked_min(v, mask),
            "values_max": masked_max(v, mask),
            "vf_clipfrac": clipfrac.detach(),
            "num_valid_samples": data["sample_mask"].to(values.dtype).sum(),
        }
