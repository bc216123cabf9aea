"""torchtitan's losses (torchtitan 0.3.0: `torchtitan.components.loss.CrossEntropyLoss` and
the RL experiment's `torchtitan.experiments.rl.losses` `DAPOLoss` and `GRPOLoss`) in
torchtitan's `BaseLoss` shape, computed by compiled_loss:

    loss, metrics = loss_fn(pred, labels, global_valid_tokens, **kwargs)

- `pred`: the logits, `[T, V]` or `[B, T, V]` (any float dtype), or this rank's vocabulary
  shard `[..., V_local]` with `vocab_parallel_group`, or a DTensor with placements
  `(Shard(-1),)` on a one-dimensional mesh (unwrapped with `to_local()` at the edge, its group
  the mesh's; its gradient comes back as a DTensor of the same placement);
- `labels`: pre-shifted global token ids shaped like `pred` less its last dimension,
  `IGNORE_INDEX` (-100) left out;
- `global_valid_tokens`: the denominator (the valid tokens of every micro-batch and
  data-parallel rank): the loss is this rank's local sum divided by it, so the gradients
  summed over the data-parallel ranks and micro-batches are those of the global mean.

The vocabulary shards may be uneven (torchtitan's loss parallel gives the last rank fewer
ids): each rank's offset comes from the real local widths, all-gathered once per group and
width (host side); a narrower shard is padded to the widest with its dtype's lowest value
(one copy of that shard). Every statistic is the full vocabulary's (`vocab_reduce`: two
all-reduces of `[T]`-sized vectors), and each rank's gradient is its shard's slice of the
full one: the loss is replicated over the tensor-parallel group, never summed over it.

Compiled once per shape bucket: the tokens are padded on the host to `bucket`'s grid
(multiples of 16, at most 4 buckets per power-of-two octave; padded tokens are left out; a
count off the grid costs one copy of the logits), and the objective compiles once per
bucket (fullgraph, static shapes, at most `max_buckets` graphs; the call that would compile
one more is refused on the host, naming the bucket).
`global_valid_tokens` reaches the graph as a 0-d tensor, so a new count never recompiles.
Metrics are 0-d tensors (torchtitan's keys), computed in the graph, with no host sync.
Ids are checked to lie in the vocabulary in eager mode (`compiled=False`) only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_loss.integrations.liger import _Objective
from compiled_loss.losses import ClippedPGLossConfig, ClippedPGLossFn
from compiled_loss.packing import BucketGrid
from compiled_loss.packing.layout import round_to_bucket
from compiled_loss.parallel import group_size
from compiled_loss.vocab import vocab_reduce

Tensor = torch.Tensor

IGNORE_INDEX = -100
"""torchtitan's (and PyTorch's) ignored label."""

MAX_LOG_RATIO = 10.0
"""torchtitan's DAPO clamp of the log-ratio before `exp` (no gradient beyond it)."""

DEFAULT_BUCKET = BucketGrid(tokens=16, per_octave=4)
"""Shape buckets: token counts in multiples of 16, at most 4 per power-of-two octave."""

DAPO_METRICS = (
    "loss/mean",
    "loss/ratio_mean",
    "loss/ratio_clipped_frac",
    "bit_wise/logprob_diff/mean",
    "bit_wise/ratio_tokens_different/mean",
    "bit_wise/logprob_diff/max",
    "trainer/entropy/mean",
)
"""torchtitan's DAPO / GRPO metric keys, in its order."""

_WIDTHS: dict[tuple[int, int], tuple[int, ...]] = {}
"""(id of a tensor-parallel group, this rank's shard width) -> every rank's width, all-gathered once."""


@dataclasses.dataclass(frozen=True)
class _Shards:
    """The vocabulary layout a graph is specialised on: the group, the widest shard (every
    shard is padded to it) and each rank's first id."""

    group: Any
    width: int
    starts: tuple[int, ...]

    @property
    def even(self) -> bool:
        return all(start == rank * self.width for rank, start in enumerate(self.starts))


