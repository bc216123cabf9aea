"""Input preparation: logits → what each loss consumes (ref §5, §8.9–8.10).

Device-agnostic and traceable. All vocab work goes through `compiled_loss.vocab`, so no
full fp32 copy of `[T, V]` logits is kept (eager mode works in row chunks of `chunk_size`).
Temperature is not applied here (as in NeMo-RL, where the forward divides the logits
before the loss); top-k / top-p filtering is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from compiled_loss.interfaces import LossInputType
from compiled_loss.losses.common import require_keys
from compiled_loss.packing import CpuIntTuple, PackedLayout, roll_within_segments, row_width
from compiled_loss.parallel import require_single_process
from compiled_loss.vocab import (
    DraftVocab,
    TrainingSamplingParams,
    check_chunk_size,
    map_teacher_logits_to_draft_vocab,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
    sampling_threshold,
    token_logprobs,
    vocab_reduce,
)

Tensor = torch.Tensor


def _check_groups(vocab_parallel_group, context_parallel_group) -> None:
    require_single_process(vocab_parallel_group, "vocab_parallel_group")
    require_single_process(context_parallel_group, "context_parallel_group")


def _flat_rows(logits: Tensor, width: int) -> Tensor:
    """`[B, W, V]` → `[B*width, V]` rows (a view, with no autograd copy, when `W == width`)."""
    if logits.shape[1] < width:
        raise ValueError(
            f"logits must cover the {width} positions of input_ids, got shape {tuple(logits.shape)}"
        )
    if logits.shape[1] > width:
        logits = logits[:, :width]
    return logits.reshape(-1, logits.shape[-1])


def _threshold(rows: Tensor, sampling_params: TrainingSamplingParams | None) -> Tensor | None:
    if not need_top_k_or_top_p_filtering(sampling_params):
        return None
    return sampling_threshold(rows, sampling_params.top_k, sampling_params.top_p)


def get_next_token_logprobs_from_logits(
    input_ids: Tensor,
    next_token_logits: Tensor,
    seq_index: Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """`[B, S-1]` fp32: entry t = log p(input_ids[t+1] | prefix ≤ t) (ref §8.10)."""
    _check_groups(vocab_parallel_group, context_parallel_group)
    rows, width = input_ids.shape
    flat = _flat_rows(next_token_logits, width)
    targets = torch.roll(input_ids, -1, 1).reshape(-1)  # last column wraps; dropped below
    lp = token_logprobs(flat, targets, threshold=_threshold(flat, sampling_params), chunk_size=chunk_size)
    return lp.reshape(rows, width)[:, :-1]


def _with_filter_handling(
    lp: Tensor,
    unfiltered: Any,
    data: Mapping[str, Tensor],
    loss_fn: Any,
    sampling_params: TrainingSamplingParams | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Top-k/top-p: zero filtered and masked-out log-probs; add the unfiltered copy for the
    reference KL when the loss has one (ref §5.1). `unfiltered()` computes that copy."""
    data = dict(data)
    if need_top_k_or_top_p_filtering(sampling_params):
        mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:]
        lp = mask_out_neg_inf_logprobs(lp, mask, "curr_logprobs")
        if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
            data["curr_logprobs_unfiltered"] = unfiltered()
    return lp, data


