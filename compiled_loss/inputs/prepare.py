"""Input preparation: logits → what each loss consumes (ref §5, §8.9–8.10).

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

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiled_loss.inputs.cross_tokenizer import check_student_logits, cross_tokenizer_loss_input
from compiled_loss.inputs.teacher import (
    OPD_FULL_TEACHER_INDEX_FIELD,
    OPD_FULL_TEACHER_PAYLOAD_FIELD,
    reconstruct_opd_full_teacher_logits,
    teacher_logits,
)
from compiled_loss.inputs.validate import check_batch_shapes, check_token_ids
from compiled_loss.interfaces import LossInputType
from compiled_loss.losses.common import require_keys
from compiled_loss.packing import CpuIntTuple, PackedLayout, roll_within_segments, row_width
from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel import group_rank, group_size
from compiled_loss.vocab import (
    DraftVocab,
    LinearLogits,
    TrainingSamplingParams,
    check_chunk_size,
    map_teacher_logits_to_draft_vocab,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
    per_position,
    reverse_kl,
    token_logprobs,
    vocab_reduce,
)

Tensor = torch.Tensor


def _check_rank(vocab_parallel_rank: int | None, vocab_parallel_group: Any) -> None:
    """The seed signatures pass the rank beside the group; it must be the group's."""
    if vocab_parallel_rank is not None and vocab_parallel_rank != group_rank(vocab_parallel_group):
        raise ValueError(
            f"vocab_parallel_rank={vocab_parallel_rank} is not this process's rank "
            f"{group_rank(vocab_parallel_group)} in vocab_parallel_group"
        )


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Unpacked `[B, S, ...]` positions as flat rows, and this rank's share of them under
    context parallelism: each row padded to `S_local · cp` and load-balanced (ref §8.10)."""

    rows: int
    width: int  # S
    padded: int  # S_pad = S_local · cp (= S without CP)
    shards: ContextShards | None

    @staticmethod
    def of(logits: Tensor | LinearLogits, width: int, context_parallel_group: Any) -> _Rows:
        cp = group_size(context_parallel_group)
        if cp == 1:
            if logits.shape[1] < width:
                raise ValueError(
                    f"logits must cover the {width} positions of input_ids, got shape {tuple(logits.shape)}"
                )
            return _Rows(logits.shape[0], width, width, None)
        padded = logits.shape[1] * cp
        if padded < width:
            raise ValueError(
                f"logits hold {logits.shape[1]} positions per context-parallel rank; {cp} ranks cover {padded}, "
                f"fewer than the {width} positions of input_ids"
            )
        shards = ContextShards.of_rows(logits.shape[0], padded, context_parallel_group, logits.device)
        return _Rows(logits.shape[0], width, padded, shards)

    def logits(self, x: Tensor | LinearLogits) -> Tensor | LinearLogits:
        """`[B, W, V]` logits → this rank's `[N, V]` rows (a view when W == S)."""

        def rows(t: Tensor) -> Tensor:
            if self.shards is None and t.shape[1] > self.width:
                t = t[:, : self.width]
            return t.reshape(-1, t.shape[-1])

        return per_position(x, rows)

    def local(self, x: Tensor) -> Tensor:
        """A `[B, S, ...]` per-position tensor → this rank's `[N, ...]` entries."""
        if self.shards is None:
            return x.reshape((-1,) + tuple(x.shape[2:]))
        pad = [0, 0] * (x.dim() - 2) + [0, self.padded - self.width]
        return self.shards.local(torch.nn.functional.pad(x, pad).reshape((-1,) + tuple(x.shape[2:])))

    def full(self, y: Tensor) -> Tensor:
        """This rank's `[N, ...]` results → every position's `[B, S, ...]`."""
        if self.shards is None:
            return y.reshape((self.rows, self.width) + tuple(y.shape[1:]))
        y = self.shards.gather(y)
        return y.reshape((self.rows, -1) + tuple(y.shape[1:]))[:, : self.width]


