"""The loss over one micro-batch: `micro_batch_loss`, the one entry point the seed wrappers,
the training step and the audit all run (`compiled_loss.nemo_rl.wrapper` holds the seed's
classes and functions, frozen partial applications of the one here).

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
`compiled_loss.nemo_rl.wrapper.SeedPrepare`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from compiled_loss.interfaces import InputSpec, LossFunction, LossInputType
from compiled_loss.packing.layout import PackedLayout, row_width
from compiled_loss.parallel import ParallelGroups, check_agreement, same_group
from compiled_loss.vocab.fused import LinearLogits, per_position
from compiled_loss.vocab.shards import local_logits

Tensor = torch.Tensor


class Prepare(Protocol):
    """A micro-batch's input preparation for `loss_fn` (whose `InputSpec` is `spec`): logits
    (unpacked `[B, S, V]` when `layout` is None, packed `[1, T, V]` laid out by `layout`
    otherwise), data and the groups the logits are sharded over → `(loss_input, data, gradient)`:
    `gradient` the zero that carries the loss's gradient where preparation computed it in the
    forward (`LinearLogits.objective`), added to the loss; None otherwise."""

    @property
    def loss_fn(self) -> LossFunction: ...
    @property
    def spec(self) -> InputSpec: ...

    def __call__(
        self,
        logits: Tensor | LinearLogits,
        data: Mapping[str, Tensor],
        layout: PackedLayout | None,
        parallel: ParallelGroups,
    ) -> tuple[Mapping[str, Any], dict[str, Tensor], Tensor | None]: ...


def check_inputs_agree(
    who: str,
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Any],
    parallel: ParallelGroups,
    **more: Any,
) -> None:
    """Host side, before a micro-batch's collectives: every rank of the tensor- and
    context-parallel groups (`parallel.tp`, `parallel.cp`) holds logits of the same shape
    and dtype (its vocabulary shard and its context-parallel positions: equal shard widths,
    rows and positions) and data with the same keys, shapes and dtypes (`more`: other tensors
    the loss reads). Otherwise a ValueError naming what differs, raised on every rank within
    seconds instead of a collective that aborts or hangs. The wrappers call it in eager mode; it is skipped while
    torch.compile traces, so a caller of a compiled loss calls it on the host first."""
    logits = {"next_token_logits": next_token_logits}
    if isinstance(next_token_logits, LinearLogits):
        logits = {f"next_token_logits.{k}": getattr(next_token_logits, k) for k in ("hidden", "weight", "bias")}
    check_agreement(
        f"{who}'s inputs (shapes and dtypes)",
        {**logits, **{f"data[{k!r}]": v for k, v in data.items()}, **more},
        parallel.tp,
        parallel.cp,
    )


def micro_batch_loss(
    logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor | None,
    *,
    prepare: Prepare,
    layout: PackedLayout | None = None,
    per_sequence: bool = False,
    parallel: ParallelGroups = ParallelGroups(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """`(loss, metrics)` of one micro-batch: its inputs prepared, then `prepare.loss_fn`.

    Padded rows (`layout` None): `prepare` on the `[B, S(_local), V]` logits. Packed: the
    data is padded to the bucket and zeroed past each sequence's length — except the keys the
    loss declares in `prepare.spec.teacher_logits_keys` (indexed by a teacher's own positions) — and
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
    check_inputs_agree(who, logits, data, parallel)
    loss_fn, spec = prepare.loss_fn, prepare.spec
    normalizers = dict(global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks)
    if isinstance(logits, LinearLogits) and spec.token_separable:
        logits = dataclasses.replace(logits, objective=_objective(loss_fn, normalizers, layout))
    if layout is None:
        loss_input, data, gradient = prepare(logits, data, None, parallel)
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
            loss_input, data, gradient = prepare(unpacked, data, None, parallel)
        else:
            loss_input, data, gradient = prepare(logits, data, layout, parallel)
        loss_input = _zero_unevaluated(loss_input, layout.valid_mask(row_width(data))[:, 1:])
    loss, metrics = loss_fn(data=data, **normalizers, **loss_input)
    return (loss, metrics) if gradient is None else (loss + gradient, metrics)


def _objective(
    loss_fn: LossFunction, normalizers: dict[str, Any], layout: PackedLayout | None
) -> Callable[..., Tensor]:
    """The micro-batch's loss as a function of its inputs and (prepared) data, for the
    gradient in the forward of a token-separable loss (`LinearLogits.objective`)."""

    def objective(loss_input: Mapping[str, Any], data: Mapping[str, Tensor]) -> Tensor:
        if layout is not None:
            loss_input = _zero_unevaluated(loss_input, layout.valid_mask(row_width(data))[:, 1:])
        return loss_fn(data=data, **normalizers, **loss_input)[0]

    return objective


def _zero_unevaluated(loss_input: Mapping[str, Any], next_valid: Tensor) -> dict[str, Any]:
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
