"""Seed API `nemo_rl.algorithms.loss.wrapper` (ref §7) as frozen partials of functions.

The packing wrappers build their `PackedLayout` on the host when constructed (from the
`CpuIntTuple` boundaries) and their `__call__` is pure tensor code over the layout's index
tensors: traced by torch.compile it is ONE graph, with no Python loop over sequences and
no `.item()`, whose shapes depend only on the bucket. The keyword-only `bucket` argument
(an extension of the seed signature) picks the bucket grid; data already padded to the
bucket (`wrapper.layout.pad_data(data)`, outside the compiled region) keeps one compile per
bucket.

Both packing wrappers compute the loss ONCE over the unpacked `[B, S]` view, with every
tensor zeroed past each sequence's length: exactly the per-sequence loop's result (its
`[:, :L_i]` slicing) for every loss whose value and metrics are sums over rows — which
every loss here is, with the two exceptions listed in the README.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from compiled_loss.layout import BucketGrid, CpuIntTuple, PackedLayout, check_cu_seqlens, row_width
from compiled_loss.loss_functions import DEFAULT_DRAFT_TOKEN_CHUNK_SIZE, DraftCrossEntropyLossFn
from compiled_loss.metrics import _SEQ_METRIC_MAX, _SEQ_METRIC_MIN
from compiled_loss.parallel import require_single_process
from compiled_loss.utils import map_teacher_logits_to_draft_vocab

Tensor = TypeVar("Tensor")  # seed: `nemo_rl.algorithms.loss.wrapper.Tensor`

__all__ = [
    "Tensor",
    "_SEQ_METRIC_MIN",
    "_SEQ_METRIC_MAX",
    "SequencePackingLossWrapper",
    "SequencePackingFusionLossWrapper",
    "DraftLossWrapper",
    "DraftRuntimeLossWrapper",
    "wrap_loss_fn_with_input_preparation",
    "sequence_packing_loss",
]


def wrap_loss_fn_with_input_preparation(
    next_token_logits: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | None,
    global_valid_toks: torch.Tensor | None,
    loss_fn: Any,
    prepare_fn: Callable[..., Any],
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`prepare_fn` then `loss_fn` on an unpacked micro-batch (ref §7.6)."""
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


def _on_device(layout: PackedLayout, device: torch.device) -> PackedLayout:
    return layout if layout.device == device else layout.to(device)


