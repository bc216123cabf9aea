"""The compiled training step: `build_train_step(cfg, model, optimizer, groups)`, or
`TrainStep(model, optimizer, loss_fn, StepOptions(...), groups)` with what a step needs
(`StepOptions.of(cfg)` reads it from a run config; the config keys are named below).

Per batch (host side): check the batch (`validate_batch`, unless `run.validate_inputs=false`;
token ids against `model.vocab_size`), compute the global normalisers `global_valid_seqs` /
`global_valid_toks` (summed over the data-parallel group), split the rows into
`run.micro_batches` micro-batches (keeping DPO pairs together), and for each build the
bucketed layout (`PackedLayout`, or bucketed padding for `packing=none`) on the host.
Then, per micro-batch, ONE compiled function runs the model forward and the micro-batch
entry point (`compiled_loss.packing.micro_batch_loss`); its backward accumulates
gradients. Finally the optimizer steps, and each micro-batch's metrics, converted to Python
floats, are combined with every data-parallel replica's through the registry
(`compiled_loss.metrics`: sum, mean, min or max per key).

Use it with your own model: any `torch.nn.Module` whose
`forward(input_ids, position_ids, segment_ids) -> logits` attends causally within a
segment — `[B, S]` inputs for `packing=none` (one segment per row), `[1, T]` for the
packed modes (segment = packed sequence, positions restarting at 0 in each). Batches are
dicts of `[B, S]` tensors with the loss's keys plus `input_lengths` `[B]`. With
`logprob.fused_linear=true` the model is called with `linear_logits=True` and returns
`LinearLogits(final hidden states, LM-head weight[, bias])`: the loss is then computed
from them chunk by chunk, and no `[T, V]` logits exist.

Parallel runs (`groups`, see `compiled_loss.train.parallel`): the batch is this
data-parallel rank's rows, and the model is sharded with torch.distributed's engine
(`compiled_loss.train.shard_model`: FSDP2 over `dp × dp_shard · cp`, a DTensor TP plan over
`tp`). Its logits are a DTensor sharded on the vocabulary, unwrapped once to this rank's
local shard before the loss; the step keeps this context-parallel rank's positions. FSDP2's
hooks do not trace, so the model runs eagerly around its compiled decoder layers and the
loss compiles as a graph of its own; the loss scale (`train.parallel.gradient_scale`:
`dp · dp_shard`) turns FSDP2's averaged gradients into the single-process gradient.

Co-trained drafter (`draft_runtime`): the model also returns its hidden states
(`forward(..., return_hidden=True) -> (logits, [after the embedding, after layer 0, …])`);
the step hands the runtime a `DraftBatch` of what the forward captured — detached, so the
policy's gradients do not depend on the drafter — plus per-token anchor noise drawn on the
host from `anchor_seed(dp_rank, global batch, micro-batch)` (the same noise for a token in
every packing mode and on every TP / CP peer), and adds `loss_weight × draft loss` in the
same compiled graph. In parallel runs every rank of a replica computes the same draft loss
on the full sequences (the TP teacher shards all-gathered to the full vocabulary; the
runtime's denominators summed over DP), and the drafter — replicated, outside FSDP — has its
gradients summed over the ranks after the backward. The drafter's gradients are clipped on
their own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.fsdp import FSDPModule

from compiled_loss.compile import admit_bucket, compile_loss
from compiled_loss.config import CompileConfig, Config, PackingMode
from compiled_loss.draft import (
    DraftBatch,
    DraftRuntimeBase,
    anchor_noise,
    anchor_seed,
    aux_hidden_states,
    with_draft_loss,
)
from compiled_loss.inputs import Preparation, PrepareOptions, validate_batch
from compiled_loss.interfaces import InputSpec, LossFunction
from compiled_loss.metrics import metrics_to_python, with_ratios
from compiled_loss.packing import BucketGrid, PackedLayout, micro_batch_loss, pad_to_bucket, round_to_bucket
from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel import check_agreement, group_size
from compiled_loss.parallel.collectives import all_gather
from compiled_loss.train.parallel import (
    ParallelGroups,
    all_reduce_host,
    clip_grad_norm,
    combine_over,
    gradient_scale,
)
from compiled_loss.train.recorder import CompileRecorder
from compiled_loss.vocab import LinearLogits, TrainingSamplingParams, per_position
from compiled_loss.vocab.shards import local_logits

Tensor = torch.Tensor


class _DraftSlots(NamedTuple):
    """What a `DraftBatch` takes of the micro-batch besides the model's outputs, per slot."""

    documents: Tensor
    loss_mask: Tensor
    noise: Tensor


