"""Token-level negative log-likelihood (ref §4.2)."""

from __future__ import annotations

import dataclasses
from typing import TypedDict

import torch

from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import check_logprob_inputs, float_masks, masked_mean, normalizations, zero_outside

Tensor = torch.Tensor


class NLLLossData(TypedDict):
    """The data `NLLLossFn` reads: `[B, S]` masks and `[B]` sample mask."""

    token_mask: Tensor
    sample_mask: Tensor


@dataclasses.dataclass(frozen=True)
class NLLLossFn:
    """`-masked_mean(lp, mask, G_t)`; per-row sums for DPO's SFT term (`dpo_loss=True`)."""

    use_fused_linear_logprobs: bool = False

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    @property
    def input_spec(self) -> InputSpec:
        return InputSpec(
            self.input_type,
            fused_linear_logprobs=self.use_fused_linear_logprobs,
            token_separable=True,
            data=NLLLossData,
        )

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return normalizations(TOKENS=("loss",), NONE=("num_unmasked_tokens", "num_valid_samples"))

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: NLLLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
        dpo_loss: bool = False,
        dpo_average_log_probs: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        check_logprob_inputs(next_token_logprobs, data, (), "NLLLossFn")
        tm, sm = float_masks(data, next_token_logprobs.dtype)
        mask = tm * sm[:, None]
        (lp,) = zero_outside(mask, next_token_logprobs)
        if dpo_loss:  # per-sample summed (or averaged) NLL, shape [B]
            loss = -(lp * mask).sum(-1)
            if dpo_average_log_probs:
                loss = loss / mask.sum(-1).clamp(min=1)
        else:
            loss = -masked_mean(lp, mask, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": loss.detach(),
            "num_unmasked_tokens": mask.sum(),
            "num_valid_samples": sm.sum(),
        }
