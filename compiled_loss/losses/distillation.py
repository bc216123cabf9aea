"""Top-k logit distillation (ref §4.5)."""

from __future__ import annotations

import dataclasses
from typing import Literal, NotRequired, TypedDict

import torch

from compiled_loss.checks import check_fields, require
from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import as_config, masked_mean, normalizations, zero_outside

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillationLossConfig:
    """Configuration of `DistillationLossFn` (ref §4.5; defaults are the reference's)."""

    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    """KL(teacher‖student) 'forward', KL(student‖teacher) 'reverse', or their mix."""
    mixed_kl_weight: float = 0.5
    """Weight of the forward KL in 'mixed', in [0, 1]."""
    zero_outside_topk: bool = False
    """Student full-vocab log-probs at the teacher's top-k, with the outside mass corrected."""

    def __post_init__(self) -> None:
        check_fields(self)
        w = self.mixed_kl_weight
        require(0.0 <= w <= 1.0, f"mixed_kl_weight must be in [0, 1], got {w}")


class DistillationLossData(TypedDict):
    """The data `DistillationLossFn` reads: the teacher's top-k `[B, S, k]`; the masks (needed
    under packing, where without them the loss would be a plain mean over the micro-batch)."""

    teacher_topk_logits: Tensor
    teacher_topk_indices: Tensor
    token_mask: NotRequired[Tensor]  # [B, S]
    sample_mask: NotRequired[Tensor]  # [B]


@dataclasses.dataclass(frozen=True)
class DistillationLossFn:
    """KL between student and teacher top-k distributions (ref §4.5)."""

    cfg: DistillationLossConfig

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION
    log_infinitesimal = -100.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, DistillationLossConfig, "DistillationLossFn"))

    @property
    def input_spec(self) -> InputSpec:
        zero_outside = self.cfg.zero_outside_topk
        return InputSpec(
            self.input_type,
            zero_outside_topk=zero_outside,
            topk_entropy=zero_outside and self.cfg.kl_type != "forward",
            data=DistillationLossData,
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
        return normalizations(TOKENS=("loss",), NONE=("num_valid_samples",))

    def __call__(
        self,
        student_topk_logprobs: Tensor,
        teacher_topk_logprobs: Tensor,
        H_all: Tensor | None,
        data: DistillationLossData,
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
        masked = "token_mask" in data and "sample_mask" in data
        if masked:
            mask = data["token_mask"][:, 1:][:, : s.shape[1]].to(s.dtype) * data["sample_mask"].to(s.dtype)[:, None]
            s, t = zero_outside(mask, s, t)
            H_all = None if H_all is None else zero_outside(mask, H_all)[0]
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
        if masked:
            loss = masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
            num_valid = data["sample_mask"].to(per_token.dtype).sum()
        else:
            loss = per_token.mean()
            num_valid = per_token.new_tensor(float(per_token.shape[0]))
        return loss, {"loss": loss.detach(), "num_valid_samples": num_valid}
