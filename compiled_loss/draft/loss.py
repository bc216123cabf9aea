"""Draft losses next to the policy loss, as functions (the seed's `DraftLossWrapper` and
`DraftRuntimeLossWrapper` are frozen partial applications of these, see
`compiled_loss.nemo_rl.wrapper`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from compiled_loss.inputs.draft import draft_input
from compiled_loss.inputs.options import PrepareOptions
from compiled_loss.interfaces import InputSpec, LossFunction
from compiled_loss.losses.common import require_keys
from compiled_loss.losses.draft_ce import DraftLossStats
from compiled_loss.packing import PackedLayout, PackedView, Prepare, row_width
from compiled_loss.parallel import ParallelGroups
from compiled_loss.parallel.collectives import all_reduce_sum, sum_context_parallel
from compiled_loss.vocab import LinearLogits, per_position

Tensor = torch.Tensor


def draft_soft_ce(
    next_token_logits: Tensor,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor,
    *,
    prepare: Prepare,
    parallel: ParallelGroups = ParallelGroups(),
    defer_normalization: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Unpacked `[B, S, V]`: `prepare` (of the draft loss `prepare.loss_fn`, DRAFT inputs with
    the `d2t` map) builds the shifted teacher and mask; the draft soft-CE is normalised by the
    POLICY's G_t (ref §7.4), or — `defer_normalization` — left as a raw sum with its numerator
    and count reported. Under context parallelism (`parallel.cp`) each rank's share is summed
    over the CP ranks."""
    draft_loss_fn = prepare.loss_fn
    loss_input, draft_data, _ = prepare(next_token_logits, data, None, parallel)  # DRAFT inputs carry no gradient
    cp = parallel.cp
    if not defer_normalization:
        draft = draft_loss_fn(
            data=draft_data,
            global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks,
            **loss_input,
        )
        return sum_context_parallel(draft, cp), {}
    stats = draft_loss_fn.loss_stats(data=draft_data, **loss_input)
    stats = DraftLossStats(
        sum_context_parallel(stats.numerators, cp), sum_context_parallel(stats.counts, cp), stats.weights
    )
    payload = DraftStepState.metric_payload(stats)
    return stats.normalized(torch.ones_like(stats.counts)), {"_draft_step_payload": payload}


@dataclasses.dataclass(frozen=True)
class DraftStepState:
    """A deferred draft loss's raw statistics (ref §7.4 `defer_normalization`): detached
    per-bin numerators, counts and weights. `DraftLossWrapper(defer_normalization=True)`
    puts one under `metrics["_draft_step_payload"]`; `combine_metrics` sums them over the
    micro-batches of a step (`+`), and `correct_grads` then renormalises the drafter's
    gradients by its own token count."""

    numerators: Tensor
    counts: Tensor
    weights: Tensor

    @classmethod
    def metric_payload(cls, stats: DraftLossStats) -> DraftStepState:
        return cls(stats.numerators.detach(), stats.counts.detach().float(), stats.weights.detach().float())

    def __add__(self, other: DraftStepState) -> DraftStepState:
        if not isinstance(other, DraftStepState) or other.counts.shape != self.counts.shape:
            raise ValueError(
                f"DraftStepState: can only add a DraftStepState of {tuple(self.counts.shape)} bins, got {other!r}"
            )
        return DraftStepState(self.numerators + other.numerators, self.counts + other.counts, self.weights)

    def draft_count(self, group: ProcessGroup | None = None) -> Tensor:
        """`Σ counts·weights`, the counts summed over `group` (the data- / context-parallel
        ranks that share the drafter)."""
        return (all_reduce_sum(self.counts, group) * self.weights).sum()

    @torch.no_grad()
    def correct_grads(
        self, parameters: Iterable[torch.nn.Parameter], policy_count: float | Tensor, group: ProcessGroup | None = None
    ) -> Tensor:
        """Multiply the drafter's gradients by `policy_count / draft_count` (ref §7.4
        `correct_main_grads`), where `policy_count` is the count the step's gradients are
        already divided by (1 with a policy loss normalised by `global_valid_toks`, as
        compiled_loss's are): the draft loss, which entered as a raw sum, becomes a mean
        over its own tokens. Returns the factor; with no draft token it is 0."""
        count = self.draft_count(group)
        factor = torch.where(count > 0, torch.as_tensor(policy_count, dtype=torch.float32) / count.clamp(min=1e-8), 0.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))
        return factor


def packed_draft_soft_ce(
    next_token_logits: Tensor | LinearLogits,
    data: Mapping[str, Tensor],
    global_valid_seqs: Tensor | None,
    global_valid_toks: Tensor,
    *,
    draft_loss_fn: LossFunction,
    layout: PackedLayout,
    student_logits: Tensor,
    options: PrepareOptions,
) -> Tensor:
    """Packed `[1, T, V]`: ONE soft-CE over the packed slots — the DRAFT preparer on the
    packed view: the teacher shifted left by one within each segment and mapped to the draft
    vocabulary, the mask `token_mask · sample_mask` packed and shifted the same way (ref §7.4
    `_packed_draft_loss`). Under context parallelism over this rank's slots (the shift
    crossing ranks), summed over the CP ranks; the vocabulary sharded over `options.parallel.tp`,
    mapped to the draft vocabulary by `options.d2t`."""
    require_keys(data, ("token_mask", "sample_mask"), "DraftLossWrapper (packed)")
    layout = layout.on(next_token_logits.device)
    logits = per_position(next_token_logits, lambda x: layout.slots(x, "next_token_logits")[None])
    data = layout.pad_data(data)
    packed_data = {
        "token_mask": data["token_mask"] * data["sample_mask"][:, None],
        "student_logits": layout.slots(student_logits, "student_logits")[None],
    }
    spec = InputSpec.of(draft_loss_fn)
    options = dataclasses.replace(options, parallel=ParallelGroups(tp=options.parallel.tp))  # the layout shards CP
    inputs, _ = draft_input(PackedView(layout, row_width(data)), logits, packed_data, spec, options)
    draft = draft_loss_fn(
        **inputs,
        data={"sample_mask": inputs["token_mask"].new_ones(1)},
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
    )
    return sum_context_parallel(draft, layout.shards.group if layout.shards is not None else None)


def with_draft_loss(
    policy_loss: Tensor,
    metrics: Mapping[str, Any],
    draft_loss: Tensor,
    loss_weight: float,
    *,
    report_total: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """`policy_loss + loss_weight · draft_loss`, with `draft_loss` (always, even at weight 0)
    and `total_loss` (of the policy loss received, not of a metric) in the metrics."""
    metrics = dict(metrics)
    metrics["draft_loss"] = draft_loss.detach()
    if report_total:
        metrics["total_loss"] = policy_loss.detach() + loss_weight * draft_loss.detach()
    return policy_loss + loss_weight * draft_loss, metrics
