"""Generation-time sampling filters (ref §3.2–3.3): the parameters, the per-row keep
threshold for top-k / top-p, and the masking of filtered log-probs.

The threshold needs a sort of each row, which no fused kernel provides; it is an opaque
custom op that works in row chunks in eager and compiled code alike, so its fp32 working
set stays `chunk × V` (no full fp32 `[T, V]` copy of the logits, sorted or not). Under
tensor parallelism the op all-gathers one row chunk at a time to full rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group

from compiled_loss.checks import check_fields, require
from compiled_loss.parallel import check_agreement, group_size
from compiled_loss.vocab.stats import check_chunk_size, row_chunks

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class TrainingSamplingParams:
    """Sampling filter used at generation time (ref §3.3)."""

    top_k: int | None = None
    """Keep the `top_k` largest logits of each row; None or <= 0 disables (vLLM's -1)."""
    top_p: float | None = 1.0
    """Nucleus mass in (0, 1]; 1.0 disables."""
    temperature: float = 1.0
    """Logits are divided by it before the loss (by the caller, as in NeMo-RL); > 0."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.top_p is None or 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.temperature > 0, f"temperature must be finite and > 0, got {self.temperature}")


def need_top_k_or_top_p_filtering(sampling_params: TrainingSamplingParams | None) -> bool:
    if sampling_params is None:
        return False
    top_k, top_p = sampling_params.top_k, sampling_params.top_p
    return (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0)


def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor, name: str = "logprobs") -> Tensor:
    """Zero `±inf` log-probs (filtered tokens) and everything outside `mask` (ref §3.2).

    The reference also prints how many infinities fall inside the mask; that count needs a
    host sync, so it is not printed here.
    """
    return torch.where((mask > 0) & ~torch.isinf(logprobs), logprobs, 0.0)


def _row_thresholds(x: Tensor, top_k: int, top_p: float) -> Tensor:
    """Thresholds of full-vocabulary fp32 rows `x [c, V]` (see `sampling_threshold`)."""
    vocab = x.shape[-1]
    use_k = 0 < top_k < vocab
    if top_p == 1.0:
        return torch.topk(x, top_k, -1).values[:, -1] if use_k else x.new_full(x.shape[:1], float("-inf"))
    srt = torch.sort(x, -1).values
    if use_k:
        srt = torch.where(srt >= srt[:, vocab - top_k : vocab - top_k + 1], srt, float("-inf"))
    keep = torch.cumsum(torch.softmax(srt, -1), -1) > 1 - top_p
    keep[:, -1] = True
    first_kept = (~keep).sum(-1, keepdim=True)
    return srt.gather(-1, first_kept).squeeze(-1)


@torch.library.custom_op("compiled_loss::sampling_threshold", mutates_args=())
def _sampling_threshold(logits: Tensor, top_k: int, top_p: float, chunk_size: int, group_name: str) -> Tensor:
    """`group_name` empty: `logits` are full rows. Else this rank's vocabulary shard: each row
    chunk is all-gathered to full rows (every rank computes every threshold)."""
    group = _resolve_process_group(cast("GroupName", group_name)) if group_name else None
    n, vocab = logits.shape
    shards = group.size() if group is not None else 1
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for s, e in row_chunks(n, vocab * shards, chunk_size or None):
        x = logits[s:e].float()
        if group is not None:
            pieces = [torch.empty_like(x) for _ in range(shards)]
            dist.all_gather(pieces, x.contiguous(), group=group)
            x = torch.cat(pieces, -1)
        out[s:e] = _row_thresholds(x, top_k, top_p)
    return out


@_sampling_threshold.register_fake
def _(logits: Tensor, top_k: int, top_p: float, chunk_size: int, group_name: str) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def sampling_threshold(
    logits: Tensor,
    top_k: int | None,
    top_p: float | None,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Per-row keep threshold for top-k / top-p filtering (ref §3.3), fp32 `[N]`, no gradient.

    A token is kept iff its logit is `>= threshold`. top-k keeps values >= the k-th
    largest (ties kept, as the reference does); top-p sorts ascending, applies the top-k
    mask, keeps the suffix whose cumulative probability exceeds `1 - top_p` and always
    the largest value. The kept set is expressed as a value threshold, so ties at the
    nucleus boundary are all kept. Rows are processed `chunk_size` at a time (default:
    ~4 MiB of fp32 per chunk), compiled or not. With a tensor-parallel `group`, `logits`
    is this rank's vocabulary shard and the thresholds are the full vocabulary's; an eager
    call first checks that every rank holds an equally wide shard of as many rows (a
    ValueError on every rank otherwise).
    """
    check_chunk_size(chunk_size)
    check_agreement(
        "sampling_threshold's inputs (each rank's logits are its vocabulary shard [N, V / tp]: equally wide, with the "
        "same rows, dtype and filter on every rank)",
        {"logits": logits, "top_k": top_k, "top_p": top_p, "chunk_size": chunk_size},
        group,
    )
    return _thresholds(logits, top_k, top_p, chunk_size, group)


def _thresholds(
    logits: Tensor,
    top_k: int | None,
    top_p: float | None,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
) -> Tensor:
    """`sampling_threshold` of inputs already checked (by `vocab_reduce`)."""
    k = top_k if top_k is not None and top_k > 0 else 0
    p = 1.0 if top_p is None else float(top_p)
    name = group.group_name if group is not None and group_size(group) > 1 else ""
    return _sampling_threshold(logits.detach(), k, p, chunk_size or 0, name)
