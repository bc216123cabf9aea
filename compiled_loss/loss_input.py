"""Seed module `nemo_rl.algorithms.loss.loss_input` (ref §5): input preparation,
re-exported from `compiled_loss.inputs` and `compiled_loss.vocab`."""

from compiled_loss.inputs import (
    get_distillation_topk_logprobs_from_logits,
    get_next_token_logprobs_from_logits,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from compiled_loss.vocab import TrainingSamplingParams, mask_out_neg_inf_logprobs, need_top_k_or_top_p_filtering

__all__ = [
    "TrainingSamplingParams",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "mask_out_neg_inf_logprobs",
    "need_top_k_or_top_p_filtering",
    "prepare_loss_input",
    "prepare_packed_loss_input",
]