def sequence_packing_loss(
    next_token_logits: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | None,
    global_valid_toks: torch.Tensor | None,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss over packed `[1, T, V]` logits and unpacked `[B, S]` data (traceable).

    `fused=False` (per-sequence semantics, any `prepare_fn` of the `prepare_loss_input`
    kind): the packed logits are unpacked to `[B, S, V]` (a gather Inductor fuses into the
    consumer) and `prepare_fn` runs once. `fused=True`: `prepare_fn` (of the
    `prepare_packed_loss_input` kind) works on the packed logits directly and gets the
    layout. Either way `loss_fn` runs once on data zero-padded to the bucket and zeroed
    past each sequence's length.
    """
    layout = _on_device(layout, next_token_logits.device)
    packed = layout.slots(next_token_logits, "next_token_logits")
    data = layout.truncate(layout.pad_data(data))
    groups = dict(
        vocab_parallel_rank=vocab_parallel_rank,
        vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group,
    )
    if fused:
        loss_input, data = prepare_fn(
            logits=next_token_logits, data=data, loss_fn=loss_fn, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded, layout=layout, **groups,
        )
    else:
        unpacked = layout.unpack(packed, row_width(data))
        loss_input, data = prepare_fn(logits=unpacked, data=data, loss_fn=loss_fn, **groups)
    return loss_fn(
        data=data,
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
        **loss_input,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _PackingWrapper:
    loss_fn: Any
    prepare_fn: Callable[..., Any]
    cu_seqlens_q: CpuIntTuple
    cu_seqlens_q_padded: CpuIntTuple | None = None
    vocab_parallel_rank: int | None = None
    vocab_parallel_group: Any = None
    context_parallel_group: Any = None
    _: dataclasses.KW_ONLY
    bucket: BucketGrid = BucketGrid()
    layout: PackedLayout = dataclasses.field(init=False, repr=False)

    _fused: ClassVar[bool]

    def __post_init__(self) -> None:
        require_single_process(self.vocab_parallel_group, "vocab_parallel_group")
        require_single_process(self.context_parallel_group, "context_parallel_group")
        cu, cup = check_cu_seqlens(self.cu_seqlens_q, self.cu_seqlens_q_padded)
        object.__setattr__(self, "cu_seqlens_q", cu)
        object.__setattr__(self, "cu_seqlens_q_padded", cup)
        object.__setattr__(self, "layout", PackedLayout.build(cu, cup, grid=self.bucket))

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return sequence_packing_loss(
            next_token_logits, data, global_valid_seqs, global_valid_toks,
            loss_fn=self.loss_fn, prepare_fn=self.prepare_fn, layout=self.layout,
            fused=self._fused, cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_q_padded=self.cu_seqlens_q_padded,
            vocab_parallel_rank=self.vocab_parallel_rank,
            vocab_parallel_group=self.vocab_parallel_group,
            context_parallel_group=self.context_parallel_group,
        )


class SequencePackingLossWrapper(_PackingWrapper):
    """Per-sequence packing semantics (ref §7.2), vectorised: `prepare_fn` is
    `prepare_loss_input` (or any function of that signature)."""

    _fused = False


class SequencePackingFusionLossWrapper(_PackingWrapper):
    """Fused packing (ref §7.3): `prepare_fn` is `prepare_packed_loss_input`, which does the
    vocab work once over the packed logits. Supports LOGIT, LOGPROB and DISTILLATION
    losses and matches `SequencePackingLossWrapper` (loss, gradients, metrics)."""

    _fused = True


@dataclasses.dataclass(frozen=True, eq=False)
class DraftLossWrapper:
    """Policy loss + `loss_weight` × draft soft cross-entropy (ref §7.4).

    Unpacked: `prepare_fn` (`prepare_loss_input` with `d2t` bound) builds the shifted
    teacher and mask, `data["student_logits"]` is the draft output. Packed
    (`cu_seqlens_q` given): the soft-CE runs once over the packed `[1, T]` layout with the
    teacher shifted within each segment; `student_logits` must be passed explicitly.
    `data_dict` is accepted for signature compatibility and not read.
    """

    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    prepare_fn: Callable[..., Any] | None
    data_dict: Any
    loss_weight: float = 1.0
    vocab_parallel_rank: int | None = None
    vocab_parallel_group: Any = None
    context_parallel_group: Any = None
    defer_normalization: bool = False
    cu_seqlens_q: Any = None
    cu_seqlens_q_padded: Any = None
    d2t: torch.Tensor | None = None
    student_logits: torch.Tensor | None = None
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE
    _: dataclasses.KW_ONLY
    bucket: BucketGrid = BucketGrid()
    layout: PackedLayout | None = dataclasses.field(init=False, repr=False, default=None)
    draft_loss_fn: DraftCrossEntropyLossFn = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        require_single_process(self.vocab_parallel_group, "vocab_parallel_group")
        require_single_process(self.context_parallel_group, "context_parallel_group")
        packed = self.cu_seqlens_q is not None
        if packed and self.student_logits is None:
            raise ValueError("DraftLossWrapper: student_logits must be passed explicitly in packed mode")
        if packed and self.defer_normalization:
            raise ValueError("DraftLossWrapper: defer_normalization is not supported in packed mode")
        if not packed and self.prepare_fn is None:
            raise ValueError("DraftLossWrapper: prepare_fn is required in unpacked mode")
        object.__setattr__(
            self, "draft_loss_fn",
            DraftCrossEntropyLossFn(self.vocab_parallel_group, self.token_chunk_size),
        )
        if packed:
            layout = PackedLayout.build(self.cu_seqlens_q, self.cu_seqlens_q_padded, grid=self.bucket)
            object.__setattr__(self, "layout", layout)

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if global_valid_toks is None:
            raise ValueError("DraftLossWrapper: global_valid_toks must not be None")
        policy_loss, metrics = self.loss_fn(
            next_token_logits, data, global_valid_seqs, global_valid_toks, **kwargs
        )
        metrics = dict(metrics)
        if self.layout is not None:
            draft = self._packed_draft_loss(next_token_logits, data, global_valid_seqs, global_valid_toks)
        else:
            loss_input, draft_data = self.prepare_fn(
                logits=next_token_logits, data=data, loss_fn=self.draft_loss_fn,
                vocab_parallel_rank=self.vocab_parallel_rank,
                vocab_parallel_group=self.vocab_parallel_group,
                context_parallel_group=self.context_parallel_group,
            )
            if self.defer_normalization:
                stats = self.draft_loss_fn.loss_stats(data=draft_data, **loss_input)
                draft = stats.normalized(torch.ones_like(stats.counts))
                metrics["_draft_step_numerator"] = stats.numerators.sum().detach()
                metrics["_draft_step_count"] = stats.counts.sum().detach()
            else:
                draft = self.draft_loss_fn(
                    data=draft_data, global_valid_seqs=global_valid_seqs,
                    global_valid_toks=global_valid_toks, **loss_input,
                )
        metrics["draft_loss"] = draft.detach()
        if not self.defer_normalization:
            metrics["total_loss"] = metrics["loss"] + self.loss_weight * draft.detach()
        return policy_loss + self.loss_weight * draft, metrics

    def _packed_draft_loss(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor,
    ) -> torch.Tensor:
        layout = _on_device(self.layout, next_token_logits.device)
        student = layout.slots(self.student_logits, "student_logits")
        teacher = map_teacher_logits_to_draft_vocab(
            layout.slots(next_token_logits, "next_token_logits").detach(), self.d2t,
            self.vocab_parallel_rank, self.vocab_parallel_group,
        )
        data = layout.pad_data(data)
        mask = layout.pack(data["token_mask"] * data["sample_mask"][:, None])
        return self.draft_loss_fn(
            teacher_logits=layout.roll(teacher)[None],
            student_logits=student[None],
            token_mask=layout.roll(mask)[None],
            data={"sample_mask": mask.new_ones(1)},
            global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class DraftRuntimeLossWrapper:
    """Policy loss + `draft_runtime.loss_weight` × the co-trained drafter's loss (ref §7.5).

    `draft_runtime` is any object with `loss_weight` and
    `compute_loss(prepared_data) -> (loss, metrics)`.
    """

    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    prepare_fn: Callable[..., Any]
    draft_runtime: Any

    def __post_init__(self) -> None:
        for attr in ("loss_weight", "compute_loss"):
            if not hasattr(self.draft_runtime, attr):
                raise TypeError(
                    f"DraftRuntimeLossWrapper: draft_runtime must have `{attr}` "
                    f"({type(self.draft_runtime).__name__} has not)"
                )

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        loss_input, prepared = self.prepare_fn(next_token_logits, data, self.loss_fn)
        policy_loss, metrics = self.loss_fn(
            data=prepared, global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks, **loss_input,
        )
        draft_loss, draft_metrics = self.draft_runtime.compute_loss(prepared)
        metrics = {**metrics, **draft_metrics}
        return policy_loss + self.draft_runtime.loss_weight * draft_loss, metrics