def _captured(model, ids, positions, segments, shards=None, *, aux_layers, linear_logits=False, slots=None):
    """The model forward on `[R, L]` inputs (`linear_logits`: the model returns
    `LinearLogits`) and this context-parallel rank's slots of its logits (`shards`, None
    without context parallelism); with a drafter (`aux_layers`) also the `DraftBatch` it
    captured (`slots`: the micro-batch's documents, loss mask and anchor noise): the raw
    logits (before temperature) and the auxiliary layers' outputs, detached, of every slot.
    A model that declares `context_parallel` runs this rank's slots only, attending over
    every rank's keys and values (`context=`); the drafter's inputs are then gathered from
    every rank. Any other model runs every slot and keeps this rank's."""
    rows = ids.shape[0]
    sharded = shards is not None and getattr(model, "context_parallel", False)

    def local(x):  # a global [R, L, ...] tensor's slots of this rank, [R, L / cp, ...]
        return shards.local(x.flatten(0, 1)).view(rows, -1, *x.shape[2:])

    def whole(x):  # this rank's slots' [R, L / cp, ...] → every slot's, [R, L, ...] (no gradient)
        return shards.gather(x.detach().flatten(0, 1)).view(rows, -1, *x.shape[2:])

    inputs = (local(ids), local(positions), local(segments)) if sharded else (ids, positions, segments)
    kwargs = {"context": (shards, segments)} if sharded else {}
    if aux_layers is None:
        logits = _local(model(*inputs, **kwargs, **({"linear_logits": True} if linear_logits else {})))
        batch = None
    else:
        logits, hidden = model(*inputs, **kwargs, return_hidden=True)
        logits = _local(logits)
        hidden = [whole(h) for h in hidden] if sharded else hidden
        batch = DraftBatch(
            input_ids=ids,
            hidden_states=aux_hidden_states(hidden, aux_layers),
            teacher_logits=whole(logits) if sharded else logits.detach(),
            loss_mask=slots.loss_mask,
            document_ids=slots.documents,
            position_ids=positions,
            anchor_noise=slots.noise,
        )
    if shards is not None and not sharded:
        logits = per_position(logits, local)
    return logits, batch


def _local(logits: Tensor | LinearLogits) -> Tensor | LinearLogits:
    """The model's logits as this rank's vocabulary shard: a tensor-parallel model's DTensor
    (`Shard(-1)`), or its LM head's DTensor rows, unwrapped at the edge
    (`compiled_loss.vocab.shards`; the gradient flows back into the DTensors)."""
    return local_logits(logits, ParallelGroups(), "TrainStep")[0]


def _packed_logits(model, layout: PackedLayout, data, *, temperature, linear_logits=False, aux_layers=None):
    """Model forward on the packed `[1, T_b]` micro-batch (this TP rank's vocabulary shard),
    this CP rank's slots of it, and the drafter's `DraftBatch` (or None)."""
    positions = torch.where(layout.slot_col < layout.tokens, layout.slot_col, 0)
    ids = layout.pack(data["input_ids"])[None]
    slots = None
    if aux_layers is not None:
        real = layout.slot_col < layout.row_len[layout.slot_row]
        slots = _DraftSlots(
            documents=torch.where(real, layout.slot_row, -1)[None],
            loss_mask=layout.pack(data["token_mask"] * data["sample_mask"][:, None])[None],
            noise=layout.pack(data["anchor_noise"])[None],
        )
    logits, batch = _captured(
        model,
        ids,
        positions[None],
        layout.slot_row[None],
        layout.shards,
        aux_layers=aux_layers,
        linear_logits=linear_logits,
        slots=slots,
    )
    return (logits / temperature if temperature != 1.0 else logits), batch


