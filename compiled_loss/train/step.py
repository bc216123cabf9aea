"""The compiled training step: `build_train_step(cfg, model, optimizer)`.

Per global batch (host side): check the batch (`validate_batch`, unless
`run.validate_inputs=false`; token ids against `model.vocab_size`), compute the global
normalisers `global_valid_seqs` /
`global_valid_toks`, split the rows into `run.micro_batches` micro-batches (keeping DPO
pairs together), and for each build the bucketed layout (`PackedLayout`, or bucketed
padding for `packing=none`) on the host. Then, per micro-batch, ONE compiled function runs
the model forward and the loss wrapper; its backward accumulates gradients. Finally the
optimizer steps and the metrics are combined through the registry (sums, min, max) and
converted to Python floats once.

Use it with your own model: any `torch.nn.Module` whose
`forward(input_ids, position_ids, segment_ids) -> logits` attends causally within a
segment — `[B, S]` inputs for `packing=none` (one segment per row), `[1, T]` for the
packed modes (segment = packed sequence, positions restarting at 0 in each). Batches are
dicts of `[B, S]` tensors with the loss's keys plus `input_lengths` `[B]`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiled_loss.config import Config, PackingMode, build_loss
from compiled_loss.inputs import prepare_loss_input, prepare_packed_loss_input, validate_batch
from compiled_loss.metrics import combine_metrics, metrics_to_python
from compiled_loss.packing import (
    PackedLayout,
    pad_to_bucket,
    round_to_bucket,
    sequence_packing_loss,
    wrap_loss_fn_with_input_preparation,
)
from compiled_loss.train.compile import compile_loss
from compiled_loss.train.recorder import CompileRecorder

Tensor = torch.Tensor


def _packed_forward_loss(model, layout: PackedLayout, data, g_seqs, g_toks, *, loss_fn, prepare_fn, fused, temperature):
    """Model forward on the packed `[1, T_b]` micro-batch, then the packing loss wrapper."""
    positions = torch.where(layout.slot_col < layout.tokens, layout.slot_col, 0)
    logits = model(layout.pack(data["input_ids"])[None], positions[None], layout.slot_row[None])
    if temperature != 1.0:
        logits = logits / temperature
    return sequence_packing_loss(
        logits, data, g_seqs, g_toks, loss_fn=loss_fn, prepare_fn=prepare_fn, layout=layout, fused=fused
    )


def _padded_forward_loss(model, data, g_seqs, g_toks, *, loss_fn, prepare_fn, temperature):
    """Model forward on the padded `[B_b, S_b]` micro-batch, then the unpacked loss."""
    ids = data["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = model(ids, positions, torch.zeros_like(ids))
    if temperature != 1.0:
        logits = logits / temperature
    return wrap_loss_fn_with_input_preparation(
        logits, data, g_seqs, g_toks, loss_fn=loss_fn, prepare_fn=prepare_fn
    )


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


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, float]
    tokens: int  # real tokens trained on
    slots: int  # tokens the model ran on, padding included
    seconds: float


class TrainStep:
    """One optimizer step over a global batch; see the module docstring."""

    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.loss_fn = build_loss(cfg.loss)
        self.pairs = getattr(self.loss_fn, "rows_are_pairs", False)
        self.buckets: set[tuple[int, ...]] = set()
        packing = cfg.packing
        self.grid = packing.grid()
        lp = cfg.logprob
        prepare_kwargs = dict(sampling_params=lp.sampling_params(), chunk_size=lp.chunk_size)
        if packing.mode == PackingMode.none:
            fn: Callable[..., Any] = functools.partial(
                _padded_forward_loss, loss_fn=self.loss_fn, temperature=lp.temperature,
                prepare_fn=functools.partial(prepare_loss_input, **prepare_kwargs),
            )
        else:
            fused = packing.mode == PackingMode.fused
            base = prepare_packed_loss_input if fused else prepare_loss_input
            fn = functools.partial(
                _packed_forward_loss, loss_fn=self.loss_fn, temperature=lp.temperature,
                prepare_fn=functools.partial(base, **prepare_kwargs), fused=fused,
            )
        self.recorder: CompileRecorder | None = None
        if cfg.compile.enabled:
            self.recorder = CompileRecorder(cfg.compile.backend, "train step", cfg.compile.mode)
            fn = compile_loss(fn, recorder=self.recorder, fullgraph=cfg.compile.fullgraph, dynamic=cfg.compile.dynamic)
        self._forward_loss = fn

    @property
    def compiles(self) -> int:
        return self.recorder.report.compiles if self.recorder else 0

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, batch: Mapping[str, Tensor]) -> StepResult:
        start = time.perf_counter()
        device = self._device()
        batch = {k: v.to(device) for k, v in batch.items()}
        if "input_lengths" not in batch:
            raise ValueError(f"batch must hold 'input_lengths' ([B] sequence lengths); present: {sorted(batch)}")
        if self.cfg.run.validate_inputs:
            validate_batch(batch, vocab_size=self.cfg.model.vocab_size)
        lengths = batch.pop("input_lengths").tolist()  # host: boundaries are Python ints
        if self.pairs and len(lengths) % 2:
            raise ValueError(
                f"{type(self.loss_fn).__name__} reads (chosen, rejected) row pairs; the batch has an odd number "
                f"of rows ({len(lengths)})"
            )
        sample_mask = batch["sample_mask"]
        g_seqs = sample_mask.sum()
        g_toks = (batch["token_mask"][:, 1:] * sample_mask[:, None]).sum()
        full_width = batch["input_ids"].shape[1]
        parts, slots = [], 0
        self.optimizer.zero_grad(set_to_none=True)
        for a, b in split_rows(len(lengths), self.cfg.run.micro_batches, 2 if self.pairs else 1):
            width = max(lengths[a:b])  # trim each micro-batch to its own longest row
            micro = {
                k: v[a:b, :width] if v.dim() >= 2 and v.shape[1] == full_width else v[a:b]
                for k, v in batch.items()
            }
            loss, metrics, micro_slots = self._micro_step(micro, lengths[a:b], g_seqs, g_toks, device)
            loss.backward()
            parts.append(metrics)
            slots += micro_slots
        grad_norm = None
        if self.cfg.optim.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        combined = combine_metrics(parts)
        combined["global_valid_seqs"] = g_seqs
        combined["global_valid_toks"] = g_toks
        if grad_norm is not None:
            combined["grad_norm"] = grad_norm
        metrics = metrics_to_python(combined)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return StepResult(metrics, sum(lengths), slots, time.perf_counter() - start)

    def _micro_step(self, micro, lengths, g_seqs, g_toks, device):
        rows = len(lengths)
        num_rows = round_to_bucket(rows, self.grid.rows, self.grid.per_octave)
        if self.cfg.packing.mode == PackingMode.none:
            data = pad_to_bucket(micro, rows, num_rows, self.grid)
            shape = tuple(data["input_ids"].shape)
            self.buckets.add(shape)
            return (*self._forward_loss(self.model, data, g_seqs, g_toks), shape[0] * shape[1])
        cu, cu_padded = packed_boundaries(lengths, self.cfg.packing.pad_to_multiple)
        layout = PackedLayout.build(cu, cu_padded, grid=self.grid, device=device)
        data = layout.pad_data(micro)
        self.buckets.add((layout.tokens,) + tuple(data["input_ids"].shape))
        return (*self._forward_loss(self.model, layout, data, g_seqs, g_toks), layout.tokens)


def build_train_step(cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainStep:
    """The compiled training step a config describes (see the module docstring)."""
    return TrainStep(cfg, model, optimizer)
