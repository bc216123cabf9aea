"""Draft loss statistics as the reference has them (ref §7.4, §7.7): multi-bin
`DraftLossStats`, the LM-head-fused projected soft-CE (also over tensor-parallel vocabulary
shards on gloo), `vocab_reduce` of `LinearLogits` against that of the logits, and the deferred
normalisation of `DraftLossWrapper` with its `DraftStepState`."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from tolerances import close

from compiled_loss.draft import DraftStepState
from compiled_loss.loss_functions import (
    DraftLossStats,
    NLLLossFn,
    projected_streaming_vocab_parallel_soft_ce,
    streaming_vocab_parallel_soft_ce,
)
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.metrics import combine_metrics, metrics_to_python
from compiled_loss.vocab import LinearLogits, vocab_reduce
from compiled_loss.wrapper import DraftLossWrapper, wrap_loss_fn_with_input_preparation

F64 = torch.float64


def _soft_ce(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1)


def _case(seed: int = 0, rows: int = 11, hidden: int = 8, vocab: int = 13, bins: int = 3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, dtype=F64)
    w = torch.randn(vocab, hidden, generator=g, dtype=F64)
    teacher = torch.randn(rows, vocab, generator=g, dtype=F64)
    mask = (torch.rand(rows, generator=g) > 0.3).to(F64)
    bin_ids = torch.randint(0, bins, (rows,), generator=g)
    weights = torch.tensor([1.0, 0.5, 0.25][:bins], dtype=F64)
    return h, w, teacher, mask, bin_ids, weights


def test_multi_bin_stats_are_per_bin_sums_of_the_masked_soft_ce():
    h, w, teacher, mask, bin_ids, weights = _case()
    logits = (h @ w.T).requires_grad_()
    stats = streaming_vocab_parallel_soft_ce(
        student_logits=logits, teacher_logits=teacher, mask=mask, token_chunk_size=4, bin_ids=bin_ids, weights=weights
    )
    ce = _soft_ce(logits, teacher)
    for b in range(3):
        sel = bin_ids == b
        torch.testing.assert_close(stats.numerators[b].double(), (ce * mask)[sel].sum())
        torch.testing.assert_close(stats.counts[b].double(), mask[sel].sum())
    expected = (stats.numerators * stats.weights).sum() / ((stats.counts * stats.weights).sum() + 1e-8)
    torch.testing.assert_close(stats.normalized(stats.counts), expected)
    # the gradient w.r.t. the student is (q - p)·mask·weight[bin] for the normalised loss's numerator
    (grad,) = torch.autograd.grad((stats.numerators * weights.float()).sum(), logits)
    q, p = logits.detach().softmax(-1), teacher.softmax(-1)
    torch.testing.assert_close(grad, (q - p) * (mask * weights[bin_ids])[:, None], **close(torch.float32, "same"))


def test_rows_outside_the_mask_contribute_nothing_even_when_not_finite():
    h, w, teacher, mask, bin_ids, weights = _case()
    logits = h @ w.T
    logits[mask == 0] = float("nan")
    logits.requires_grad_()
    stats = streaming_vocab_parallel_soft_ce(
        student_logits=logits, teacher_logits=teacher, mask=mask, bin_ids=bin_ids, weights=weights
    )
    (grad,) = torch.autograd.grad(stats.numerators.sum(), logits)
    assert torch.isfinite(stats.numerators).all() and torch.isfinite(grad).all()
    assert (grad[mask == 0] == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(weights=torch.ones(2)), "bin_ids is required with 2 bins"),
        (dict(weights=torch.ones(2), bin_ids=torch.zeros(11, dtype=torch.int32)), "bin_ids must be a long tensor"),
        (dict(weights=torch.ones(2), bin_ids=torch.full((11,), 2)), r"bin_ids must lie in \[0, 2\), got \[2, 2\]"),
        (dict(weights=torch.ones(())), "weights must be 1-D and non-empty"),
        (dict(mask=torch.ones(10)), r"mask must have shape \(11,\)"),
        (dict(teacher_logits=torch.zeros(11, 12)), "matching \\[..., V\\] shapes"),
        (dict(token_chunk_size=0), "token_chunk_size must be None or an int >= 1"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, message):
    h, w, teacher, mask, _, _ = _case()
    args = dict(student_logits=h @ w.T, teacher_logits=teacher, mask=mask) | kwargs
    with pytest.raises(ValueError, match=message):
        streaming_vocab_parallel_soft_ce(**args)


def test_linear_vocab_reduce_equals_vocab_reduce_of_the_projection():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(23, 8, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(17, 8, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(17, generator=g, dtype=F64, requires_grad=True)
    index = torch.randint(0, 17, (23, 3), generator=g)
    teacher = torch.randn(23, 17, generator=g)
    logits = torch.nn.functional.linear(h, w, b)

    def total(stats):
        return stats.lse.sum() * 1.5 + stats.picked.sum() * 0.5 + stats.negent.sum() * 0.25 + stats.cross.sum()

    kw = dict(top_k_top_p=(13, 1.0), teacher=teacher, entropy=True)
    ref = vocab_reduce(logits, index, chunk_size=4, **kw)
    fused = vocab_reduce(LinearLogits(h, w, b), index, chunk_size=5, **kw)
    for a, f in zip(ref, fused):
        torch.testing.assert_close(f, a)
    ref_grads = torch.autograd.grad(total(ref), (h, w, b))
    fused_grads = torch.autograd.grad(total(fused), (h, w, b))
    for a, f in zip(ref_grads, fused_grads):
        torch.testing.assert_close(f, a, **close(torch.float32, "reordered"))


@functools.cache
def _compiled_projected():
    return torch.compile(
        lambda h, w, t, m, ids, wt: projected_streaming_vocab_parallel_soft_ce(
            student_hidden=h, output_weight=w, teacher_logits=t, mask=m, token_chunk_size=4, bin_ids=ids, weights=wt
        ).normalized(torch.ones(3)),
        backend="aot_eager",
        fullgraph=True,
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_projected_soft_ce_equals_the_soft_ce_of_the_projected_logits(compiled):
    h, w, teacher, mask, bin_ids, weights = _case(rows=3 * 5)
    h, w = h.reshape(3, 5, -1).requires_grad_(), w.requires_grad_()
    teacher, mask, bin_ids = teacher.reshape(3, 5, -1), mask.reshape(3, 5), bin_ids.reshape(3, 5)
    ref = streaming_vocab_parallel_soft_ce(
        student_logits=h @ w.T, teacher_logits=teacher, mask=mask, bin_ids=bin_ids, weights=weights
    ).normalized(torch.ones(3))
    if compiled:
        got = _compiled_projected()(h, w, teacher, mask, bin_ids, weights)
    else:
        got = projected_streaming_vocab_parallel_soft_ce(
            student_hidden=h,
            output_weight=w,
            teacher_logits=teacher,
            mask=mask,
            token_chunk_size=4,
            bin_ids=bin_ids,
            weights=weights,
        ).normalized(torch.ones(3))
    torch.testing.assert_close(got, ref.to(got.dtype))
    for a, b in zip(torch.autograd.grad(ref, (h, w)), torch.autograd.grad(got, (h, w))):
        torch.testing.assert_close(b, a, **close(torch.float32, "same"))


def _projected_tp(rank: int, world: int, same_mask: bool):
    group = dist.group.WORLD
    h, w, teacher, mask, bin_ids, weights = _case(rows=9, vocab=12)
    h, w = h.float().requires_grad_(), w.float().requires_grad_()
    shard = slice(rank * 6, (rank + 1) * 6)
    if not same_mask and rank == 1:
        mask = 1 - mask
    try:
        stats = projected_streaming_vocab_parallel_soft_ce(
            student_hidden=h,
            output_weight=w[shard],
            teacher_logits=teacher.float()[:, shard],
            mask=mask.float(),
            token_chunk_size=4,
            tp_group=group,
            bin_ids=bin_ids,
            weights=weights,
        )
    except ValueError as e:
        return str(e)
    loss = stats.normalized(stats.counts)
    return loss.detach(), torch.autograd.grad(loss, (h, w))


@pytest.mark.slow
def test_projected_soft_ce_over_tensor_parallel_vocabulary_shards_equals_the_full_vocabulary():
    h, w, teacher, mask, bin_ids, weights = _case(rows=9, vocab=12)
    h, w = h.float().requires_grad_(), w.float().requires_grad_()
    stats = projected_streaming_vocab_parallel_soft_ce(
        student_hidden=h,
        output_weight=w,
        teacher_logits=teacher.float(),
        mask=mask.float(),
        bin_ids=bin_ids,
        weights=weights,
    )
    loss = stats.normalized(stats.counts)
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    logits = (h.detach() @ w.detach().T).requires_grad_()  # the dense logits' gradient splits d hidden by shard
    dense = streaming_vocab_parallel_soft_ce(
        student_logits=logits, teacher_logits=teacher.float(), mask=mask.float(), bin_ids=bin_ids, weights=weights
    )
    grad_logits = torch.autograd.grad(dense.normalized(dense.counts), logits)[0]
    results = run_on_ranks(_projected_tp, True, timeout=90)
    for rank, (got, (got_h, got_w)) in enumerate(results):
        shard = slice(rank * 6, (rank + 1) * 6)
        torch.testing.assert_close(got, loss.detach())
        # d hidden as the dense logits `h @ w_shardᵀ` give it: this shard's share, not summed over TP
        torch.testing.assert_close(got_h, grad_logits[:, shard] @ w.detach()[shard])
        torch.testing.assert_close(got_w[shard], grad_w[shard])
    torch.testing.assert_close(results[0][1][0] + results[1][1][0], grad_h)  # the shares sum to the gradient


@pytest.mark.slow
def test_ranks_with_different_masks_raise_the_same_error():
    errors = run_on_ranks(_projected_tp, False, timeout=90)
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        "the ranks of a process group disagree on projected_streaming_vocab_parallel_soft_ce's "
        "inputs (shapes, dtypes, token_chunk_size; mask, bin_ids and weights exactly)"
    )


def _deferred_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, width, vocab = 3, 6, 9
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width), generator=g),
        "token_mask": (torch.rand(rows, width, generator=g) > 0.2).float(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        "student_logits": torch.randn(rows, width, vocab, generator=g, requires_grad=True),
    }
    return torch.randn(rows, width, vocab, generator=g), data


def _deferred_wrapper(defer: bool) -> DraftLossWrapper:
    loss_fn = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn(), prepare_fn=prepare_loss_input)
    return DraftLossWrapper(loss_fn, prepare_loss_input, None, loss_weight=0.5, defer_normalization=defer)


def test_deferred_draft_loss_renormalised_by_its_own_count_equals_the_draft_mean():
    """Two micro-batches, the draft loss deferred: its payloads sum through the metric
    registry, and `correct_grads` turns the raw-sum gradient into that of the draft's mean
    over its own tokens (the policy loss here is already normalised, policy_count = 1)."""
    cases = [_deferred_case(s) for s in (0, 1)]
    g_t = torch.tensor(50.0)
    parts, students = [], [data["student_logits"] for _, data in cases]
    for logits, data in cases:
        loss, metrics = _deferred_wrapper(True)(logits, data, None, g_t)  # the policy's logits need no grad
        parts.append(metrics)
        loss.backward()
    combined = combine_metrics(parts)
    state = combined.pop("_draft_step_payload")
    assert isinstance(state, DraftStepState)
    grads = [s.grad.clone() for s in students]
    factor = state.correct_grads(students, 1.0)
    # reference: the soft-CE of both micro-batches, summed, divided by their total count
    total, count = torch.zeros(()), torch.zeros(())
    for logits, data in cases:
        mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:]  # the student at t reads t + 1
        ce = _soft_ce(data["student_logits"][:, :-1], logits[:, 1:])
        total, count = total + (ce * mask).sum(), count + mask.sum()
    ref_grads = torch.autograd.grad(0.5 * total / count, students)
    torch.testing.assert_close(state.counts.sum(), count)
    torch.testing.assert_close(factor, 1.0 / count)
    torch.testing.assert_close(state.numerators.sum(), total.detach(), **close(torch.float32, "same"))
    for got, raw, ref in zip(students, grads, ref_grads):
        torch.testing.assert_close(got.grad, ref)
        torch.testing.assert_close(raw * factor, ref)
    with pytest.raises(ValueError, match="metrics\\['_draft_step_payload'\\] is a DraftStepState"):
        metrics_to_python(parts[0])


def test_the_deferred_payload_leaves_a_compiled_wrapper_intact():
    logits, data = _deferred_case(0)
    wrapper = _deferred_wrapper(True)
    eager = wrapper(logits, data, None, torch.tensor(50.0))
    compiled = torch.compile(wrapper, backend="aot_eager", fullgraph=True)(logits, data, None, torch.tensor(50.0))
    torch.testing.assert_close(compiled[0], eager[0])
    for name in ("numerators", "counts", "weights"):
        torch.testing.assert_close(
            getattr(compiled[1]["_draft_step_payload"], name), getattr(eager[1]["_draft_step_payload"], name)
        )


def test_draft_loss_stats_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="1-D of one shape"):
        DraftLossStats(torch.zeros(2), torch.zeros(3), torch.zeros(2))
