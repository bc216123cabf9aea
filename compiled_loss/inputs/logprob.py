"""LOGPROB inputs (ref §5.1, §8.10): next-token log-probs of the batch's own tokens, filtered
by the generation-time top-k / top-p when it is active, with the unfiltered copy beside
them for a loss that declares a reference KL (`InputSpec.unfiltered_logprobs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, RowsView, TokenView
from compiled_loss.parallel import group_size
from compiled_loss.vocab import (
    GRADIENT_CARRIER,
    LinearLogits,
    TrainingSamplingParams,
    VocabStats,
    linear_vocab_gradient,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
    token_logprobs,
)
from compiled_loss.vocab.shards import seed_groups

Tensor = torch.Tensor


def next_token_logprobs(
    view: TokenView,
    logits: Logits,
    input_ids: Tensor,
    *,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    group: Any = None,
) -> Tensor:
    """`[B, S-1]` fp32: entry t = log p(input_ids[t+1] | prefix ≤ t), the vocabulary sharded
    over `group`, top-k / top-p filtered by `sampling_params` (ref §3.3)."""
    top_k_top_p = None
    if need_top_k_or_top_p_filtering(sampling_params):
        top_k_top_p = sampling_params.top_k, sampling_params.top_p
    rows = view.rows(logits)
    lp = token_logprobs(rows, view.next_tokens(input_ids), top_k_top_p=top_k_top_p, chunk_size=chunk_size, group=group)
    return view.full(lp)[:, :-1]


def logprob_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> dict[str, Any]:
    """`next_token_logprobs` `[B, S-1]`: computed from the logits, or — a loss with fused-linear
    log-probs — the logits argument itself (already next-token log-probs `[B, S']`), cast to
    fp32 and cut to `S-1`. Under top-k / top-p, filtered and masked-out entries are zeroed and
    a loss with a reference KL also gets `curr_logprobs_unfiltered` (ref §5.1)."""
    require_keys(data, ("input_ids", "token_mask", "sample_mask"), view.who)
    if spec.fused_linear_logprobs:
        return {"next_token_logprobs": view.unpacked(logits[..., None].float())[..., 0][:, : view.width - 1]}
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
        return {"next_token_logprobs": lp}
    mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:]
    out = {"next_token_logprobs": mask_out_neg_inf_logprobs(lp, mask, "curr_logprobs")}
    if spec.unfiltered_logprobs:
        out["curr_logprobs_unfiltered"] = next_token_logprobs(view, logits, data["input_ids"], group=tp)
    return out


def _logprobs_with_gradient(
    view: TokenView, logits: LinearLogits, data: Mapping[str, Tensor], options: PrepareOptions
) -> dict[str, Any]:
    """`next_token_logprobs` of a token-separable loss (`InputSpec.token_separable`) from
    `LinearLogits`, the loss's gradient computed in the forward: detached log-probs and the
    zero that carries the gradient (`GRADIENT_CARRIER`)."""

    def objective(stats: VocabStats) -> Tensor:
        return logits.objective({"next_token_logprobs": view.full(stats.picked[:, 0] - stats.lse)[:, :-1]}, data)

    targets = view.next_tokens(data["input_ids"])[:, None]
    stats, carrier = linear_vocab_gradient(
        view.rows(logits), targets, objective, chunk_size=options.chunk_size, group=options.parallel.tp
    )
    return {"next_token_logprobs": view.full(stats.picked[:, 0] - stats.lse)[:, :-1], GRADIENT_CARRIER: carrier}


def get_next_token_logprobs_from_logits(
    input_ids: Tensor,
    next_token_logits: Logits,
    seq_index: Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """`[B, S-1]` fp32: entry t = log p(input_ids[t+1] | prefix ≤ t) (ref §8.10).

    `next_token_logits` is `[B, S, V]`, or `[B, S_pad / cp, V / tp]` under context / tensor
    parallelism (each row load-balanced over the CP ranks, the vocabulary sharded over the
    TP ranks), or `LinearLogits` with hidden states `[B, S(_pad / cp), H]`; the result is
    every position's, on every rank. `seq_index` is accepted for the seed's signature.
    """
    next_token_logits, groups = seed_groups(
        next_token_logits,
        vocab_parallel_rank,
        vocab_parallel_group,
        context_parallel_group,
        "get_next_token_logprobs_from_logits",
    )
    view = RowsView.of(next_token_logits, input_ids.shape[1], groups.cp)
    return next_token_logprobs(
        view, next_token_logits, input_ids, sampling_params=sampling_params, chunk_size=chunk_size, group=groups.tp
    )
