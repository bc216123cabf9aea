"""The loss over one micro-batch: `micro_batch_loss`, the one entry point the seed wrappers,
the training step and the audit all run (`compiled_loss.wrapper` holds the seed's classes,
frozen partial applications of the functions here).

A micro-batch is padded rows `[B, S]` (no layout) or packed `[1, T]` logits over a host-built
`PackedLayout` with unpacked `[B, S]` data. Packed, it is pure tensor code: traced by
torch.compile it is ONE graph, with no Python loop over sequences and no `.item()`, whose
shapes depend only on the bucket. It evaluates the loss ONCE over the unpacked `[B, S]`
view with every tensor zeroed past each sequence's length: exactly the per-sequence loop's
result (its `[:, :L_i]` slicing, ref §7.2) for every loss whose value and metrics are sums
over rows — which every loss here is, with the two exceptions listed in docs/deviations.md. The
next-token inputs at positions that loop never evaluates are zeroed as well.

How the loss's inputs are built is the `prepare` callable (`Prepare`): the library's
preparation (`compiled_loss.inputs.Preparation`), or a seed `prepare_fn` adapted by
`seed_prepare`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from compiled_loss.interfaces import InputSpec, LossFunction, LossInputType
from compiled_loss.packing.boundaries import CpuIntTuple
from compiled_loss.packing.layout import PackedLayout, row_width
from compiled_loss.parallel import ParallelGroups, check_agreement, group_rank, same_group
from compiled_loss.vocab.fused import GRADIENT_CARRIER, LinearLogits, per_position
from compiled_loss.vocab.shards import local_logits, seed_groups

Tensor = torch.Tensor


class Prepare(Protocol):
    """A micro-batch's input preparation: logits (unpacked `[B, S, V]` when `layout` is None,
    packed `[1, T, V]` laid out by `layout` otherwise), data and the groups the logits are
    sharded over → `(loss_input, data)`."""

    def __call__(
        self,
        logits: Tensor | LinearLogits,
        data: Mapping[str, Tensor],
        layout: PackedLayout | None,
        parallel: ParallelGroups,
    ) -> tuple[dict[str, Any], dict[str, Tensor]]: ...


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


def micro_batch_loss(
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    *,
    loss_fn: LossFunction,
    spec: InputSpec,
    prepare: Prepare,
    layout: PackedLayout | None = None,
    per_sequence: bool = False,
    parallel: ParallelGroups = ParallelGroups(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """`(loss, metrics)` of one micro-batch: its inputs prepared, then `loss_fn`.

    Padded rows (`layout` None): `prepare` on the `[B, S(_local), V]` logits. Packed: the
    data is padded to the bucket and zeroed past each sequence's length — except the keys the
    loss declares in `spec.teacher_logits_keys` (indexed by a teacher's own positions) — and
    `prepare` runs on the packed logits, or with `per_sequence` (the per-sequence loop's
    semantics) on the logits unpacked to `[B, S, V]` (under context parallelism on each
    rank's slots, which gives the same values); the next-token inputs are then zeroed where
    the per-sequence loop never evaluates. Under tensor / context parallelism an eager call
    first checks that the ranks agree on every shape and dtype (`check_inputs_agree`; the
    packing itself is checked where the layout is built)."""
    who = "wrap_loss_fn_with_input_preparation" if layout is None else "sequence_packing_loss"
    logits, parallel = local_logits(logits, parallel, who)  # a DTensor: its local shard and its mesh's groups
    if layout is not None and not same_group(layout.shards.group if layout.shards is not None else None, parallel.cp):
        raise ValueError(
            f"{who}: the logits are sharded over another context-parallel group than the packing's layout was "
            "built for: build the wrapper (the layout) with context_parallel_group= the logits' 'cp' mesh group"
        )
    check_inputs_agree(who, logits, data, parallel.tp, parallel.cp)
    normalizers = dict(global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks)
    if isinstance(logits, LinearLogits) and spec.token_separable:
        logits = dataclasses.replace(logits, objective=_objective(loss_fn, normalizers, layout))
    if layout is None:
        loss_input, data = prepare(logits, data, None, parallel)
    else:
        if spec.input_type == LossInputType.DISTILLATION and not ("token_mask" in data and "sample_mask" in data):
            raise ValueError(
                f"{type(loss_fn).__name__} under packing needs data['token_mask'] and data['sample_mask']: without "
                "them it takes a plain mean over every position of the micro-batch, which is not the per-sequence "
                "loop's sum of per-sequence means"
            )
        layout = layout.on(logits.device)
        packed = per_position(logits, lambda x: layout.slots(x, "next_token_logits"))
        data = layout.pad_data(data)
        teacher_positions = {k: data[k] for k in spec.teacher_logits_keys if k in data}
        data = {**layout.truncate({k: v for k, v in data.items() if k not in teacher_positions}), **teacher_positions}
        if per_sequence and layout.shards is None:
            unpacked = per_position(packed, lambda x: layout.unpack(x, row_width(data)))
            loss_input, data = prepare(unpacked, data, None, parallel)
        else:
            loss_input, data = prepare(logits, data, layout, parallel)
        loss_input = _zero_unevaluated(loss_input, layout.valid_mask(row_width(data))[:, 1:])
    carrier = loss_input.pop(GRADIENT_CARRIER, None)
    loss, metrics = loss_fn(data=data, **normalizers, **loss_input)
    return (loss, metrics) if carrier is None else (loss + carrier, metrics)


def _objective(
    loss_fn: LossFunction, normalizers: dict[str, Any], layout: PackedLayout | None
) -> Callable[..., Tensor]:
    """The micro-batch's loss as a function of its inputs and (prepared) data, for the
    gradient in the forward of a token-separable loss (`LinearLogits.objective`)."""

    def objective(loss_input: dict[str, Any], data: Mapping[str, Tensor]) -> Tensor:
        if layout is not None:
            loss_input = _zero_unevaluated(loss_input, layout.valid_mask(row_width(data))[:, 1:])
        return loss_fn(data=data, **normalizers, **loss_input)[0]

    return objective


def _zero_unevaluated(loss_input: dict[str, Any], next_valid: Tensor) -> dict[str, Any]:
    """Zero every next-token input (`[B, S-1, ...]`) at positions the per-sequence loop never
    evaluates: `t >= L_i - 1`, whose target lies past the sequence. Whatever the logits or
    teacher hold there (NaN, a -inf for the pad id) reaches no value and no gradient."""
    rows, width = next_valid.shape

    def zeroed(value: Any) -> Any:
        if not isinstance(value, Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (rows, width):
            return value
        keep = next_valid.reshape(next_valid.shape + (1,) * (value.dim() - 2))
        return torch.where(keep, value, torch.zeros((), dtype=value.dtype, device=value.device))

    return {key: zeroed(value) for key, value in loss_input.items()}


def _call_seed(
    prepare_fn: Callable[..., Any],
    loss_fn: LossFunction,
    packed: dict[str, Any],
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    layout: PackedLayout | None,
    parallel: ParallelGroups,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    groups = dict(
        vocab_parallel_rank=group_rank(parallel.tp) if parallel.tp is not None else None,
        vocab_parallel_group=parallel.tp,
        context_parallel_group=parallel.cp,
    )
    if layout is None:
        return prepare_fn(logits=logits, data=data, loss_fn=loss_fn, **groups)
    return prepare_fn(logits=logits, data=data, loss_fn=loss_fn, layout=layout, **packed, **groups)


def seed_prepare(
    prepare_fn: Callable[..., Any],
    loss_fn: LossFunction,
    cu_seqlens_q: CpuIntTuple | None = None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
) -> Prepare:
    """A seed `prepare_fn` as a `Prepare`: called with the seed's keywords (the groups the
    logits are sharded over, this rank's rank in the vocabulary group) — of the
    `prepare_loss_input` kind on unpacked logits, of the `prepare_packed_loss_input` kind
    (with the boundaries and `layout=`) on packed ones."""
    packed = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded)
    return functools.partial(_call_seed, prepare_fn, loss_fn, packed)


def wrap_loss_fn_with_input_preparation(
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    loss_fn: LossFunction,
    prepare_fn: Callable[..., Any],
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`prepare_fn` then `loss_fn` on an unpacked `[B, S]` micro-batch (ref §7.6): the
    micro-batch entry point over padded rows. Under tensor / context parallelism an eager
    call first checks that the ranks agree on every shape and dtype (`check_inputs_agree`)."""
    next_token_logits, parallel = seed_groups(
        next_token_logits,
        vocab_parallel_rank,
        vocab_parallel_group,
        context_parallel_group,
        "wrap_loss_fn_with_input_preparation",
    )
    return micro_batch_loss(
        next_token_logits,
        data,
        global_valid_seqs,
        global_valid_toks,
        loss_fn=loss_fn,
        spec=InputSpec.of(loss_fn),
        prepare=seed_prepare(prepare_fn, loss_fn),
        parallel=parallel,
    )


def sequence_packing_loss(
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    *,
    loss_fn: LossFunction,
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
    and unpacked `[B, S]` data (traceable): the micro-batch entry point over `layout`.

    `fused=False` (per-sequence semantics, any `prepare_fn` of the `prepare_loss_input`
    kind): the packed logits are unpacked to `[B, S, V]` (a gather Inductor fuses into the
    consumer) and `prepare_fn` runs once. `fused=True`: `prepare_fn` (of the
    `prepare_packed_loss_input` kind) works on the packed logits directly and gets the
    layout — under context parallelism it must (each rank prepares its own slots).
    """
    if not fused and layout.shards is not None:
        raise ValueError(
            "sequence_packing_loss: under context parallelism each rank prepares its own packed slots: pass "
            "fused=True and a prepare_fn of the prepare_packed_loss_input kind"
        )
    next_token_logits, parallel = seed_groups(
        next_token_logits, vocab_parallel_rank, vocab_parallel_group, context_parallel_group, "sequence_packing_loss"
    )
    return micro_batch_loss(
        next_token_logits,
        data,
        global_valid_seqs,
        global_valid_toks,
        loss_fn=loss_fn,
        spec=InputSpec.of(loss_fn),
        prepare=seed_prepare(prepare_fn, loss_fn, cu_seqlens_q=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded),
        layout=layout,
        per_sequence=not fused,
        parallel=parallel,
    )