def _padded_logits(model, data, *, temperature, cp, linear_logits=False, aux_layers=None):
    """Model forward on the padded `[B_b, S_b]` micro-batch (rows padded to a multiple of
    2·cp; this TP rank's vocabulary shard), this CP rank's positions of it, and the
    drafter's `DraftBatch` (or None)."""
    cp_size = group_size(cp)
    pad = -data["input_ids"].shape[1] % (2 * cp_size)
    ids = torch.nn.functional.pad(data["input_ids"], (0, pad))
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    shards = ContextShards.of_rows(*ids.shape, cp, ids.device) if cp_size > 1 else None
    slots = None
    if aux_layers is not None:  # the drafter reads whole rows (the context-parallel padding masked out)
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        slots = _DraftSlots(
            documents=torch.where(positions < data["input_lengths"][:, None], rows, -1),
            loss_mask=torch.nn.functional.pad(data["token_mask"] * data["sample_mask"][:, None], (0, pad)),
            noise=torch.nn.functional.pad(data["anchor_noise"], (0, pad)),
        )
    logits, batch = _captured(
        model,
        ids,
        positions,
        torch.zeros_like(ids),
        shards,
        aux_layers=aux_layers,
        linear_logits=linear_logits,
        slots=slots,
    )
    return (logits / temperature if temperature != 1.0 else logits), batch


@dataclasses.dataclass(frozen=True, eq=False)
class MicroBatchGraph:
    """What one micro-batch's compiled graph runs, with the step's settings as fields: the
    model forward (`logits`), the micro-batch entry point (`loss`) and the drafter's loss
    (`with_draft`). `model_and_loss` is the graph of a single-process step, `loss_and_draft`
    (or `loss`) the one of a parallel step whose model runs apart. Methods of one object,
    not nested `functools.partial`s: Dynamo's precompile cache (`TORCH_CACHING_PRECOMPILE`)
    names the function it compiles by its `__qualname__`, which a partial lacks."""

    packed: bool
    """Packed `[1, T_b]` micro-batches (`_packed_logits`), else padded rows (`_padded_logits`)."""
    temperature: float
    prepare: Preparation
    per_sequence: bool
    parallel: ParallelGroups
    linear_logits: bool = False
    draft_runtime: DraftRuntimeBase | None = None

    def logits(self, model, *layout_and_data):
        """The model forward of one micro-batch and the drafter's `DraftBatch` (or None)."""
        capture: dict[str, Any] = {"linear_logits": self.linear_logits}
        if self.draft_runtime is not None:
            capture["aux_layers"] = self.draft_runtime.aux_layers
        if self.packed:
            return _packed_logits(model, *layout_and_data, temperature=self.temperature, **capture)
        return _padded_logits(model, *layout_and_data, temperature=self.temperature, cp=self.parallel.cp, **capture)

    def loss(self, logits, *inputs):
        """The micro-batch entry point on one of the step's micro-batches: `inputs` is
        `(data, g_seqs, g_toks)` for padded rows, `(layout, data, g_seqs, g_toks)` packed."""
        *layout, data, g_seqs, g_toks = inputs
        return micro_batch_loss(
            logits,
            data,
            g_seqs,
            g_toks,
            prepare=self.prepare,
            layout=layout[0] if layout else None,
            per_sequence=self.per_sequence,
            parallel=self.parallel,
        )

    def with_draft(self, loss, metrics, batch: DraftBatch, n_slots: int):
        """The policy loss plus the drafter's (on the full vocabulary: a TP rank's teacher
        shard is all-gathered; every TP / CP rank of a replica computes the same draft loss),
        whose per-micro-batch normalisation is shared by the `n_slots` micro-batches of the step."""
        runtime, tp = self.draft_runtime, self.parallel.tp
        if group_size(tp) > 1:
            teacher = all_gather(batch.teacher_logits, tp).movedim(0, -2).flatten(-2)
            batch = dataclasses.replace(batch, teacher_logits=teacher)
        draft, draft_metrics = runtime.draft_loss(batch, n_slots)
        loss, metrics = with_draft_loss(loss, metrics, draft, runtime.loss_weight)
        return loss, {**metrics, **draft_metrics}

    def model_and_loss(self, model, *inputs, n_slots=None):
        """The model forward, the loss and the drafter's loss of one micro-batch: one compiled graph."""
        *layout_and_data, g_seqs, g_toks = inputs
        logits, batch = self.logits(model, *layout_and_data)
        loss, metrics = self.loss(logits, *layout_and_data, g_seqs, g_toks)
        return (loss, metrics) if self.draft_runtime is None else self.with_draft(loss, metrics, batch, n_slots)

    def loss_and_draft(self, logits, batch, *inputs, n_slots):
        """The loss and the drafter's loss of one micro-batch, the model having run apart."""
        loss, metrics = self.loss(logits, *inputs)
        return self.with_draft(loss, metrics, batch, n_slots)