def _check_cp_sharder(cp_sharder: Any) -> None:
    if cp_sharder is not None:
        raise ValueError(
            "cp_sharder: compiled_loss shards context-parallel positions in the load-balanced 2·cp layout of "
            "context_parallel_group; pass cp_sharder=None"
        )


def _check_linear(logits: Tensor | LinearLogits, loss_fn: Any, who: str) -> None:
    """LinearLogits stand in for logits wherever only row statistics are taken."""
    if not isinstance(logits, LinearLogits):
        return
    if loss_fn.input_type == LossInputType.LOGIT:
        raise ValueError(
            f"{who}: {type(loss_fn).__name__} (a LOGIT loss) reads the logits themselves; pass the logits tensor, "
            "not LinearLogits"
        )
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        raise ValueError(
            f"{who}: with use_fused_linear_logprobs the logits argument holds next-token log-probs [B, S]; "
            "LinearLogits computes them here instead: pass one or the other"
        )


# the data key whose token ids each input type reads (LOGIT and DRAFT inputs read none)
_TOKEN_ID_KEY = {
    LossInputType.LOGPROB: "input_ids",
    LossInputType.DISTILLATION: "teacher_topk_indices",
    LossInputType.OPD_FULL: "input_ids",
    LossInputType.DISTILLATION_CROSS_TOKENIZER: "input_ids",
}


def _check_data(logits: Tensor | LinearLogits, data: Mapping[str, Tensor], loss_fn: Any, group: Any, who: str) -> None:
    """The batch's shapes and dtypes (`check_batch_shapes`: static, so a compiled call
    refuses a bad batch while tracing) and, in eager mode, the token ids the input type
    reads against the vocabulary `V = V_local · tp` (one host read; see `check_token_ids`)."""
    check_batch_shapes(data, who)
    key = _TOKEN_ID_KEY.get(loss_fn.input_type)
    if key is not None and not getattr(loss_fn, "use_fused_linear_logprobs", False):
        check_token_ids(data, (key,), logits.shape[-1] * group_size(group), who)


def _top_k_top_p(sampling_params: TrainingSamplingParams | None) -> tuple[int | None, float] | None:
    """The vocab primitive's filter for the generation-time sampling parameters (ref §3.3)."""
    if not need_top_k_or_top_p_filtering(sampling_params):
        return None
    return sampling_params.top_k, sampling_params.top_p


