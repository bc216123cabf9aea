"""The preparer table: one preparer per `LossInputType`, and `prepare_inputs`, the one way in
to it — the seed functions `prepare_loss_input` / `prepare_packed_loss_input`, the packing
wrappers and the training step all prepare through it.

A preparer is a function of `(view, logits, data, spec, options)`: where the micro-batch's
tokens are (`compiled_loss.packing.view`), the logits (or `LinearLogits`), the batch, what
the loss declared (`InputSpec`) and the call's options (`PrepareOptions`); it returns the
loss's inputs as named fields. Written once against the view, it serves padded rows and
packed layouts, with or without context parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch

from compiled_loss.inputs.cross_tokenizer import CrossTokenizerInput, check_student_logits, cross_tokenizer_input
from compiled_loss.inputs.draft import DraftInput, draft_input
from compiled_loss.inputs.logit import LogitInput, logit_input
from compiled_loss.inputs.logprob import LogprobInput, logprob_input
from compiled_loss.inputs.opd_full import OpdFullInput, opd_full_input
from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.inputs.topk import TopkInput, topk_input
from compiled_loss.inputs.validate import check_batch_shapes, check_token_ids
from compiled_loss.interfaces import InputSpec, LossFunction, LossInputType
from compiled_loss.packing import PackedLayout, row_width
from compiled_loss.packing.view import Logits, PackedView, RowsView, TokenView
from compiled_loss.parallel import ParallelGroups
from compiled_loss.vocab import LinearLogits

Tensor = torch.Tensor


# a loss's inputs: one TypedDict per input type
LossInput = LogitInput | LogprobInput | TopkInput | DraftInput | OpdFullInput | CrossTokenizerInput


class Preparer(Protocol):
    """`(view, logits, data, spec, options) -> (inputs, gradient)`: `gradient` is the zero that
    carries the loss's gradient where the preparer computed it in the forward (a token-separable
    loss on `LinearLogits` with an `objective`), to be added to the loss; None otherwise."""

    def __call__(
        self, view: TokenView, logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions
    ) -> tuple[LossInput, Tensor | None]: ...


PREPARERS: dict[LossInputType, Preparer] = {
    LossInputType.LOGIT: logit_input,
    LossInputType.LOGPROB: logprob_input,
    LossInputType.DISTILLATION: topk_input,
    LossInputType.DRAFT: draft_input,
    LossInputType.OPD_FULL: opd_full_input,
    LossInputType.DISTILLATION_CROSS_TOKENIZER: cross_tokenizer_input,
}

# the data key whose token ids each input type reads (LOGIT and DRAFT inputs read none)
_TOKEN_ID_KEY = {
    LossInputType.LOGPROB: "input_ids",
    LossInputType.DISTILLATION: "teacher_topk_indices",
    LossInputType.OPD_FULL: "input_ids",
    LossInputType.DISTILLATION_CROSS_TOKENIZER: "input_ids",
}


def _check_logits(logits: Logits, spec: InputSpec, name: str, options: PrepareOptions, who: str) -> None:
    """What each input type takes as logits: `LinearLogits` stand in for them wherever only row
    statistics are taken; the cross-tokenizer loss reads whole distributions on one rank."""
    if spec.input_type == LossInputType.DISTILLATION_CROSS_TOKENIZER:
        check_student_logits(logits, name, options.parallel, who)
    if not isinstance(logits, LinearLogits):
        return
    if spec.input_type == LossInputType.LOGIT:
        raise ValueError(
            f"{who}: {name} (a LOGIT loss) reads the logits themselves; pass the logits tensor, not LinearLogits"
        )
    if spec.fused_linear_logprobs:
        raise ValueError(
            f"{who}: with use_fused_linear_logprobs the logits argument holds next-token log-probs [B, S]; "
            "LinearLogits computes them here instead: pass one or the other"
        )


def _check_data(logits: Logits, data: Mapping[str, Tensor], spec: InputSpec, options: PrepareOptions, who: str) -> None:
    """The batch's shapes and dtypes (`check_batch_shapes`: static, so a compiled call refuses
    a bad batch while tracing) and, in eager mode, the token ids the input type reads against
    the vocabulary `V = V_local · tp`, or the real one of padded shards (one host read; see
    `check_token_ids`)."""
    check_batch_shapes(data, who)
    key = _TOKEN_ID_KEY.get(spec.input_type)
    if key is not None and not spec.fused_linear_logprobs:
        vocab = options.parallel.vocab_size or logits.shape[-1] * options.parallel.sizes[0]
        check_token_ids(data, (key,), vocab, who)


def _rows_width(logits: Logits, data: Mapping[str, Tensor]) -> int:
    """The row width `S` of an unpacked batch: its first per-position key's (the logits' own
    width when it holds none, as a LOGIT loss's batch may)."""
    key = next((k for k in ("input_ids", "token_mask", "teacher_topk_indices") if k in data), None)
    return logits.shape[1] if key is None else data[key].shape[1]