def split_rows(rows: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """Contiguous row ranges of `parts` near-equal micro-batches, cut at multiples of `unit`."""
    units = rows // unit
    bounds = [round(i * units / parts) * unit for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def packed_boundaries(lengths: list[int], multiple: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`cu_seqlens` and `cu_seqlens_padded` (each length rounded up to `multiple`)."""
    cu, cu_padded = [0], [0]
    for length in lengths:
        cu.append(cu[-1] + length)
        cu_padded.append(cu_padded[-1] + -(-length // multiple) * multiple)
    return tuple(cu), tuple(cu_padded)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """What a training step needs besides the model, the optimizer, the loss and the process
    groups (the run config's keys in parentheses; `StepOptions.of` reads them)."""

    packing: PackingMode = PackingMode.fused
    """How micro-batches are laid out and prepared (`packing.mode`): padded rows, or packed
    with per-sequence or fused input preparation."""
    grid: BucketGrid = BucketGrid()
    """The bucket grid of the compiled shapes (`packing.tokens` / `.rows` / `.width` / `.per_octave`)."""
    pad_to_multiple: int = 1
    """Packed sequences are padded to a multiple of it (`packing.pad_to_multiple`)."""
    sampling_params: TrainingSamplingParams | None = None
    """The generation-time top-k / top-p filter of log-prob inputs (`logprob.top_k`, `.top_p`)."""
    chunk_size: int | None = None
    """Rows per chunk of the eager vocab primitive (`logprob.chunk_size`)."""
    temperature: float = 1.0
    """The logits are divided by it before the loss (`logprob.temperature`)."""
    linear_logits: bool = False
    """The model returns `LinearLogits` (`logprob.fused_linear`)."""
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    """Whether and how the step compiles (`compile`)."""
    micro_batches: int = 1
    """Micro-batches per optimizer step (`run.micro_batches`)."""
    validate_inputs: bool = True
    """Check every batch on the host first (`run.validate_inputs`)."""
    vocab_size: int | None = None
    """Token ids are checked against it (`model.vocab_size`)."""
    grad_clip: float | None = None
    """Gradient-norm clip of the policy and, on its own, of the drafter (`optim.grad_clip`)."""
    max_rows: int | None = None
    """The most rows of one micro-batch; with `max_length`, the grid's bucket bound
    (`BucketGrid.bound`) is checked against `compile.max_buckets` when the step is built."""
    max_length: int | None = None
    """The longest row of a batch (`DataConfig.max_length`)."""

    @staticmethod
    def of(cfg: Config) -> StepOptions:
        """The options a run config describes."""
        packing, logprob = cfg.packing, cfg.logprob
        return StepOptions(
            packing=packing.mode,
            grid=packing.grid(),
            pad_to_multiple=packing.pad_to_multiple,
            sampling_params=logprob.sampling_params(),
            chunk_size=logprob.chunk_size,
            temperature=logprob.temperature,
            linear_logits=logprob.fused_linear,
            compile=cfg.compile,
            micro_batches=cfg.run.micro_batches,
            validate_inputs=cfg.run.validate_inputs,
            vocab_size=cfg.model.vocab_size,
            grad_clip=cfg.optim.grad_clip,
            max_rows=cfg.longest_micro_batch()[0],
            max_length=cfg.data.max_length(),
        )


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, float]
    tokens: int  # real tokens trained on
    slots: int  # tokens the model ran on, padding included
    seconds: float


class TrainStep:
    """One optimizer step over a global batch; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFunction,
        options: StepOptions = StepOptions(),
        groups: ParallelGroups = ParallelGroups(),
        draft_runtime: DraftRuntimeBase | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn, self.options = model, optimizer, loss_fn, options
        self.groups, self.draft_runtime, self.global_batch = groups, draft_runtime, -1
        spec = InputSpec.of(loss_fn)
        self.loss_scale = gradient_scale(groups.sizes)
        self.pairs = spec.pairs
        self.buckets: set[tuple[int, ...]] = set()
        self._check_bucket_bound()
        graph = MicroBatchGraph(
            packed=options.packing != PackingMode.none,
            temperature=options.temperature,
            prepare=Preparation(loss_fn, spec, PrepareOptions(groups, options.sampling_params, options.chunk_size)),
            per_sequence=options.packing == PackingMode.per_sequence,
            parallel=groups,
            linear_logits=options.linear_logits,
            draft_runtime=draft_runtime,
        )
        self._logits = graph.logits
        # Parallel runs shard the model with FSDP2 (`shard_model`), whose hooks do not trace:
        # the model runs eagerly around its compiled decoder layers, and the loss compiles alone
        self._model_outside = groups.rank_count > 1
        if self._model_outside and not isinstance(model, FSDPModule):
            raise ValueError(
                f"TrainStep: a run of {groups.rank_count} processes trains a model sharded with FSDP2 "
                "(compiled_loss.train.shard_model(model, groups), or your own fully_shard), got an unsharded "
                f"{type(model).__name__}"
            )
        fn: Callable[..., Any]
        if not self._model_outside:
            fn = graph.model_and_loss
        else:
            fn = graph.loss if draft_runtime is None else graph.loss_and_draft
        c = options.compile
        self.recorder = CompileRecorder(c.backend, "train step", c.mode) if c.enabled else None
        # one graph per bucket: Dynamo's recompile limit covers compile.max_buckets, which the
        # step holds its distinct buckets to (`_admit`)
        kwargs = dict(fullgraph=c.fullgraph, dynamic=c.dynamic, recompile_limit=c.max_buckets)
        if self.recorder is not None:
            fn = compile_loss(fn, recorder=self.recorder, **kwargs)
        self._compiled = fn

    def _check_bucket_bound(self) -> None:
        """With `max_rows` and `max_length` known, the grid's bucket bound against `compile.max_buckets`."""
        o = self.options
        if not o.compile.enabled or o.max_rows is None or o.max_length is None:
            return
        packed = o.packing != PackingMode.none
        bound = o.grid.bound(o.max_rows, o.max_length, packed=packed, pad_to_multiple=o.pad_to_multiple)
        bound *= o.micro_batches if self.draft_runtime is not None else 1
        if bound > o.compile.max_buckets:
            raise ValueError(
                f"TrainStep: the bucket grid {o.grid} puts micro-batches of up to {o.max_rows} rows of up to "
                f"{o.max_length} tokens into up to {bound} distinct shape buckets, more than "
                f"compile.max_buckets={o.compile.max_buckets} (one compile each): coarsen the grid or raise it"
            )

    def _admit(self, bucket: tuple[int, ...]) -> None:
        """Record a micro-batch's bucket; refused before it compiles when it would be one more
        distinct bucket than `compile.max_buckets`."""
        if self.options.compile.enabled:
            admit_bucket(self.buckets, bucket, self.options.compile.max_buckets, "TrainStep", "compile.max_buckets")
        else:
            self.buckets.add(bucket)

    @property
    def compiles(self) -> int:
        """Compiles of the step's graph (of the loss alone when the model is compiled apart)."""
        return self.recorder.report.compiles if self.recorder else 0

    def compile_problems(self) -> list[str]:
        """Graph breaks, in-graph host syncs and eager fallbacks of the step's compiled graph."""
        return self.recorder.report.problems() if self.recorder is not None else []

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, batch: Mapping[str, Tensor]) -> StepResult:
        start = time.perf_counter()
        device = self._device()
        batch = {k: v.to(device) for k, v in batch.items()}
        lengths, ranges = self._split(batch)
        sample_mask = batch["sample_mask"]
        # the global normalisers: this replica's counts summed over the DP group (ref §1.3)
        local_toks = (batch["token_mask"][:, 1:] * sample_mask[:, None]).sum()
        counts = all_reduce_host(torch.stack([sample_mask.sum(), local_toks]), self.groups.dp)
        g_seqs, g_toks = counts[0], counts[1]
        full_width = batch["input_ids"].shape[1]
        parts, slots = [], 0
        self.global_batch += 1
        self.optimizer.zero_grad(set_to_none=True)
        for i, (a, b) in enumerate(ranges):
            width = max(lengths[a:b])  # trim each micro-batch to its own longest row
            micro = {  # contiguous: a view's strides follow the batch's width, and compiled code guards on them
                k: (v[a:b, :width] if v.dim() >= 2 and v.shape[1] == full_width else v[a:b]).contiguous()
                for k, v in batch.items()
            }
            if self.draft_runtime is not None:  # the drafter's per-token anchor noise, drawn on the host
                micro["input_lengths"] = torch.tensor(lengths[a:b], device=device)
                seed = anchor_seed(self.groups.dp_rank, self.global_batch, i)
                micro["anchor_noise"] = anchor_noise((b - a, width), seed, device)
            loss, metrics, micro_slots = self._micro_step(micro, lengths[a:b], g_seqs, g_toks, len(ranges), device)
            (loss * self.loss_scale).backward()
            parts.append(metrics)
            slots += micro_slots
        step_wide = self._optimizer_step()
        step_wide.update(global_valid_seqs=g_seqs, global_valid_toks=g_toks)  # the same on every rank
        # every replica's micro-batch fragments, combined as one list (a mean counts each fragment)
        metrics = with_ratios(combine_over([metrics_to_python(p) for p in parts], self.groups.dp))
        metrics.update(metrics_to_python(step_wide))
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        tokens, slots = (int(n) for n in all_reduce_host(torch.tensor([sum(lengths), slots]), self.groups.dp))
        return StepResult(metrics, tokens, slots, time.perf_counter() - start)

    def _split(self, batch: dict[str, Tensor]) -> tuple[list[int], list[tuple[int, int]]]:
        """The batch checked and its `input_lengths` taken out (host ints: boundaries are
        Python ints), with the row ranges of its micro-batches; every rank agrees on both."""
        if "input_lengths" not in batch:
            raise ValueError(f"batch must hold 'input_lengths' ([B] sequence lengths); present: {sorted(batch)}")
        if self.options.validate_inputs:
            validate_batch(batch, vocab_size=self.options.vocab_size)
        lengths = batch.pop("input_lengths").tolist()  # host: boundaries are Python ints
        if self.pairs and len(lengths) % 2:
            raise ValueError(
                f"{type(self.loss_fn).__name__} reads (chosen, rejected) row pairs; the batch has an odd number "
                f"of rows ({len(lengths)})"
            )
        if not lengths:
            raise ValueError("the batch has no rows (input_lengths is empty)")
        # a batch of fewer rows (pairs) than run.micro_batches runs fewer micro-batches
        ranges = split_rows(len(lengths), self.options.micro_batches, 2 if self.pairs else 1)
        # every rank runs a collective per micro-batch (FSDP2's gradient reduction, the
        # wrappers' TP / CP collectives), and the TP / CP ranks of a replica read the same rows
        check_agreement(
            "the number of micro-batches (rows of the batch split over run.micro_batches)",
            len(ranges),
            self.groups.tp,
            self.groups.cp,
            self.groups.dp,
        )
        check_agreement(
            "the batch's input_lengths (the tensor / context parallel ranks of a data-parallel replica "
            "read the same rows)",
            lengths,
            self.groups.tp,
            self.groups.cp,
        )
        return lengths, ranges

    def _optimizer_step(self) -> dict[str, Tensor]:
        """The drafter's gradients synchronised where it lives outside the model, the
        gradients clipped (the drafter's on their own) and the optimizer stepped; the grad
        norms."""
        if self.draft_runtime is not None and self._model_outside:
            self._sync_drafter_grads()
        step_wide: dict[str, Tensor] = {}
        clip = self.options.grad_clip
        if clip is not None:
            step_wide["grad_norm"] = clip_grad_norm(self.model.parameters(), clip)
            if self.draft_runtime is not None:
                step_wide["draft_grad_norm"] = torch.nn.utils.clip_grad_norm_(self.draft_runtime.parameters(), clip)
        self.optimizer.step()
        return step_wide

    @torch.no_grad()
    def _sync_drafter_grads(self) -> None:
        """The drafter is replicated on every rank outside FSDP: each TP / CP rank of a replica
        holds `loss_scale ×` its replica's gradient, so the sum over all ranks divided by
        `loss_scale · tp · cp` is the sum over the replicas — the single-process gradient."""
        tp, cp, _ = self.groups.sizes
        grads = [p.grad for p in self.draft_runtime.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.loss_scale * tp * cp
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _micro_step(self, micro, lengths, g_seqs, g_toks, n_micro, device):
        rows, grid = len(lengths), self.options.grid
        num_rows = round_to_bucket(rows, grid.rows, grid.per_octave)
        # with a drafter the micro-batch count is a constant of the graph, so part of its bucket
        count = (n_micro,) if self.draft_runtime is not None else ()
        if self.options.packing == PackingMode.none:
            data = pad_to_bucket(micro, rows, num_rows, grid)
            shape = tuple(data["input_ids"].shape)
            self._admit(shape + count)
            return (*self._run(data, g_seqs=g_seqs, g_toks=g_toks, n_micro=n_micro), shape[0] * shape[1])
        cu, cu_padded = packed_boundaries(lengths, self.options.pad_to_multiple)
        layout = PackedLayout.build(cu, cu_padded, grid=grid, device=device, parallel=self.groups)
        data = layout.pad_data(micro)
        self._admit((layout.tokens,) + tuple(data["input_ids"].shape) + count)
        return (*self._run(layout, data, g_seqs=g_seqs, g_toks=g_toks, n_micro=n_micro), layout.tokens)

    def _run(self, *inputs, g_seqs, g_toks, n_micro):
        # the drafter's loss is shared by the micro-batches that run (a compile per distinct count)
        draft = {} if self.draft_runtime is None else {"n_slots": n_micro}
        if self._model_outside:
            logits, batch = self._logits(self.model, *inputs)
            if batch is not None:
                return self._compiled(logits, batch, *inputs, g_seqs, g_toks, **draft)
            return self._compiled(logits, *inputs, g_seqs, g_toks)
        return self._compiled(self.model, *inputs, g_seqs, g_toks, **draft)


def build_train_step(
    cfg: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: ParallelGroups = ParallelGroups(),
    draft_runtime: DraftRuntimeBase | None = None,
    loss_fn: LossFunction | None = None,
) -> TrainStep:
    """The compiled training step a config describes (see the module docstring); with a
    `draft_runtime`, the drafter trains in the same graph on the policy's outputs at its
    `aux_layers` (the optimizer must hold the drafter's parameters too). `loss_fn`: the loss
    object, for losses whose construction needs more than their config (default: the one
    the config built, `cfg.loss_fn`)."""
    loss_fn = cfg.loss_fn if loss_fn is None else loss_fn
    return TrainStep(model, optimizer, loss_fn, StepOptions.of(cfg), groups, draft_runtime)
