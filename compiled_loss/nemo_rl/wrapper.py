"""Seed API `nemo_rl.algorithms.loss.wrapper` (ref §7): the seed's names, with the same
signatures, as frozen partial applications of the functions in `compiled_loss.packing`
and `compiled_loss.draft` — the seed's group arguments converted once into `ParallelGroups`
(`compiled_loss.nemo_rl.groups`), a seed `prepare_fn` into a `Prepare`.

The packing wrappers build their `PackedLayout` on the host when constructed (from the
`CpuIntTuple` boundaries) and convert the loss and `prepare_fn` once (the loss's
`InputSpec`, the library's preparation); their `__call__` is the micro-batch entry point
`micro_batch_loss` over the layout — one graph under torch.compile, shaped by the bucket.
Keyword-only extensions of the seed signatures: `bucket=BucketGrid(...)` (the bucket grid;
pad the data with `wrapper.layout.pad_data` outside the compiled region) and `device=`
(build the index tensors there, so compiled calls copy nothing).

`DraftLossWrapper` constructs its draft loss through this module's
`DraftCrossEntropyLossFn` name, so patching that name works as it does in NeMo-RL.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch.distributed import ProcessGroup

from compiled_loss.draft import DraftRuntime, draft_soft_ce, packed_draft_soft_ce, with_draft_loss
from compiled_loss.inputs import Preparation, PrepareOptions
from compiled_loss.interfaces import InputSpec, LossFunction
from compiled_loss.losses.draft_ce import DEFAULT_DRAFT_TOKEN_CHUNK_SIZE
from compiled_loss.metrics import _SEQ_METRIC_MAX, _SEQ_METRIC_MIN
from compiled_loss.nemo_rl.groups import seed_groups, seed_parallel
from compiled_loss.nemo_rl.loss_functions import DraftCrossEntropyLossFn
from compiled_loss.nemo_rl.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.packing import (
    BucketGrid,
    CpuIntTuple,
    PackedLayout,
    Prepare,
    check_cu_seqlens,
    check_inputs_agree,
    micro_batch_loss,
)
from compiled_loss.parallel import ParallelGroups, check_agreement, group_rank
from compiled_loss.vocab import DraftVocab
from compiled_loss.vocab.fused import LinearLogits
from compiled_loss.vocab.shards import local_logits, local_tensor

Tensor = TypeVar("Tensor")  # seed: `nemo_rl.algorithms.loss.wrapper.Tensor`

__all__ = [
    "Tensor",
    "_SEQ_METRIC_MIN",
    "_SEQ_METRIC_MAX",
    "DraftCrossEntropyLossFn",
    "SequencePackingLossWrapper",
    "SequencePackingFusionLossWrapper",
    "DraftLossWrapper",
    "DraftRuntimeLossWrapper",
    "wrap_loss_fn_with_input_preparation",
    "sequence_packing_loss",
    "seed_prepare",
]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as Dynamo guards on it
class SeedPrepare:
    """A seed `prepare_fn` as a `Prepare`: called with the seed's keywords (the groups the
    logits are sharded over, this rank's rank in the vocabulary group) — of the
    `prepare_loss_input` kind on unpacked logits, of the `prepare_packed_loss_input` kind
    (with the boundaries and `layout=`) on packed ones."""

    prepare_fn: Callable[..., Any]
    loss_fn: LossFunction
    spec: InputSpec
    cu_seqlens_q: CpuIntTuple | None = None
    cu_seqlens_q_padded: CpuIntTuple | None = None

    def __call__(
        self,
        logits: torch.Tensor | LinearLogits,
        data: Mapping[str, torch.Tensor],
        layout: PackedLayout | None,
        parallel: ParallelGroups,
    ) -> tuple[Mapping[str, Any], dict[str, torch.Tensor], None]:
        """`prepare_fn`'s `(loss_input, data)`; the loss's backward computes its gradient."""
        groups = dict(
            vocab_parallel_rank=group_rank(parallel.tp) if parallel.tp is not None else None,
            vocab_parallel_group=parallel.tp,
            context_parallel_group=parallel.cp,
        )
        call = dict(logits=logits, data=data, loss_fn=self.loss_fn, **groups)
        if layout is None:
            loss_input, prepared = self.prepare_fn(**call)
        else:
            packed = dict(cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_q_padded=self.cu_seqlens_q_padded)
            loss_input, prepared = self.prepare_fn(**call, layout=layout, **packed)
        return loss_input, prepared, None


def seed_prepare(
    prepare_fn: Callable[..., Any],
    loss_fn: LossFunction,
    cu_seqlens_q: CpuIntTuple | None = None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
) -> SeedPrepare:
    """A seed `prepare_fn` as a `Prepare` for `micro_batch_loss` (`SeedPrepare`)."""
    return SeedPrepare(prepare_fn, loss_fn, InputSpec.of(loss_fn), cu_seqlens_q, cu_seqlens_q_padded)


def wrap_loss_fn_with_input_preparation(
    next_token_logits: torch.Tensor | LinearLogits,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | None,
    global_valid_toks: torch.Tensor | None,
    loss_fn: LossFunction,
    prepare_fn: Callable[..., Any],
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    who = "wrap_loss_fn_with_input_preparation"
    prepare = _preparation(prepare_fn, loss_fn, InputSpec.of(loss_fn), None, parallel, (None, None), False, who)
    return micro_batch_loss(
        next_token_logits, data, global_valid_seqs, global_valid_toks, prepare=prepare, parallel=parallel
    )


def sequence_packing_loss(
    next_token_logits: torch.Tensor | LinearLogits,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | None,
    global_valid_toks: torch.Tensor | None,
    *,
    loss_fn: LossFunction,
    prepare_fn: Callable[..., Any],
    layout: PackedLayout,
    fused: bool,
    cu_seqlens_q: CpuIntTuple | None = None,
    cu_seqlens_q_padded: CpuIntTuple | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    cu_seqlens = (cu_seqlens_q, cu_seqlens_q_padded)
    spec = InputSpec.of(loss_fn)
    prepare = _preparation(prepare_fn, loss_fn, spec, None, parallel, cu_seqlens, False, "sequence_packing_loss")
    return micro_batch_loss(
        next_token_logits,
        data,
        global_valid_seqs,
        global_valid_toks,
        prepare=prepare,
        layout=layout,
        per_sequence=not fused,
        parallel=parallel,
    )


def _preparation(
    prepare_fn: Callable[..., Any],
    loss_fn: LossFunction,
    spec: InputSpec,
    vocab_parallel_rank: int | None,
    parallel: ParallelGroups,
    cu_seqlens: tuple[CpuIntTuple | None, CpuIntTuple | None],
    per_sequence_cp: bool,
    who: str,
) -> Prepare:
    """A seed `prepare_fn` as the micro-batch entry point's `Prepare`, converted once: the
    library's own (`prepare_loss_input` / `prepare_packed_loss_input`, or a keyword
    `functools.partial` of either) becomes its `Preparation`, which prepares unpacked rows and
    packed slots alike; any other function is called with the seed's keywords. Per-sequence
    packing under context parallelism prepares each rank's slots, which only the library's
    preparation does."""
    func, keywords = prepare_fn, {}
    if isinstance(prepare_fn, functools.partial) and not prepare_fn.args:
        func, keywords = prepare_fn.func, dict(prepare_fn.keywords)
    seed_parallel(vocab_parallel_rank, parallel.tp, parallel.cp)  # the rank, checked
    if func in (prepare_loss_input, prepare_packed_loss_input) and set(keywords) <= _OPTIONS:
        return Preparation(loss_fn, spec, PrepareOptions(parallel, **keywords))
    if per_sequence_cp:
        raise ValueError(
            f"{who} with context parallelism needs prepare_fn=prepare_loss_input (or a functools.partial of it): "
            f"each rank evaluates its own CP slots; got {prepare_fn!r}"
        )
    return SeedPrepare(prepare_fn, loss_fn, spec, *cu_seqlens)


# the keyword options of the library's preparation functions (`PrepareOptions`)
_OPTIONS = {"sampling_params", "chunk_size", "d2t", "teacher_output_layer_weight_by_index"}


def _agreed_layout(wrapper: Any) -> tuple[CpuIntTuple, CpuIntTuple, PackedLayout]:
    """A packed wrapper's checked boundaries and its layout, built on the host once every TP /
    CP rank has been seen to hold the same packing (`check_agreement`: the same clear error
    on every rank instead of a collective that hangs)."""
    cu, cup = check_cu_seqlens(wrapper.cu_seqlens_q, wrapper.cu_seqlens_q_padded)
    check_agreement(
        "the packing (cu_seqlens_q, cu_seqlens_q_padded, bucket)",
        (cu, cup, wrapper.bucket),
        wrapper.vocab_parallel_group,
        wrapper.context_parallel_group,
    )
    parallel = ParallelGroups(cp=wrapper.context_parallel_group)
    layout = PackedLayout.build(cu, cup, grid=wrapper.bucket, device=wrapper.device, parallel=parallel)
    return cu, cup, layout


def _check_pairs_fit(loss_fn: LossFunction, spec: InputSpec, layout: PackedLayout, who: str) -> None:
    """Pairwise losses need an even number of REAL rows: bucket padding would otherwise
    pair the last real row with a padding row."""
    if spec.pairs and layout.rows % 2:
        raise ValueError(
            f"{who}: {type(loss_fn).__name__} reads (chosen, rejected) row pairs, but the packing has an "
            f"odd number of sequences ({layout.rows})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class _PackingWrapper:
    loss_fn: LossFunction
    prepare_fn: Callable[..., Any]
    cu_seqlens_q: CpuIntTuple
    cu_seqlens_q_padded: CpuIntTuple | None = None
    vocab_parallel_rank: int | None = None
    vocab_parallel_group: ProcessGroup | None = None
    context_parallel_group: ProcessGroup | None = None
    _: dataclasses.KW_ONLY
    bucket: BucketGrid = BucketGrid()
    device: torch.device | str | None = None
    layout: PackedLayout = dataclasses.field(init=False, repr=False)
    _parallel: ParallelGroups = dataclasses.field(init=False, repr=False)
    _prepare: Prepare = dataclasses.field(init=False, repr=False)

    _fused: ClassVar[bool]

    def __post_init__(self) -> None:
        cu, cup, layout = _agreed_layout(self)
        object.__setattr__(self, "cu_seqlens_q", cu)
        object.__setattr__(self, "cu_seqlens_q_padded", cup)
        who, spec = type(self).__name__, InputSpec.of(self.loss_fn)
        _check_pairs_fit(self.loss_fn, spec, layout, who)
        parallel = ParallelGroups(tp=self.vocab_parallel_group, cp=self.context_parallel_group)
        per_sequence_cp = layout.shards is not None and not self._fused
        prepare = _preparation(
            self.prepare_fn, self.loss_fn, spec, self.vocab_parallel_rank, parallel, (cu, cup), per_sequence_cp, who
        )
        for name, value in (("layout", layout), ("_parallel", parallel), ("_prepare", prepare)):
            object.__setattr__(self, name, value)

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return micro_batch_loss(
            next_token_logits,
            data,
            global_valid_seqs,
            global_valid_toks,
            prepare=self._prepare,
            layout=self.layout,
            per_sequence=not self._fused,
            parallel=self._parallel,
        )


class SequencePackingLossWrapper(_PackingWrapper):
    """Per-sequence packing semantics (ref §7.2), vectorised: `prepare_fn` is
    `prepare_loss_input` (or any function of that signature). Under context parallelism it
    must be `prepare_loss_input` or a `functools.partial` of it: the per-token vocabulary
    work then runs on each rank's CP slots (`prepare_packed_loss_input`), with the same
    values as the per-sequence loop."""

    _fused = False


class SequencePackingFusionLossWrapper(_PackingWrapper):
    """Fused packing (ref §7.3): `prepare_fn` is `prepare_packed_loss_input`, which does the
    vocab work once over the packed logits. Supports LOGIT, LOGPROB, DISTILLATION,
    DISTILLATION_CROSS_TOKENIZER and OPD_FULL losses and matches `SequencePackingLossWrapper`
    (loss, gradients, metrics)."""

    _fused = True


@dataclasses.dataclass(frozen=True, eq=False)
class DraftLossWrapper:
    """Policy loss + `loss_weight` × draft soft cross-entropy (ref §7.4).

    Unpacked: `prepare_fn` (`prepare_loss_input` with `d2t` bound) builds the shifted
    teacher and mask, `data["student_logits"]` is the draft output. Packed
    (`cu_seqlens_q` given): the soft-CE runs once over the packed `[1, T]` layout with the
    teacher shifted within each segment; `student_logits` must be passed explicitly and
    `d2t` is checked once, here. `data_dict` is accepted for signature compatibility and
    not read. Both layouts take tensor- and context-parallel groups (vocabulary-sharded
    logits and draft head; each rank's CP slots, the draft soft-CE summed over the CP ranks
    under the policy loss's gradient convention); an eager call first checks that the ranks
    agree on every shape and dtype (`check_inputs_agree`).
    """

    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    prepare_fn: Callable[..., Any] | None
    data_dict: Any
    loss_weight: float = 1.0
    vocab_parallel_rank: int | None = None
    vocab_parallel_group: ProcessGroup | None = None
    context_parallel_group: ProcessGroup | None = None
    defer_normalization: bool = False
    cu_seqlens_q: Any = None
    cu_seqlens_q_padded: Any = None
    d2t: torch.Tensor | None = None
    student_logits: torch.Tensor | None = None
    token_chunk_size: int = DEFAULT_DRAFT_TOKEN_CHUNK_SIZE
    _: dataclasses.KW_ONLY
    bucket: BucketGrid = BucketGrid()
    device: torch.device | str | None = None
    layout: PackedLayout | None = dataclasses.field(init=False, repr=False, default=None)
    draft_vocab: DraftVocab | None = dataclasses.field(init=False, repr=False, default=None)
    draft_loss_fn: DraftCrossEntropyLossFn = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        packed = self.cu_seqlens_q is not None
        if packed and self.student_logits is None:
            raise ValueError("DraftLossWrapper: student_logits must be passed explicitly in packed mode")
        if packed and self.defer_normalization:
            raise ValueError("DraftLossWrapper: defer_normalization is not supported in packed mode")
        if not packed and self.prepare_fn is None:
            raise ValueError("DraftLossWrapper: prepare_fn is required in unpacked mode")
        object.__setattr__(
            self,
            "draft_loss_fn",
            DraftCrossEntropyLossFn(
                vocab_parallel_group=self.vocab_parallel_group,
                token_chunk_size=self.token_chunk_size,
            ),
        )
        if packed:
            *_, layout = _agreed_layout(self)
            object.__setattr__(self, "layout", layout)
            if self.d2t is not None:
                object.__setattr__(self, "draft_vocab", DraftVocab.build(self.d2t))

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | None,
        global_valid_toks: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        who = "DraftLossWrapper"
        if global_valid_toks is None:
            raise ValueError(f"{who}: global_valid_toks must not be None")
        # DTensor logits (and draft logits): this rank's shards, over their mesh's groups; the policy
        # loss takes them as given
        logits, parallel = local_logits(
            next_token_logits, ParallelGroups(tp=self.vocab_parallel_group, cp=self.context_parallel_group), who
        )
        student = local_tensor(self.student_logits, parallel, who, "student_logits")
        draft_data = data
        if "student_logits" in data:
            draft_data = {**data, "student_logits": local_tensor(data["student_logits"], parallel, who, "data")}
        check_inputs_agree(who, logits, draft_data, parallel, student_logits=student)
        policy_loss, metrics = self.loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks, **kwargs)
        draft_loss_fn = self.draft_loss_fn
        if parallel.tp is not draft_loss_fn.vocab_parallel_group:
            draft_loss_fn = dataclasses.replace(draft_loss_fn, vocab_parallel_group=parallel.tp)
        rank = self.vocab_parallel_rank if parallel.tp is self.vocab_parallel_group else None
        seed_parallel(rank, parallel.tp, parallel.cp)  # the rank, checked
        if self.layout is not None:
            draft = packed_draft_soft_ce(
                logits,
                draft_data,
                global_valid_seqs,
                global_valid_toks,
                draft_loss_fn=draft_loss_fn,
                layout=self.layout,
                student_logits=student,
                options=PrepareOptions(parallel, d2t=self.draft_vocab),
            )
            extra = {}
        else:
            draft, extra = draft_soft_ce(
                logits,
                draft_data,
                global_valid_seqs,
                global_valid_toks,
                prepare=SeedPrepare(self.prepare_fn, draft_loss_fn, InputSpec.of(draft_loss_fn)),
                parallel=parallel,
                defer_normalization=self.defer_normalization,
            )
        loss, metrics = with_draft_loss(
            policy_loss, metrics, draft, self.loss_weight, report_total=not self.defer_normalization
        )
        return loss, {**metrics, **extra}


@dataclasses.dataclass(frozen=True, eq=False)
class DraftRuntimeLossWrapper:
    """Policy loss + `draft_runtime.loss_weight` × the co-trained drafter's loss (ref §7.5).

    `draft_runtime` is any `compiled_loss.draft.DraftRuntime` (an object with
    `loss_weight` and `compute_loss(prepared_data) -> (loss, metrics)`).
    """

    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    prepare_fn: Callable[..., Any]
    draft_runtime: DraftRuntime

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
            data=prepared,
            global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks,
            **loss_input,
        )
        draft_loss, draft_metrics = self.draft_runtime.compute_loss(prepared)
        return policy_loss + self.draft_runtime.loss_weight * draft_loss, {**metrics, **draft_metrics}
