"""OPD_FULL inputs (ref §5.1 OPD_FULL, §6.6): the per-token reverse KL of the student to a
teacher whose logits come from a transported payload (full logits, or hidden states projected
through the teacher LM heads `PrepareOptions.teacher_output_layer_weight_by_index`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NotRequired, TypedDict

import torch

from compiled_loss.inputs.logprob import next_token_logprobs
from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.inputs.teacher import OPD_FULL_TEACHER_INDEX_FIELD, OPD_FULL_TEACHER_PAYLOAD_FIELD, teacher_logits
from compiled_loss.interfaces import InputSpec
from compiled_loss.losses.common import require_keys
from compiled_loss.packing.view import Logits, TokenView
from compiled_loss.parallel import group_rank
from compiled_loss.vocab import LinearLogits, reverse_kl

Tensor = torch.Tensor


def _teacher_index(data: Mapping[str, Tensor], weights: dict[int, Tensor] | None) -> tuple[Tensor | None, int]:
    """Each row's teacher index `[B]` (None when absent or with no loaded head) with the rows
    no loss reads (`sample_mask` 0, bucket padding) routed to the first loaded head, and that
    head's index."""
    index = data.get(OPD_FULL_TEACHER_INDEX_FIELD)
    if index is None or not weights:
        return None, 0
    first = next(iter(weights))
    return torch.where(data["sample_mask"].to(index.device) > 0, index, first), first


class OpdFullInput(TypedDict):
    """OPD_FULL inputs, `[B, S-1]`."""

    opd_full_divergence: Tensor
    opd_full_entropy: NotRequired[Tensor]  # when the config reports it
    opd_full_cross_entropy: NotRequired[Tensor]  # when the config reports it
    next_token_logprobs: NotRequired[Tensor]  # with a reference KL


def opd_full_input(
    view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
) -> tuple[OpdFullInput, None]:
    """`opd_full_divergence` `[B, S-1]` (with `opd_full_entropy` / `opd_full_cross_entropy`
    when the config reports them) from `data["opd_full_teacher_payload"]` `[B, S, D]` (rows
    routed to a teacher head by `data["opd_full_teacher_index"]` `[B]` when present); a loss
    with a reference KL also gets `next_token_logprobs` `[B, S-1]`."""
    who = f"{view.who} (OPD_FULL)"
    require_keys(data, ("input_ids", "token_mask", "sample_mask", OPD_FULL_TEACHER_PAYLOAD_FIELD), who)
    if isinstance(logits, LinearLogits):
        raise ValueError(f"{who}: OPD_FULL inputs need the student's logits tensor, not LinearLogits")
    opd, tp, weights = spec.opd_full, options.parallel.tp, options.teacher_output_layer_weight_by_index
    assert opd is not None  # an OPD_FULL loss declares its distillation config
    student = view.rows(logits)
    to_logits = functools.partial(
        teacher_logits,
        teacher_payload=opd.teacher_payload,
        tp_rank=group_rank(tp),
        local_vocab=student.shape[-1],
        teacher_output_layer_weight_by_index=weights,
    )
    payload = data[OPD_FULL_TEACHER_PAYLOAD_FIELD]
    if opd.teacher_payload == "logits":  # this rank's vocabulary slice, before the positions are moved
        teacher = view.local(to_logits(payload, None))
    else:
        index, (rows_index, first) = None, _teacher_index(data, weights)
        if rows_index is not None:  # the view pads with 0: shift so padding positions name the first head
            index = view.local((rows_index - first)[:, None].expand(-1, view.width)) + first
        teacher = to_logits(view.local(payload), index)
    kl, negent, cross_entropy = reverse_kl(student, teacher, chunk_size=opd.chunk_size, group=tp)
    out = OpdFullInput(opd_full_divergence=view.full(kl)[:, :-1])
    if opd.with_entropy:
        out["opd_full_entropy"] = view.full(-negent)[:, :-1]
    if opd.with_cross_entropy:
        out["opd_full_cross_entropy"] = view.full(cross_entropy)[:, :-1]
    if spec.unfiltered_logprobs:
        out["next_token_logprobs"] = next_token_logprobs(view, logits, data["input_ids"], group=tp)
    return out, None
