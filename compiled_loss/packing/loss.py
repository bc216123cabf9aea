"""The loss over one micro-batch, as functions (the seed's wrapper classes are frozen
partial applications of these, see `compiled_loss.wrapper`).

`sequence_packing_loss` is pure tensor code over a host-built `PackedLayout`: traced by
torch.compile it is ONE graph, with no Python loop over sequences and no `.item()`, whose
shapes depend only on the bucket. It evaluates the loss ONCE over the unpacked `[B, S]`
view with every tensor zeroed past each sequence's length: exactly the per-sequence loop's
result (its `[:, :L_i]` slicing, ref §7.2) for every loss whose value and metrics are sums
over rows — which every loss here is, with the two exceptions listed in the README. The
next-token inputs at positions that loop never evaluates are zeroed as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiled_loss.interfaces import LossInputType
from compiled_loss.packing.boundaries import CpuIntTuple
from compiled_loss.packing.layout import PackedLayout, row_width
from compiled_loss.parallel import check_agreement
from compiled_loss.vocab.fused import LinearLogits, per_position

Tensor = torch.Tensor


def check_inputs_agree(
    who: str,
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Any],
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    **more: Any,
) -> None:
    """Host side, before a micro-batch's collectives: every rank of the tensor- and
    context-parallel groups holds logits of the same shape and dtype (its vocabulary shard
    and its context-parallel positions: equal shard widths, rows and positions) and data
    with the same keys, shapes and dtypes (`more`: other tensors the loss reads). Otherwise
    a ValueError naming what differs, raised on every rank within seconds instead of a
    collective that aborts or hangs. The wrappers call it in eager mode; it is skipped while
    torch.compile traces, so a caller of a compiled loss calls it on the host first."""
    logits = {"next_token_logits": next_token_logits}
    if isinstance(next_token_logits, LinearLogits):
        logits = {f"next_token_logits.{k}": getattr(next_token_logits, k) for k in ("hidden", "weight", "bias")}
    check_agreement(
        f"{who}'s inputs (shapes and dtypes)",
        {**logits, **{f"data[{k!r}]": v for k, v in data.items()}, **more},
        vocab_parallel_group,
        context_parallel_group,
    )


def wrap_loss_fn_with_input_preparation(
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    loss_fn: Any,
    prepare_fn: Callable[..., Any],
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`prepare_fn` then `loss_fn` on an unpacked `[B, S]` micro-batch (ref §7.6). Under
    tensor / context parallelism an eager call first checks that the ranks agree on every
    shape and dtype (`check_inputs_agree`)."""
    check_inputs_agree(
        "wrap_loss_fn_with_input_preparation", next_token_logits, data, vocab_parallel_group, context_parallel_group
    )
    loss_input, data = prepare_fn(
        logits=next_token_logits,
        data=data,
        loss_fn=loss_fn,
        vocab_parallel_rank=vocab_parallel_rank,
        vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group,
    )
    return loss_fn(
        data=data,
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
        **loss_input,
    )


def sequence_packing_loss(
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    *,
    loss_fn: Any,
    prepare_fn: Callable[..., Any],
    layout: PackedLayout,
    fused: bool,
    cu_seqlens_q: CpuIntTuple | None = None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss over packed `[1, T, V]` logits (or `LinearLogits` of `[1, T, H]` hidden states)
    and unpacked `[B, S]` data (traceable).

    `fused=False` (per-sequence semantics, any `prepare_fn` of the `prepare_loss_input`
    kind): the packed logits are unpacked to `[B, S, V]` (a gather Inductor fuses into the
    consumer) and `prepare_fn` runs once. `fused=True`: `prepare_fn` (of the
    `prepare_packed_loss_input` kind) works on the packed logits directly and gets the
    layout. Either way `loss_fn` runs once on data zero-padded to the bucket and zeroed
    past each sequence's length — except the keys a loss names in `teacher_logits_keys`
    (a cross-tokenizer teacher's logits, indexed by the teacher's own positions). Under
    tensor / context parallelism an eager call first checks that the ranks agree on every
    shape and dtype (`check_inputs_agree`; the packing itself is checked where the layout
    is built).
    """
    check_inputs_agree("sequence_packing_loss", next_token_logits, data, vocab_parallel_group, context_parallel_group)
    if getattr(loss_fn, "input_type", None) == LossInputType.DISTILLATION and not (
        "token_mask" in data and "sample_mask" in data
    ):
        raise ValueError(
            f"{type(loss_fn).__name__} under packing needs data['token_mask'] and data['sample_mask']: without them "
            "it takes a plain mean over every position of the micro-batch, which is not the per-sequence loop's "
            "sum of per-sequence means"
        )
    layout = layout.on(next_token_logits.device)
    packed = per_position(next_token_logits, lambda x: layout.slots(x, "next_token_logits"))
    data = layout.pad_data(data)
    teacher_positions = {k: data[k] for k in getattr(loss_fn, "teacher_logits_keys", ()) if k in data}
    data = {**layout.truncate({k: v for k, v in data.items() if k not in teacher_positions}), **teacher_positions}
    groups = dict(
        vocab_parallel_rank=vocab_parallel_rank,
        vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group,
    )
    if fused:
        loss_input, data = prepare_fn(
            logits=next_token_logits,
            data=data,
            loss_fn=loss_fn,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            layout=layout,
            **groups,
        )
    else:
        unpacked = per_position(packed, lambda x: layout.unpack(x, row_width(data)))
        loss_input, data = prepare_fn(logits=unpacked, data=data, loss_fn=loss_fn, **groups)
    loss_input, data = _zero_unevaluated(loss_input, data, layout.valid_mask(row_width(data))[:, 1:])
    return loss_fn(
        data=data,
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
        **loss_input,
    )


def _zero_unevaluated(
    loss_input: dict[str, Any], data: dict[str, Tensor], next_valid: Tensor
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Zero every next-token input (`[B, S-1, ...]`) at positions the per-sequence loop never
    evaluates: `t >= L_i - 1`, whose target lies past the sequence. Whatever the logits or
    teacher hold there (NaN, a -inf for the pad id) reaches no value and no gradient."""
    rows, width = next_valid.shape

    def zeroed(value: Any) -> Any:
        if not isinstance(value, Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (rows, width):
            return value
        keep = next_valid.reshape(next_valid.shape + (1,) * (value.dim() - 2))
        return torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device))

    data = dict(data)
    if "curr_logprobs_unfiltered" in data:
        data["curr_logprobs_unfiltered"] = zeroed(data["curr_logprobs_unfiltered"])
    return {key: zeroed(value) for key, value in loss_input.items()}, data
