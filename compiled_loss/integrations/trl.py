"""TRL's `GRPOTrainer` with its loss computed by compiled_loss: swap the import,

    from compiled_loss.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer

and the trainer computes each micro-batch's loss with `FusedLinearGRPOLoss` (its attribute
`liger_loss`, Liger's name for it in TRL's trainers) from the policy's last hidden states
and `lm_head`, compiled, without the `[B, T, V]` logits, with TRL's normalisers and
gradient-accumulation scaling, and
`kl` and `clip_ratio/region_mean` logged as TRL logs them (token-weighted means over the
processes). The loss sees the model's own logits: its
final-logit transform (`compiled_loss.integrations.hf.head_transform`: Granite's
`logits_scaling`, Cohere's `logit_scale`, Gemma's `final_logit_softcapping`) is applied on
the fused path, the scale folded into the hidden states and the head's bias, the softcap
inside each chunk (`FusedLinearGRPOLoss(softcap=)`); a model whose transform that cannot
describe is refused when the trainer is built, naming its `model_type`. A configuration it cannot honour (a loss type
other than grpo/bnpo/dr_grpo/dapo, sequence-level importance sampling, an entropy
mask or bonus, an off-policy mask, vLLM importance sampling, a MoE auxiliary loss, two-sided
clipping) is refused when the trainer is built, naming the
`GRPOConfig` field.

Needs `trl` (the `[hf]` extra: `pip install 'compiled_loss[hf]'`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compiled_loss.integrations.hf import head_transform
from compiled_loss.integrations.liger import DEFAULT_BUCKET, FusedLinearGRPOLoss

try:
    import trl
    from trl.models.utils import _ForwardRedirection
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "compiled_loss.integrations.trl needs trl and transformers: pip install 'compiled_loss[hf]'"
    ) from error

Tensor = torch.Tensor

MAX_BUCKETS = 256
"""The most shape buckets the trainer's loss may compile (`bucket_bound`); a configuration
needing more is refused when the trainer is built."""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""The `GRPOConfig.loss_type` values the trainer computes (with TRL's `kl` and `clip_ratio/region_mean` metrics)."""


def _refuse_unsupported(trainer: trl.GRPOTrainer) -> None:
    """A ValueError naming the first `GRPOConfig` field the fused loss cannot honour."""
    args = trainer.args
    refused = [
        ("loss_type", trainer.loss_type not in LOSS_TYPES, f"one of {LOSS_TYPES}"),
        ("importance_sampling_level", trainer.importance_sampling_level != "token", "'token'"),
        ("top_entropy_quantile", trainer.top_entropy_quantile < 1.0, "1.0"),
        ("entropy_coef", trainer._entropy_bonus_enabled, "0 (no entropy bonus)"),
        ("off_policy_mask_threshold", trainer.off_policy_mask_threshold is not None, "None"),
        ("vllm_importance_sampling_correction", trainer.use_vllm and args.vllm_importance_sampling_correction, "False"),
        ("router_aux_loss_coef", trainer.aux_loss_enabled, "0 (no MoE auxiliary loss)"),
        ("delta", args.delta is not None, "None"),
    ]
    for field, bad, expected in refused:
        if bad:
            raise ValueError(
                f"compiled_loss GRPOTrainer: GRPOConfig.{field}={getattr(args, field, None)!r} is not supported "
                f"(expected {expected})"
            )


def bucket_bound(args: trl.GRPOConfig) -> int:
    """The most shape buckets the trainer's `FusedLinearGRPOLoss` can compile: the completion
    widths of `DEFAULT_BUCKET` up to `max_completion_length` (`BucketGrid.bound`), once for
    the training micro-batch and, when the trainer evaluates, twice more (the evaluation
    batch, with no gradient, and a smaller last one)."""
    widths = DEFAULT_BUCKET.bound(1, args.max_completion_length, packed=False)
    return widths * (1 if args.eval_strategy == "no" else 3)


def token_weighted_mean(value: Tensor, tokens: Tensor, reduce: Callable[[Tensor], Tensor]) -> float:
    """A per-token metric across processes as TRL logs it: `Σ value·tokens / Σ tokens` over
    them (`value` this process's mean over its `tokens` tokens; `reduce` sums a tensor over
    the processes). Host: a Python float, read after the loss's graph."""
    totals = reduce(torch.stack([value.detach().float() * tokens, tokens.float()]))
    return (totals[0] / totals[1].clamp(min=1.0)).item()  # host


class GRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer` whose loss is `FusedLinearGRPOLoss` (see the module docstring).

    Beyond TRL's arguments, `compiled` (default True: Inductor) is the loss's
    `torch.compile` backend, or False to run it eagerly. The loss compiles at most
    `bucket_bound(args)` shape buckets, so a run never stops at Dynamo's recompile limit;
    a `max_completion_length` needing more than `MAX_BUCKETS` is refused when the trainer
    is built."""

    def __init__(self, *args: Any, compiled: bool | str | Callable[..., Any] = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        buckets = bucket_bound(self.args)
        if buckets > MAX_BUCKETS:
            raise ValueError(
                f"compiled_loss GRPOTrainer: GRPOConfig.max_completion_length={self.args.max_completion_length} "
                f"gives {buckets} shape buckets of the fused loss, more than MAX_BUCKETS={MAX_BUCKETS} compiles"
            )
        try:
            self.head_transform = head_transform(self.accelerator.unwrap_model(self.model).config)
        except ValueError as error:
            raise ValueError(f"compiled_loss GRPOTrainer: {error}") from None
        self.liger_loss = FusedLinearGRPOLoss(
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            temperature=self.temperature,
            use_ref_model=self.beta != 0.0,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            softcap=self.head_transform.softcap,
            compiled=compiled,
            max_buckets=buckets,
        )
        self._forward_redirection = _ForwardRedirection()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer does not support returning outputs")
        unwrapped = self.accelerator.unwrap_model(model)
        return self._forward_redirection(model, unwrapped, self._fused_loss, unwrapped, inputs)

    def _fused_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        width = completion_ids.shape[1]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        head = model.get_output_embeddings()
        bias, scale = head.bias, self.head_transform.scale
        with self.accelerator.autocast():  # the mixed precision TRL's own forward runs in (GRPOConfig.bf16)
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            hidden = hidden[:, -width - 1 : -1]  # position t predicts completion token t
            if scale != 1.0:  # the model's logit scale: scale · (h·Wᵀ + b) = (scale · h)·Wᵀ + scale · b
                hidden = hidden * scale
                bias = None if bias is None else bias * scale
            loss, metrics = self.liger_loss(
                hidden,
                head.weight,
                completion_ids,
                mask,
                inputs["advantages"],
                bias=bias,
                ref_per_token_logps=inputs.get("ref_per_token_logps"),
                old_per_token_logps=inputs.get("old_per_token_logps"),
                num_items_in_batch=inputs.get("num_items_in_batch"),
            )
        mode = "train" if self.model.training else "eval"
        # TRL's trainer logs each micro-batch's metrics as Python floats, token-weighted across processes
        tokens = mask.sum()

        def reduce(stats: Tensor) -> Tensor:
            return self.accelerator.reduce(stats, reduction="sum")

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(token_weighted_mean(metrics[0], tokens, reduce))
        self._metrics[mode]["clip_ratio/region_mean"].append(token_weighted_mean(metrics[-1], tokens, reduce))
        if mode == "eval":
            return loss
        if self.loss_type == "dapo":  # num_items_in_batch spans the generation batch (TRL's rescaling)
            return loss / (self.current_gradient_accumulation_steps / self.args.steps_per_generation)
        return loss / self.current_gradient_accumulation_steps