def prepare_inputs(
    logits: Logits,
    data: Mapping[str, Tensor],
    loss_fn: LossFunction,
    spec: InputSpec,
    options: PrepareOptions,
    layout: PackedLayout | None = None,
) -> LossInput:
    """`loss_fn`'s inputs from unpacked `[B, S(_local), V]` logits (`layout` None) or packed
    `[1, T(_local), V]` ones laid out by `layout`: the host-side checks of the logits and the
    batch (before any vocabulary work), then the preparer of `spec.input_type`. The loss's
    backward computes its gradient (a `LinearLogits` objective is not used here: only
    `Preparation`, which returns the gradient beside the inputs, takes it in the forward)."""
    if isinstance(logits, LinearLogits) and logits.objective is not None:
        logits = dataclasses.replace(logits, objective=None)
    return _prepare(logits, data, loss_fn, spec, options, layout)[0]


def _prepare(
    logits: Logits,
    data: Mapping[str, Tensor],
    loss_fn: LossFunction,
    spec: InputSpec,
    options: PrepareOptions,
    layout: PackedLayout | None,
) -> tuple[LossInput, Tensor | None]:
    """`prepare_inputs`, with the gradient a preparer computed in the forward (`Preparer`)."""
    who = (RowsView if layout is None else PackedView).who
    _check_logits(logits, spec, type(loss_fn).__name__, options, who)
    _check_data(logits, data, spec, options, who)
    preparer = PREPARERS.get(spec.input_type)
    if preparer is None:
        raise ValueError(f"Unknown loss function input type: {spec.input_type!r}")
    view: TokenView
    if layout is None:
        view = RowsView.of(logits, _rows_width(logits, data), options.parallel)
    else:
        view = PackedView(layout, row_width(data))
    return preparer(view, logits, data, spec, options)


@dataclasses.dataclass(frozen=True, eq=False)
class Preparation:
    """`prepare_inputs` for one loss and one set of options, as the micro-batch entry point
    calls it (`compiled_loss.packing.Prepare`): `(logits, data, layout, parallel) ->
    (loss_input, data, gradient)`, over the groups the logits are sharded over."""

    loss_fn: LossFunction
    spec: InputSpec
    options: PrepareOptions

    def __call__(
        self, logits: Logits, data: Mapping[str, Tensor], layout: PackedLayout | None, parallel: ParallelGroups
    ) -> tuple[LossInput, dict[str, Tensor], Tensor | None]:
        options = self.options
        if parallel is not options.parallel and (  # the groups of DTensor logits
            parallel.tp is not options.parallel.tp
            or parallel.cp is not options.parallel.cp
            or parallel.vocab_size != options.parallel.vocab_size
        ):
            options = dataclasses.replace(options, parallel=parallel)
        inputs, gradient = _prepare(logits, data, self.loss_fn, self.spec, options, layout)
        return inputs, dict(data), gradient
