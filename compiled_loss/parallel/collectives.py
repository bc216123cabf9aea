"""Traceable collectives (torch.distributed's functional collectives, so compiled code
keeps one graph), each with the backward the reference specifies. With `group=None` or a
single-rank group every function is the identity of the single-process computation.

- `all_reduce_max`: no gradient (used on detached maxima).
- `all_reduce_sum`: identity backward — for a sum whose result every rank consumes
  identically (a replicated loss): each rank's input gets the gradient of the result.
- `all_gather`: rank-major concatenation along dim 0, no gradient.
- `gather_context_parallel`: all-gather whose backward is a SUM all-reduce followed by this
  rank's block (ref §8.11 `AllGatherCPTensor`): with a loss replicated on every CP rank the
  gradient reaching each rank's shard is `cp ×` the single-process one, which the trainer
  divides away (`loss / cp`, ref §10).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc

from compiled_loss.parallel.groups import group_rank, group_size

Tensor = torch.Tensor

# All-gather along dim 0: torch 2.13 names it all_gather_single (all_gather_tensor warns there);
# torch 2.11 and 2.12 have only all_gather_tensor, the same collective.
_all_gather_dim0 = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor


def _active(group) -> bool:
    return group is not None and group_size(group) > 1


def all_reduce_max(x: Tensor, group) -> Tensor:
    """Elementwise max over the group's ranks (no gradient)."""
    return fc.wait_tensor(fc.all_reduce(x.detach(), "max", group)) if _active(group) else x


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return fc.wait_tensor(fc.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """Elementwise sum over the group's ranks; the backward is the identity."""
    return _AllReduceSum.apply(x, group) if _active(group) else x


def all_gather(x: Tensor, group) -> Tensor:
    """`[world, *x.shape]`: every rank's `x`, in rank order (no gradient)."""
    if not _active(group):
        return x.detach()[None]
    return fc.wait_tensor(_all_gather_dim0(x.detach()[None].contiguous(), 0, group))


class _GatherContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, group_rank(group)
        return fc.wait_tensor(_all_gather_dim0(x[None].contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad):
        summed = fc.wait_tensor(fc.all_reduce(grad.contiguous(), "sum", ctx.group))
        return summed[ctx.rank], None


def gather_context_parallel(x: Tensor, group) -> Tensor:
    """`[cp, *x.shape]`: every CP rank's `x`; backward: SUM all-reduce, then this rank's block."""
    return _GatherContextParallel.apply(x, group) if _active(group) else x[None]


def sum_context_parallel(x: Tensor, group) -> Tensor:
    """The sum of every CP rank's partial `x`, under the same gradient convention as
    `gather_context_parallel` (each rank's partial gets `cp ×` the gradient)."""
    return gather_context_parallel(x, group).sum(0)