def get_next_token_logprobs_from_logits(
    input_ids: Tensor,
    next_token_logits: Tensor | LinearLogits,
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
    every position's, on every rank.
    """
    _check_rank(vocab_parallel_rank, vocab_parallel_group)
    rows, width = input_ids.shape
    view = _Rows.of(next_token_logits, width, context_parallel_group)
    flat = view.logits(next_token_logits)
    targets = view.local(torch.roll(input_ids, -1, 1))  # last column wraps; dropped below
    lp = token_logprobs(
        flat, targets, top_k_top_p=_top_k_top_p(sampling_params), chunk_size=chunk_size, group=vocab_parallel_group
    )
    return view.full(lp)[:, :-1]


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
    student_logits: Tensor | LinearLogits,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    *,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Student / teacher top-k log-probs `[B, S-1, k]` and `H_all = Σ p log p` (ref §8.9);
    parallel layouts as in `get_next_token_logprobs_from_logits`, indices are global ids;
    `chunk_size`: rows per chunk of the vocab primitive."""
    _check_rank(vocab_parallel_rank, vocab_parallel_group)
    k = teacher_topk_indices.shape[-1]
    if k <= 0:
        raise ValueError(f"topk must be positive, got k={k}")
    width = teacher_topk_indices.shape[1]
    view = _Rows.of(student_logits, width, context_parallel_group)
    flat = view.logits(student_logits)
    index = view.local(teacher_topk_indices.to(device=flat.device, dtype=torch.long))
    student, entropy = _student_topk(
        flat, index, zero_outside_topk, calculate_entropy, vocab_parallel_group, chunk_size
    )
    student = view.full(student)
    teacher = torch.log_softmax(teacher_topk_logits.to(device=student.device, dtype=student.dtype), -1)
    h_all = None if entropy is None else view.full(entropy)[:, :-1]
    return student[:, :-1], teacher[:, :-1], h_all


def _student_topk(
    rows: Tensor | LinearLogits,
    index: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    group: Any = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`[N, k]` student values at teacher indices: full-vocab log-probs (zero_outside_topk)
    or log-probs renormalised over the k gathered logits; plus `Σ p log p` if asked."""
    if zero_outside_topk:
        stats = vocab_reduce(rows, index, entropy=calculate_entropy, chunk_size=chunk_size, group=group)
        return stats.picked - stats.lse[:, None], stats.negent if calculate_entropy else None
    # the k logits (from whichever vocabulary shard holds them; LinearLogits: chunk by chunk),
    # renormalised over the k by the same primitive, so rows no loss reads get exactly zero gradient
    if group_size(group) > 1 or isinstance(rows, LinearLogits):
        picked = vocab_reduce(rows, index, chunk_size=chunk_size, group=group).picked
    else:
        picked = rows.gather(-1, index)
    k_way = vocab_reduce(picked, torch.arange(index.shape[-1], device=index.device).expand_as(index))
    return k_way.picked - k_way.lse[:, None], None


def _draft_loss_input(
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    d2t: Tensor | DraftVocab | None,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
) -> dict[str, Tensor]:
    """Teacher = policy logits shifted left by one (last slot zero), mapped to the draft
    vocabulary; token mask shifted the same way (ref §5.1 DRAFT). Under context
    parallelism the shift crosses ranks (ref §8.14) and the mask is this rank's share.
    `LinearLogits` are mapped first (only the draft vocabulary's rows of the LM head)."""
    require_keys(data, ("token_mask", "student_logits"), "prepare_loss_input (DRAFT)")
    if isinstance(logits, LinearLogits):
        logits = map_teacher_logits_to_draft_vocab(logits, d2t, vocab_parallel_rank, vocab_parallel_group).detach()
        d2t, vocab_parallel_group = None, None  # mapped: the rows are this rank's draft-vocabulary slice
    token_mask = data["token_mask"]
    last = torch.zeros(token_mask.shape[1], dtype=torch.bool, device=token_mask.device)
    last[-1] = True
    mask = roll_within_segments(token_mask, last, 1)
    view = _Rows.of(logits, token_mask.shape[1], context_parallel_group)
    if view.shards is None:
        teacher = roll_within_segments(logits.detach(), last.to(logits.device), 1)
    else:
        rows, local_width = logits.shape[:2]
        teacher = view.shards.next_rows(view.logits(logits)).reshape(logits.shape)
        mask = view.local(mask).reshape(rows, local_width)
    teacher = map_teacher_logits_to_draft_vocab(teacher, d2t, vocab_parallel_rank, vocab_parallel_group)
    return {"teacher_logits": teacher, "student_logits": data["student_logits"], "token_mask": mask}


def _opd_full_loss_input(
    student: Tensor, teacher: Tensor, to_full: Callable[[Tensor], Tensor], loss_fn: Any, group: Any
) -> dict[str, Tensor]:
    """The per-token reverse KL of this rank's student rows `[N, V_local]` to the teacher's
    (ref §5.1 OPD_FULL), with the diagnostics the config reports, each put back into the
    `[B, S-1]` layout by `to_full`."""
    opd = loss_fn.opd_full
    kl, negent, cross_entropy = reverse_kl(student, teacher, chunk_size=opd.chunk_size, group=group)
    out = {"opd_full_divergence": to_full(kl)}
    if opd.with_entropy:
        out["opd_full_entropy"] = to_full(-negent)
    if opd.with_cross_entropy:
        out["opd_full_cross_entropy"] = to_full(cross_entropy)
    return out


def _opd_full_teacher_index(
    data: Mapping[str, Tensor], loss_fn: Any, weights: dict[int, Tensor] | None
) -> tuple[Tensor | None, int]:
    """Each row's teacher index `[B]` (None when absent or with logits payloads) with the
    rows no loss reads (`sample_mask` 0, bucket padding) routed to the first loaded head,
    and that head's index."""
    index = data.get(OPD_FULL_TEACHER_INDEX_FIELD)
    if index is None or loss_fn.opd_full.teacher_payload != "hidden_states" or not weights:
        return None, 0
    first = next(iter(weights))
    return torch.where(data["sample_mask"].to(index.device) > 0, index, first), first


def _check_opd_full(logits: Tensor | LinearLogits, data: Mapping[str, Tensor], who: str) -> None:
    require_keys(data, ("input_ids", "token_mask", "sample_mask", OPD_FULL_TEACHER_PAYLOAD_FIELD), who)
    if isinstance(logits, LinearLogits):
        raise ValueError(f"{who}: OPD_FULL inputs need the student's logits tensor, not LinearLogits")


def prepare_loss_input(
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    loss_fn: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | DraftVocab | None = None,
    chunk_size: int | None = None,
    cp_sharder: Any = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Build `loss_fn`'s inputs from unpacked `[B, S, V]` logits (ref §5.1).

    Returns `(loss_input, data)`; `data` is a new dict (with `curr_logprobs_unfiltered`
    added under top-k/top-p when the loss has a reference KL). `d2t` (DRAFT inputs): pass
    a `DraftVocab` to skip the per-call check of a raw map. `logits` may be `LinearLogits`
    (hidden states `[B, S, H]` and the LM head) for every input type but LOGIT, OPD_FULL and
    DISTILLATION_CROSS_TOKENIZER.
    OPD_FULL: the teacher payload is `data["opd_full_teacher_payload"]` (rows routed by
    `data["opd_full_teacher_index"]` when present); hidden states are projected through
    `teacher_output_layer_weight_by_index`. Context parallelism is `context_parallel_group`
    (the load-balanced 2·cp layout); `cp_sharder` must be None.

    Refused before any vocabulary work: batch keys whose shape or dtype cannot be right
    (`check_batch_shapes`; a teacher payload or top-k teacher must hold one entry per
    position of `input_ids`, under context parallelism too) and, in an eager call, a token
    id outside the vocabulary (a ValueError naming the key, the id and `V`).
    """
    _check_rank(vocab_parallel_rank, vocab_parallel_group)
    check_chunk_size(chunk_size)
    _check_cp_sharder(cp_sharder)
    input_type = loss_fn.input_type
    _check_linear(logits, loss_fn, "prepare_loss_input")
    _check_data(logits, data, loss_fn, vocab_parallel_group, "prepare_loss_input")
    if input_type == LossInputType.LOGIT:
        if group_size(context_parallel_group) > 1:
            view = _Rows.of(logits, row_width(data), context_parallel_group)
            logits = view.full(view.logits(logits))
        return {"logits": logits}, dict(data)
    if input_type == LossInputType.LOGPROB:
        require_keys(data, ("input_ids", "token_mask", "sample_mask"), "prepare_loss_input")
        width = data["input_ids"].shape[1]
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            if group_size(context_parallel_group) > 1:
                view = _Rows.of(logits[..., None], width, context_parallel_group)
                logits = view.full(view.logits(logits[..., None]))[..., 0]
            return {"next_token_logprobs": logits.float()[:, : width - 1]}, dict(data)

        def logprobs(params, chunk):
            return get_next_token_logprobs_from_logits(
                data["input_ids"],
                logits,
                data.get("seq_index"),
                vocab_parallel_rank,
                vocab_parallel_group,
                context_parallel_group,
                params,
                chunk,
            )

        lp, data = _with_filter_handling(
            logprobs(sampling_params, chunk_size),
            lambda: logprobs(None, None),
            data,
            loss_fn,
            sampling_params,
        )
        return {"next_token_logprobs": lp}, data
    if input_type == LossInputType.DISTILLATION:
        require_keys(data, ("teacher_topk_logits", "teacher_topk_indices"), "prepare_loss_input")
        zero_outside = loss_fn.zero_outside_topk
        student, teacher, h_all = get_distillation_topk_logprobs_from_logits(
            logits,
            data["teacher_topk_logits"],
            data["teacher_topk_indices"],
            zero_outside,
            zero_outside and loss_fn.kl_type != "forward",
            vocab_parallel_rank,
            vocab_parallel_group,
            context_parallel_group,
            chunk_size=chunk_size,
        )
        return {
            "student_topk_logprobs": student,
            "teacher_topk_logprobs": teacher,
            "H_all": h_all,
        }, dict(data)
    if input_type == LossInputType.DRAFT:
        inputs = _draft_loss_input(logits, data, d2t, vocab_parallel_rank, vocab_parallel_group, context_parallel_group)
        return inputs, dict(data)
    if input_type == LossInputType.OPD_FULL:
        _check_opd_full(logits, data, "prepare_loss_input (OPD_FULL)")
        width = data["input_ids"].shape[1]
        teacher = reconstruct_opd_full_teacher_logits(
            data[OPD_FULL_TEACHER_PAYLOAD_FIELD],
            teacher_payload=loss_fn.opd_full.teacher_payload,
            student_logits=logits,
            vocab_parallel_rank=group_rank(vocab_parallel_group),
            context_parallel_group=context_parallel_group,
            teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
            teacher_index=_opd_full_teacher_index(data, loss_fn, teacher_output_layer_weight_by_index)[0],
        )
        view = _Rows.of(logits, width, context_parallel_group)
        inputs = _opd_full_loss_input(
            view.logits(logits), view.logits(teacher), lambda y: view.full(y)[:, :-1], loss_fn, vocab_parallel_group
        )
        if loss_fn.reference_policy_kl_penalty != 0:
            inputs["next_token_logprobs"] = get_next_token_logprobs_from_logits(
                data["input_ids"],
                logits,
                data.get("seq_index"),
                None,
                vocab_parallel_group,
                context_parallel_group,
            )
        return inputs, dict(data)
    if input_type == LossInputType.DISTILLATION_CROSS_TOKENIZER:
        who = "prepare_loss_input"
        check_student_logits(logits, loss_fn, vocab_parallel_group, context_parallel_group, who)
        return cross_tokenizer_loss_input(logits, data, loss_fn, who), dict(data)
    raise ValueError(f"Unknown loss function input type: {input_type!r}")


def prepare_packed_loss_input(
    logits: Tensor | LinearLogits,
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
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
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
    _check_rank(vocab_parallel_rank, vocab_parallel_group)
    check_chunk_size(chunk_size)
    _check_linear(logits, loss_fn, "prepare_packed_loss_input")
    if "cu_seqlens" in data:
        return _pre_packed_loss_input(
            logits, data, loss_fn, vocab_parallel_group, context_parallel_group, sampling_params, chunk_size
        )
    _check_data(logits, data, loss_fn, vocab_parallel_group, "prepare_packed_loss_input")
    if layout is None:
        if cu_seqlens_q is None:
            raise ValueError("prepare_packed_loss_input needs cu_seqlens_q or a layout")
        layout = PackedLayout.build(
            cu_seqlens_q, cu_seqlens_q_padded, device=logits.device, context_parallel_group=context_parallel_group
        )
    packed = per_position(logits, layout.slots)
    width = row_width(data)
    input_type = loss_fn.input_type
    tp = vocab_parallel_group
    if input_type == LossInputType.LOGIT:
        return {"logits": layout.unpack(layout.gather(packed), width)}, dict(data)
    if input_type == LossInputType.LOGPROB:
        require_keys(data, ("input_ids", "token_mask", "sample_mask"), "prepare_packed_loss_input")
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            return {"next_token_logprobs": layout.unpack(layout.gather(packed.float()), width)[:, :-1]}, dict(data)
        targets = layout.local(layout.roll(layout.pack(data["input_ids"])))

        def logprobs(params, chunk):
            lp = token_logprobs(packed, targets, top_k_top_p=_top_k_top_p(params), chunk_size=chunk, group=tp)
            return layout.unpack(layout.gather(lp), width)[:, :-1]

        lp, data = _with_filter_handling(
            logprobs(sampling_params, chunk_size),
            lambda: logprobs(None, None),
            data,
            loss_fn,
            sampling_params,
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
            packed, layout.local(layout.pack(indices.long())), zero_outside, with_entropy, tp, chunk_size
        )
        student = layout.gather(student)
        teacher = torch.log_softmax(data["teacher_topk_logits"].to(student.dtype), -1)
        h_all = None if entropy is None else layout.unpack(layout.gather(entropy), width)[:, :-1]
        return {
            "student_topk_logprobs": layout.unpack(student, width)[:, :-1],
            "teacher_topk_logprobs": teacher[:, :-1],
            "H_all": h_all,
        }, dict(data)
    if input_type == LossInputType.OPD_FULL:
        _check_opd_full(logits, data, "prepare_packed_loss_input (OPD_FULL)")
        weights = teacher_output_layer_weight_by_index
        to_logits = functools.partial(
            teacher_logits,
            teacher_payload=loss_fn.opd_full.teacher_payload,
            vocab_parallel_rank=group_rank(tp),
            local_vocab=packed.shape[-1],
            teacher_output_layer_weight_by_index=weights,
        )
        payload, index = data[OPD_FULL_TEACHER_PAYLOAD_FIELD], None
        if loss_fn.opd_full.teacher_payload == "logits":  # this rank's vocabulary slice before packing
            payload = to_logits(payload, None)
        teacher = layout.local(layout.pack(payload))
        if loss_fn.opd_full.teacher_payload == "hidden_states":
            rows_index, first = _opd_full_teacher_index(data, loss_fn, weights)
            if rows_index is not None:  # packing pads with 0: shift so padding slots name the first head
                index = layout.local(layout.pack((rows_index - first)[:, None].expand(-1, width))) + first
            teacher = to_logits(teacher, index)
        inputs = _opd_full_loss_input(
            packed, teacher, lambda y: layout.unpack(layout.gather(y), width)[:, :-1], loss_fn, tp
        )
        if loss_fn.reference_policy_kl_penalty != 0:
            targets = layout.local(layout.roll(layout.pack(data["input_ids"])))
            lp = token_logprobs(packed, targets, group=tp)
            inputs["next_token_logprobs"] = layout.unpack(layout.gather(lp), width)[:, :-1]
        return inputs, dict(data)
    if input_type == LossInputType.DISTILLATION_CROSS_TOKENIZER:
        who = "prepare_packed_loss_input"
        check_student_logits(logits, loss_fn, tp, context_parallel_group, who)
        return cross_tokenizer_loss_input(layout.unpack(packed, width), data, loss_fn, who), dict(data)
    raise ValueError(
        f"prepare_packed_loss_input supports LOGIT, LOGPROB, DISTILLATION, OPD_FULL and DISTILLATION_CROSS_TOKENIZER "
        f"losses, got {input_type}; draft losses go through DraftLossWrapper"
    )


def _pre_packed_loss_input(
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    loss_fn: Any,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A pre-packed `[1, T]` batch: its next-token log-probs as one row (the masks exclude
    the positions whose next token starts another sequence)."""
    who = "prepare_packed_loss_input (pre-packed data with 'cu_seqlens')"
    if loss_fn.input_type != LossInputType.LOGPROB:
        raise ValueError(f"{who}: supports LOGPROB losses, got {loss_fn.input_type}")
    if group_size(context_parallel_group) > 1:
        raise ValueError(
            f"{who}: context parallelism needs unpacked data and cu_seqlens_q; pass context_parallel_group=None"
        )
    require_keys(data, ("input_ids", "token_mask", "sample_mask"), who)
    if data["input_ids"].dim() != 2 or data["input_ids"].shape[0] != 1:
        raise ValueError(f"{who}: input_ids must be one packed row [1, T], got {tuple(data['input_ids'].shape)}")
    return prepare_loss_input(
        logits, data, loss_fn, None, vocab_parallel_group, None, sampling_params, chunk_size=chunk_size
    )