def _shard_widths(group: Any, width: int) -> tuple[int, ...]:
    """Every rank's shard width (an all-gather of Python ints on the host, once per group and
    width: every rank of a model calls with its own fixed width)."""
    if group_size(group) == 1:
        return (width,)
    key = (id(group), width)
    if key not in _WIDTHS:
        gathered: list[Any] = [None] * group_size(group)
        dist.all_gather_object(gathered, width, group=group)
        _WIDTHS[key] = tuple(gathered)
    return _WIDTHS[key]


def _unwrap(who: str, pred: Any, group: Any) -> tuple[Tensor, Any]:
    """`(local logits, group)`: a DTensor `(Shard(-1),)` on a 1-D mesh gives its local shard and
    its mesh's group; a plain tensor comes with `vocab_parallel_group` (or none)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(pred, DTensor):
        if not isinstance(pred, Tensor):
            raise ValueError(f"{who}: pred must be a tensor or a DTensor, got {type(pred).__name__}")
        return pred, group
    if pred.device_mesh.ndim != 1 or pred.placements != (Shard(pred.ndim - 1),):
        raise ValueError(
            f"{who}: a DTensor pred must be sharded on its vocabulary over a one-dimensional mesh, placements "
            f"(Shard(-1),); got placements {pred.placements} on a {pred.device_mesh.ndim}-dimensional mesh"
        )
    mesh_group = pred.device_mesh.get_group()
    if group is not None and group is not mesh_group:
        raise ValueError(f"{who}: vocab_parallel_group must be None or the DTensor pred's mesh group")
    return pred.to_local(), mesh_group


def _local(value: Any) -> Any:
    """A replicated DTensor input (labels, advantages, ...) as its local tensor."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _denominator(who: str, value: Any) -> Tensor | None:
    """`global_valid_tokens` as a 0-d fp32 tensor (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{who}: global_valid_tokens must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")  # fmt: skip
        return value.detach().reshape(()).float()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{who}: global_valid_tokens must be a number or a one-element tensor, got {value!r}")
    return torch.tensor(float(value))


class _TorchtitanLoss:
    """The common edge: inputs checked, unwrapped, flattened to `[N, V_local]` and padded on
    the host, then the compiled objective (`_compute`)."""

    name = ""

    def __init__(
        self,
        *,
        vocab_parallel_group: Any = None,
        compiled: bool | str | Callable[..., Any] = True,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        if not isinstance(bucket, BucketGrid):
            raise ValueError(f"{self.name}: bucket must be a BucketGrid, got {bucket!r}")
        self.vocab_parallel_group, self.bucket = vocab_parallel_group, bucket
        self.who = f"compiled_loss torchtitan {self.name}"
        self._objective = _Objective(self.who, self._compute, compiled, max_buckets)

    def _prepare(self, pred: Any, labels: Any, global_valid_tokens: Any, **tokens: Any):
        """`(logits [N', W], labels [N'], denominator, shards, padded per-token inputs)`."""
        who = self.who
        logits, group = _unwrap(who, pred, self.vocab_parallel_group)
        labels = _local(labels)
        if not logits.is_floating_point() or logits.dim() not in (2, 3):
            got = f"{str(logits.dtype).removeprefix('torch.')}{list(logits.shape)}"
            raise ValueError(f"{who}: pred must be floating-point logits [T, V] or [B, T, V], got {got}")
        if logits.shape[-1] == 0:
            raise ValueError(f"{who}: pred's vocabulary shard is empty (shape {list(logits.shape)})")
        if not isinstance(labels, Tensor) or labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{who}: labels must be an int64 or int32 tensor, got {labels!r:.80}")
        lead = tuple(logits.shape[:-1])
        if tuple(labels.shape) != lead:
            raise ValueError(f"{who}: labels must have shape {list(lead)} (pred's less its vocabulary), got "
                             f"{list(labels.shape)}")  # fmt: skip
        for name, value in tokens.items():
            value = tokens[name] = _local(value)
            if not isinstance(value, Tensor) or tuple(value.shape) != lead:
                shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"{who}: {name} must be a tensor of shape {list(lead)}, got {shape}")
        widths = _shard_widths(group, logits.shape[-1])
        starts = tuple(sum(widths[:r]) for r in range(len(widths)))
        shards = _Shards(group if len(widths) > 1 else None, max(widths), starts)
        n = labels.numel()
        rows = round_to_bucket(n, self.bucket.tokens, self.bucket.per_octave)
        flat = logits.reshape(n, logits.shape[-1])
        if shards.width != flat.shape[1]:  # a narrower shard: columns that no softmax weighs
            flat = F.pad(flat, (0, shards.width - flat.shape[1]), value=torch.finfo(flat.dtype).min)
        if rows != n:  # padded tokens, left out
            flat = F.pad(flat, (0, 0, 0, rows - n))
        labels = F.pad(labels.reshape(n).long(), (0, rows - n), value=IGNORE_INDEX)
        padded = {name: F.pad(v.reshape(n), (0, rows - n)) for name, v in tokens.items()}
        denominator = _denominator(who, global_valid_tokens)
        if denominator is not None:
            denominator = denominator.to(flat.device)
        return flat.contiguous(), labels, denominator, shards, padded

    @staticmethod
    def _logprobs(logits: Tensor, labels: Tensor, shards: _Shards, entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
        """`(log-probs [N] fp32 (0 at IGNORE_INDEX), kept [N], entropy [N] (zeros without))`
        over the full vocabulary of the shards."""
        kept = labels != IGNORE_INDEX
        ids = torch.where(kept, labels, 0)
        if not shards.even:  # global id -> its column in the shards padded to the widest
            shift = torch.zeros_like(ids)
            for rank, start in enumerate(shards.starts[1:], 1):
                shift = torch.where(ids >= start, rank * shards.width - start, shift)
            ids = ids + shift
        stats = vocab_reduce(logits, ids[:, None], entropy=entropy, group=shards.group)
        logprobs = torch.where(kept, stats.picked[:, 0] - stats.lse, 0.0)
        return logprobs, kept, -stats.negent.detach()


class CrossEntropyLoss(_TorchtitanLoss):
    """torchtitan's `CrossEntropyLoss`: `(pred, labels, global_valid_tokens=None) -> (loss, {})`,
    the cross-entropy summed over the labels other than `IGNORE_INDEX`, divided by
    `global_valid_tokens` when given (torchtitan's: no floor). Logits upcast to fp32 as
    torchtitan's; the gradient comes back in the logits' dtype."""

    name = "CrossEntropyLoss"

    def __call__(
        self, pred: Any, labels: Any, global_valid_tokens: Any = None, **kwargs: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        del kwargs  # torchtitan's BaseLoss ignores the rest
        logits, labels, denominator, shards, _ = self._prepare(pred, labels, global_valid_tokens)
        return self._objective(shards, logits, labels, denominator), {}

    def _compute(self, shards: _Shards, logits: Tensor, labels: Tensor, denominator: Tensor | None) -> Tensor:
        logprobs, _, _ = self._logprobs(logits, labels, shards, entropy=False)
        loss = -logprobs.sum()
        return loss if denominator is None else loss / denominator


class DAPOLoss(_TorchtitanLoss):
    """torchtitan's `DAPOLoss` (the RL experiment's): the per-token clipped surrogate with
    "clip-higher" bounds over the policy's log-probs of `labels`,

        loss, metrics = DAPOLoss(ratio_clip_low=0.2, ratio_clip_high=0.28)(
            pred, labels, global_valid_tokens, generator_logprobs=..., advantages=..., loss_mask=...)

    (`generator_logprobs`, `advantages`, `loss_mask` shaped like `labels`). As torchtitan: a
    token counts where `loss_mask` holds and its generator log-prob is finite; the log-ratio
    to the generator is clamped at ±10 before `exp`; the token loss is `-min(r·A, clip(r, 1 -
    low, 1 + high)·A)` (`ClippedPGLossFn.token_objective`); the loss is their sum over
    `max(global_valid_tokens, 1)` (1 without). The metrics are torchtitan's keys
    (`DAPO_METRICS`), 0-d tensors normalised for a SUM over data-parallel ranks (the max, a
    max), the entropy that of the full vocabulary."""

    name = "DAPOLoss"

    def __init__(self, *, ratio_clip_low: float = 0.2, ratio_clip_high: float = 0.2, **kwargs: Any) -> None:
        for option, value in (("ratio_clip_low", ratio_clip_low), ("ratio_clip_high", ratio_clip_high)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value:
                raise ValueError(f"{self.name}: {option} must be a number >= 0, got {value!r}")
        self.ratio_clip_low, self.ratio_clip_high = float(ratio_clip_low), float(ratio_clip_high)
        self._pg = ClippedPGLossFn(
            ClippedPGLossConfig(
                ratio_clip_min=self.ratio_clip_low,
                ratio_clip_max=self.ratio_clip_high,
                reference_policy_kl_penalty=0.0,
                metrics_level="minimal",
            )
        )
        super().__init__(**kwargs)

    def __call__(
        self,
        pred: Any,
        labels: Any,
        global_valid_tokens: Any = None,
        *,
        generator_logprobs: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        tokens = {"generator_logprobs": generator_logprobs, "advantages": advantages, "loss_mask": loss_mask}
        logits, labels, denominator, shards, padded = self._prepare(pred, labels, global_valid_tokens, **tokens)
        if denominator is None:
            denominator = torch.ones((), device=logits.device)
        padded["loss_mask"] = padded["loss_mask"] != 0
        loss, metrics = self._objective(shards, logits, labels, denominator, *padded.values())
        return loss, dict(zip(DAPO_METRICS, metrics.unbind(), strict=True))

    def _compute(self, shards, logits, labels, denominator, generator_logprobs, advantages, loss_mask):
        lp, _, entropy = self._logprobs(logits, labels, shards, entropy=True)
        mask = loss_mask & torch.isfinite(generator_logprobs)
        gen = torch.where(mask, generator_logprobs.float(), 0.0)
        adv = torch.where(mask, advantages.float(), 0.0)
        raw = torch.where(mask, lp - gen, 0.0)
        clamped = raw.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        # beyond the clamp the ratio is exp(±10) with no gradient (torchtitan's)
        lp_in = torch.where(raw == clamped, torch.where(mask, lp, 0.0), (gen + clamped).detach())
        data = {
            "token_mask": F.pad(mask.float(), (1, 0))[None],  # NeMo-RL's entry t + 1 holds token t
            "sample_mask": lp.new_ones(1),
            "advantages": F.pad(adv, (1, 0))[None],
            "prev_logprobs": F.pad(gen, (1, 0))[None],
            "generation_logprobs": F.pad(gen, (1, 0))[None],
        }
        token_loss = self._pg.token_objective(lp_in[None], data)[0]
        denominator = denominator.clamp(min=1.0)
        loss = torch.where(mask, token_loss, 0.0).sum() / denominator
        with torch.no_grad():
            ratio = torch.exp(clamped)
            clipped = ratio.clamp(1 - self.ratio_clip_low, 1 + self.ratio_clip_high)
            maskf = mask.float()
            metrics = torch.stack([
                loss.detach(),
                (ratio * maskf).sum() / denominator,
                (((ratio - clipped).abs() > 1e-6).float() * maskf).sum() / denominator,
                raw.sum() / denominator,
                ((raw.abs() > 1e-6).float() * maskf).sum() / denominator,
                raw.abs().max(),
                torch.where(mask, entropy, 0.0).sum() / denominator,
            ])  # fmt: skip
        return loss, metrics


class GRPOLoss(DAPOLoss):
    """torchtitan's `GRPOLoss`: `DAPOLoss` with one symmetric clip, `clip_eps`."""

    name = "GRPOLoss"

    def __init__(self, *, clip_eps: float = 0.2, **kwargs: Any) -> None:
        super().__init__(ratio_clip_low=clip_eps, ratio_clip_high=clip_eps, **kwargs)
