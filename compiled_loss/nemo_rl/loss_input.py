"""Seed module `nemo_rl.algorithms.loss.loss_input` (ref §5): the seed's input preparation
with its signatures — `prepare_loss_input` (unpacked `[B, S, V]` logits, ref §5.1),
`prepare_packed_loss_input` (packed `[1, T, V]`, ref §5.3), `get_next_token_logprobs_from_logits`
and `get_distillation_topk_logprobs_from_logits` — shells that convert the seed arguments once
(`compiled_loss.nemo_rl.groups`), then run the library's preparation: the preparer table
(`compiled_loss.inputs.table`) or its log-prob and top-k pieces.

Device-agnostic and traceable. All vocab work goes through `compiled_loss.vocab`, so no
full fp32 copy of `[T, V]` logits is kept (eager mode works in row chunks of `chunk_size`).
Temperature is not applied here (as in NeMo-RL, where the forward divides the logits
before the loss); top-k / top-p filtering is.

Wherever logits are taken, `LinearLogits` (hidden states and the LM head) may stand in for
them: LOGPROB, DISTILLATION and DRAFT inputs are then computed chunk by chunk from the
hidden states, with no `[T, V]` logits (LOGIT losses read the logits themselves and refuse
it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from compiled_loss.inputs.logprob import next_token_logprobs
from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.inputs.table import LossInput, prepare_inputs
from compiled_loss.inputs.topk import topk_logprobs
from compiled_loss.interfaces import InputSpec, LossFunction, LossInputType
from compiled_loss.losses.common import require_keys
from compiled_loss.nemo_rl.groups import seed_groups
from compiled_loss.packing import CpuIntTuple, PackedLayout
from compiled_loss.packing.view import Logits, RowsView
from compiled_loss.parallel import group_size
from compiled_loss.vocab import (
    DraftVocab,
    TrainingSamplingParams,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
)

Tensor = torch.Tensor

__all__ = [
    "TrainingSamplingParams",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
    "mask_out_neg_inf_logprobs",
    "need_top_k_or_top_p_filtering",
    "prepare_loss_input",
    "prepare_packed_loss_input",
]


def prepare_loss_input(
    logits: Logits,
    data: Mapping[str, Tensor],
    loss_fn: LossFunction,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | DraftVocab | None = None,
    chunk_size: int | None = None,
    cp_sharder: Any = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> tuple[LossInput, dict[str, Tensor]]:
    """Build `loss_fn`'s inputs from unpacked `[B, S, V]` logits (ref §5.1).

    Returns `(loss_input, data)`; `data` is a new dict, and what the loss reads besides the
    logits comes back in `loss_input` (`curr_logprobs_unfiltered` under top-k/top-p when the
    loss has a reference KL). `d2t` (DRAFT inputs): pass a `DraftVocab` to skip the per-call
    check of a raw map. `logits` may be `LinearLogits` (hidden states `[B, S, H]` and the LM
    head) for every input type but LOGIT, OPD_FULL and DISTILLATION_CROSS_TOKENIZER.
    OPD_FULL: the teacher payload is `data["opd_full_teacher_payload"]` (rows routed by
    `data["opd_full_teacher_index"]` when present); hidden states are projected through
    `teacher_output_layer_weight_by_index`. Context parallelism is `context_parallel_group`
    (the load-balanced 2·cp layout); `cp_sharder` must be None.

    Refused before any vocabulary work: batch keys whose shape or dtype cannot be right
    (`check_batch_shapes`; a teacher payload or top-k teacher must hold one entry per
    position of `input_ids`, under context parallelism too) and, in an eager call, a token
    id outside the vocabulary (a ValueError naming the key, the id and `V`).
    """
    logits, parallel = seed_groups(
        logits, vocab_parallel_rank, vocab_parallel_group, context_parallel_group, "prepare_loss_input"
    )
    options = PrepareOptions(parallel, sampling_params, chunk_size, d2t, teacher_output_layer_weight_by_index)
    if cp_sharder is not None:
        raise ValueError(
            "cp_sharder: compiled_loss shards context-parallel positions in the load-balanced 2·cp layout of "
            "context_parallel_group; pass cp_sharder=None"
        )
    return prepare_inputs(logits, data, loss_fn, InputSpec.of(loss_fn), options), dict(data)


def prepare_packed_loss_input(
    logits: Logits,
    data: Mapping[str, Tensor],
    loss_fn: LossFunction,
    cu_seqlens_q: CpuIntTuple | None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    *,
    layout: PackedLayout | None = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> tuple[LossInput, dict[str, Tensor]]:
    """Build `loss_fn`'s inputs from packed `[1, T, V]` logits in one shot (ref §5.3).

    The vocab work runs once over the packed tokens; only its per-token results are
    unpacked to the `[B, S-1, ...]` layout the loss reads. Supports LOGPROB (incl.
    top-k/top-p and fused-linear log-probs), DISTILLATION and LOGIT losses, and
    DISTILLATION_CROSS_TOKENIZER ones (on the logits unpacked to `[B, S, V]`). `layout`
    (built on the host, see `PackedLayout.build`) is what compiled callers pass; without
    it one is built here from the boundaries (exact shapes, host work). Entries for
    positions past a sequence's last prediction (`t >= L_i - 1`) are left as computed;
    the packing wrappers zero them. `logits` may be `LinearLogits` (hidden states `[1, T, H]`
    and the LM head) for LOGPROB and DISTILLATION losses. OPD_FULL and the checks of the
    batch: as `prepare_loss_input`.

    Pre-packed batches (`"cu_seqlens"` in `data`: `input_ids` and the masks are already one
    packed `[1, T]` row whose masks exclude each sequence's last position) take LOGPROB
    losses; the log-probs are returned in that packed `[1, T-1]` layout.
    """
    logits, parallel = seed_groups(
        logits, vocab_parallel_rank, vocab_parallel_group, context_parallel_group, "prepare_packed_loss_input"
    )
    options = PrepareOptions(
        parallel, sampling_params, chunk_size, teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index
    )
    spec = InputSpec.of(loss_fn)
    if "cu_seqlens" in data:
        return _pre_packed_loss_input(logits, data, loss_fn, spec, options)
    if spec.input_type == LossInputType.DRAFT:
        raise ValueError(
            "prepare_packed_loss_input supports LOGIT, LOGPROB, DISTILLATION, OPD_FULL and "
            f"DISTILLATION_CROSS_TOKENIZER losses, got {spec.input_type}; draft losses go through DraftLossWrapper"
        )
    if layout is None:
        if cu_seqlens_q is None:
            raise ValueError("prepare_packed_loss_input needs cu_seqlens_q or a layout")
        layout = PackedLayout.build(cu_seqlens_q, cu_seqlens_q_padded, device=logits.device, parallel=parallel)
    return prepare_inputs(logits, data, loss_fn, spec, options, layout), dict(data)


def _pre_packed_loss_input(
    logits: Logits, data: Mapping[str, Tensor], loss_fn: LossFunction, spec: InputSpec, options: PrepareOptions
) -> tuple[LossInput, dict[str, Tensor]]:
    """A pre-packed `[1, T]` batch: its next-token log-probs as one row (the masks exclude
    the positions whose next token starts another sequence)."""
    who = "prepare_packed_loss_input (pre-packed data with 'cu_seqlens')"
    if spec.input_type != LossInputType.LOGPROB:
        raise ValueError(f"{who}: supports LOGPROB losses, got {spec.input_type}")
    if group_size(options.parallel.cp) > 1:
        raise ValueError(
            f"{who}: context parallelism needs unpacked data and cu_seqlens_q; pass context_parallel_group=None"
        )
    require_keys(data, ("input_ids", "token_mask", "sample_mask"), who)
    if data["input_ids"].dim() != 2 or data["input_ids"].shape[0] != 1:
        raise ValueError(f"{who}: input_ids must be one packed row [1, T], got {tuple(data['input_ids'].shape)}")
    return prepare_inputs(logits, data, loss_fn, spec, options), dict(data)


def get_next_token_logprobs_from_logits(
    input_ids: Tensor,
    next_token_logits: Logits,
    seq_index: Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
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
    view = RowsView.of(next_token_logits, input_ids.shape[1], groups)
    return next_token_logprobs(
        view, next_token_logits, input_ids, sampling_params=sampling_params, chunk_size=chunk_size, group=groups.tp
    )


def get_distillation_topk_logprobs_from_logits(
    student_logits: Logits,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    *,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Student / teacher top-k log-probs `[B, S-1, k]` and `H_all = Σ p log p` (ref §8.9);
    parallel layouts as in `get_next_token_logprobs_from_logits`, indices are global ids;
    `chunk_size`: rows per chunk of the vocab primitive."""
    student_logits, groups = seed_groups(
        student_logits,
        vocab_parallel_rank,
        vocab_parallel_group,
        context_parallel_group,
        "get_distillation_topk_logprobs_from_logits",
    )
    view = RowsView.of(student_logits, teacher_topk_indices.shape[1], groups)
    return topk_logprobs(
        view,
        student_logits,
        teacher_topk_logits,
        teacher_topk_indices,
        zero_outside_topk,
        calculate_entropy,
        group=groups.tp,
        chunk_size=chunk_size,
    )