def get_distillation_topk_logprobs_from_logits(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Student / teacher top-k log-probs `[B, S-1, k]` and `H_all = Σ p log p` (ref §8.9)."""
    _check_groups(vocab_parallel_group, context_parallel_group)
    k = teacher_topk_indices.shape[-1]
    if k <= 0:
        raise ValueError(f"topk must be positive, got k={k}")
    rows, width = teacher_topk_indices.shape[:2]
    flat = _flat_rows(student_logits, width)
    index = teacher_topk_indices.to(device=flat.device, dtype=torch.long).reshape(-1, k)
    student, entropy = _student_topk(flat, index, zero_outside_topk, calculate_entropy)
    student = student.reshape(rows, width, k)
    teacher = torch.log_softmax(teacher_topk_logits.to(device=student.device, dtype=student.dtype), -1)
    h_all = None if entropy is None else entropy.reshape(rows, width)[:, :-1]
    return student[:, :-1], teacher[:, :-1], h_all


def _student_topk(
    rows: Tensor, index: Tensor, zero_outside_topk: bool, calculate_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`[N, k]` student values at teacher indices: full-vocab log-probs (zero_outside_topk)
    or log-probs renormalised over the k gathered logits; plus `Σ p log p` if asked."""
    if zero_outside_topk:
        stats = vocab_reduce(rows, index, entropy=calculate_entropy)
        return stats.picked - stats.lse[:, None], stats.negent if calculate_entropy else None
    gathered = rows.gather(-1, index)  # renormalised over the k columns, by the same primitive
    stats = vocab_reduce(gathered, torch.arange(index.shape[-1], device=index.device).expand_as(index))
    return stats.picked - stats.lse[:, None], None


def _draft_loss_input(
    logits: Tensor,
    data: Mapping[str, Tensor],
    d2t: Tensor | DraftVocab | None,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
) -> dict[str, Tensor]:
    """Teacher = policy logits shifted left by one (last slot zero), mapped to the draft
    vocabulary; token mask shifted the same way (ref §5.1 DRAFT)."""
    require_keys(data, ("token_mask", "student_logits"), "prepare_loss_input (DRAFT)")
    teacher = map_teacher_logits_to_draft_vocab(
        logits.detach(), d2t, vocab_parallel_rank, vocab_parallel_group
    )
    last = torch.zeros(teacher.shape[1], dtype=torch.bool, device=teacher.device)
    last[-1] = True
    return {
        "teacher_logits": roll_within_segments(teacher, last, 1),
        "student_logits": data["student_logits"],
        "token_mask": roll_within_segments(data["token_mask"], last.to(data["token_mask"].device), 1),
    }


def prepare_loss_input(
    logits: Tensor,
    data: Mapping[str, Tensor],
    loss_fn: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | DraftVocab | None = None,
    chunk_size: int | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Build `loss_fn`'s inputs from unpacked `[B, S, V]` logits (ref §5.1).

    Returns `(loss_input, data)`; `data` is a new dict (with `curr_logprobs_unfiltered`
    added under top-k/top-p when the loss has a reference KL). `d2t` (DRAFT inputs): pass
    a `DraftVocab` to skip the per-call check of a raw map.
    """
    _check_groups(vocab_parallel_group, context_parallel_group)
    check_chunk_size(chunk_size)
    input_type = loss_fn.input_type
    if input_type == LossInputType.LOGIT:
        return {"logits": logits}, dict(data)
    if input_type == LossInputType.LOGPROB:
        require_keys(data, ("input_ids", "token_mask", "sample_mask"), "prepare_loss_input")
        width = data["input_ids"].shape[1]
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            return {"next_token_logprobs": logits.float()[:, : width - 1]}, dict(data)

        def logprobs(params, chunk):
            return get_next_token_logprobs_from_logits(
                data["input_ids"], logits, data.get("seq_index"), vocab_parallel_rank,
                vocab_parallel_group, context_parallel_group, params, chunk,
            )

        lp, data = _with_filter_handling(
            logprobs(sampling_params, chunk_size), lambda: logprobs(None, None), data,
            loss_fn, sampling_params,
        )
        return {"next_token_logprobs": lp}, data
    if input_type == LossInputType.DISTILLATION:
        require_keys(data, ("teacher_topk_logits", "teacher_topk_indices"), "prepare_loss_input")
        zero_outside = loss_fn.zero_outside_topk
        student, teacher, h_all = get_distillation_topk_logprobs_from_logits(
            logits, data["teacher_topk_logits"], data["teacher_topk_indices"], zero_outside,
            zero_outside and loss_fn.kl_type != "forward", vocab_parallel_rank,
            vocab_parallel_group, context_parallel_group,
        )
        return {
            "student_topk_logprobs": student,
            "teacher_topk_logprobs": teacher,
            "H_all": h_all,
        }, dict(data)
    if input_type == LossInputType.DRAFT:
        return _draft_loss_input(logits, data, d2t, vocab_parallel_rank, vocab_parallel_group), dict(data)
    if input_type in (LossInputType.OPD_FULL, LossInputType.DISTILLATION_CROSS_TOKENIZER):
        raise NotImplementedError(
            f"prepare_loss_input: compiled_loss prepares no {input_type.name} inputs; supported input types: "
            "LOGIT, LOGPROB, DISTILLATION, DRAFT"
        )
    raise ValueError(f"Unknown loss function input type: {input_type!r}")


def prepare_packed_loss_input(
    logits: Tensor,
    data: Mapping[str, Tensor],
    loss_fn: Any,
    cu_seqlens_q: CpuIntTuple | None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    *,
    layout: PackedLayout | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Build `loss_fn`'s inputs from packed `[1, T, V]` logits in one shot (ref §5.3).

    The vocab work runs once over the packed tokens; only its per-token results are
    unpacked to the `[B, S-1, ...]` layout the loss reads. Supports LOGPROB (incl.
    top-k/top-p and fused-linear log-probs), DISTILLATION and LOGIT losses. `layout`
    (built on the host, see `PackedLayout.build`) is what compiled callers pass; without
    it one is built here from the boundaries (exact shapes, host work). Entries for
    positions past a sequence's last prediction (`t >= L_i - 1`) are left as computed;
    the packing wrappers zero them.
    """
    _check_groups(vocab_parallel_group, context_parallel_group)
    check_chunk_size(chunk_size)
    if layout is None:
        if cu_seqlens_q is None:
            raise ValueError("prepare_packed_loss_input needs cu_seqlens_q or a layout")
        layout = PackedLayout.build(cu_seqlens_q, cu_seqlens_q_padded, device=logits.device)
    packed = layout.slots(logits)
    width = row_width(data)
    input_type = loss_fn.input_type
    if input_type == LossInputType.LOGIT:
        return {"logits": layout.unpack(packed, width)}, dict(data)
    if input_type == LossInputType.LOGPROB:
        require_keys(data, ("input_ids", "token_mask", "sample_mask"), "prepare_packed_loss_input")
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            return {"next_token_logprobs": layout.unpack(packed.float(), width)[:, :-1]}, dict(data)
        targets = layout.roll(layout.pack(data["input_ids"]))

        def logprobs(params, chunk):
            lp = token_logprobs(packed, targets, threshold=_threshold(packed, params), chunk_size=chunk)
            return layout.unpack(lp, width)[:, :-1]

        lp, data = _with_filter_handling(
            logprobs(sampling_params, chunk_size), lambda: logprobs(None, None), data,
            loss_fn, sampling_params,
        )
        return {"next_token_logprobs": lp}, data
    if input_type == LossInputType.DISTILLATION:
        require_keys(data, ("teacher_topk_logits", "teacher_topk_indices"), "prepare_packed_loss_input")
        indices = data["teacher_topk_indices"]
        k = indices.shape[-1]
        if k <= 0:
            raise ValueError(f"topk must be positive, got k={k}")
        zero_outside = loss_fn.zero_outside_topk
        with_entropy = zero_outside and loss_fn.kl_type != "forward"
        student, entropy = _student_topk(
            packed, layout.pack(indices.long()), zero_outside, with_entropy
        )
        teacher = torch.log_softmax(data["teacher_topk_logits"].to(student.dtype), -1)
        h_all = None if entropy is None else layout.unpack(entropy, width)[:, :-1]
        return {
            "student_topk_logprobs": layout.unpack(student, width)[:, :-1],
            "teacher_topk_logprobs": teacher[:, :-1],
            "H_all": h_all,
        }, dict(data)
    raise ValueError(
        f"prepare_packed_loss_input supports LOGIT, LOGPROB and DISTILLATION losses, got "
        f"{input_type}; draft losses go through DraftLossWrapper"
    )
