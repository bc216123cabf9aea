"""LOGPROB inputs (ref §5.1, §8.10): next-token log-probs of the batch's own tokens, filtered
by the generation-time top-k / top-p when it is active, with the unfiltered copy beside
them for a loss that declares a reference KL (`InputSpec.unfiltered_logprobs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict

import torch
from torch.distributed import ProcessGroup

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.parallel import group_size
from compiled_loss.vocab import (
    LinearLogits,
    TrainingSamplingParams,
    VocabStats,
    linear_vocab_gradient,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
    token_logprobs,
)

Tensor = torch.Tensor


def next_token_logprobs(
    view: TokenView,
    logits: Logits,
    input_ids: Tensor,
    *,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
) -> Tensor:
    """`[B, S-1]` fp32: entry t = log p(input_ids[t+1] | prefix ≤ t), the vocabulary sharded
    over `group`, top-k / top-p filtered by `sampling_params` (ref §3.3)."""
    top_k_top_p = None
    if sampling_params is not None and need_top_k_or_top_p_filtering(sampling_params):
        top_k_top_p = sampling_params.top_k, sampling_params.top_p
    rows = view.rows(logits)
    lp = token_logprobs(rows, view.next_tokens(input_ids), top_k_top_p=top_k_top_p, chunk_size=chunk_size, group=group)
    return view.full(lp)[:, :-1]


class LogprobInput(TypedDict):
    """LOGPROB inputs, `[B, S-1]`."""

    next_token_logprobs: Tensor
    curr_logprobs_unfiltered: NotRequired[Tensor]  # under top-k / top-p, with a reference KL


def logprob_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[LogprobInput, Tensor | None]:
    """`next_token_logprobs` `[B, S-1]`: computed from the logits, or — a loss with fused-linear
    log-probs — the logits argument itself (already next-token log-probs `[B, S']`), cast to
    fp32 and cut to `S-1`. Under top-k / top-p, filtered and masked-out entries are zeroed and
    a loss with a reference KL also gets `curr_logprobs_unfiltered` (ref §5.1)."""
    require_keys(data, ("input_ids", "token_mask", "sample_mask"), view.who)
    if spec.fused_linear_logprobs:
        assert isinstance(logits, Tensor)  # `prepare_inputs` refuses LinearLogits with fused-linear log-probs
        return LogprobInput(
            next_token_logprobs=view.unpacked(logits[..., None].float())[..., 0][:, : view.width - 1]
        ), None
    sampling, tp = options.sampling_params, options.parallel.tp
    if (
        isinstance(logits, LinearLogits)
        and logits.objective is not None
        and not need_top_k_or_top_p_filtering(sampling)
        and group_size(options.parallel.cp) == 1
    ):
        return _logprobs_with_gradient(view, logits, data, options)
    lp = next_token_logprobs(
        view, logits, data["input_ids"], sampling_params=sampling, chunk_size=options.chunk_size, group=tp
    )
    if not need_top_k_or_top_p_filtering(sampling):
        return LogprobInput(next_token_logprobs=lp), None
    mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:]
    out = LogprobInput(next_token_logprobs=mask_out_neg_inf_logprobs(lp, mask, "curr_logprobs"))
    if spec.unfiltered_logprobs:
        out["curr_logprobs_unfiltered"] = next_token_logprobs(view, logits, data["input_ids"], group=tp)
    return out, None


def _logprobs_with_gradient(
    view: TokenView, logits: LinearLogits, data: Mapping[str, Tensor], options: PrepareOptions
) -> tuple[LogprobInput, Tensor]:
    """`next_token_logprobs` of a token-separable loss (`InputSpec.token_separable`) from
    `LinearLogits`, the loss's gradient computed in the forward: detached log-probs and the
    zero that carries the gradient (added to the loss)."""
    loss_of = logits.objective
    assert loss_of is not None  # `logprob_input` takes this path only with one

    def objective(stats: VocabStats) -> Tensor:
        return loss_of(LogprobInput(next_token_logprobs=view.full(stats.picked[:, 0] - stats.lse)[:, :-1]), data)

    targets = view.next_tokens(data["input_ids"])[:, None]
    rows = view.rows(logits)
    assert isinstance(rows, LinearLogits)
    stats, carrier = linear_vocab_gradient(
        rows, targets, objective, chunk_size=options.chunk_size, group=options.parallel.tp
    )
    return LogprobInput(next_token_logprobs=view.full(stats.picked[:, 0] - stats.lse)[:, :-1]), carrier
