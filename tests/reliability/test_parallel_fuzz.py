"""The parallel surface under the fuzz: random valid configs of every loss family and random
packings (the reliability suite's own strategies) through the three wrappers — unpacked,
per-sequence, fused — on real gloo groups at (tp, cp) ∈ {(2, 1), (1, 2), (2, 2)} equal the
single process: loss, every metric, and the gradient w.r.t. each rank's logits (its
vocabulary shard and context-parallel slots of the single-process gradient, times cp: the
reference's context-parallel convention, ref §10).

The examples are drawn once in the test process (derandomized hypothesis) and handed to
four spawned ranks, which build every group and run every example, so no rank ever waits
on a collective another skips; each rank compares against its own single-process result.
Packings are adapted to context parallelism (every padded length a multiple of 2·cp = 4,
rows padded to a width of a multiple of 4 with masked slots), and the vocabulary is 12
wide so that it splits evenly over two TP ranks (the data's ids stay below 11)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from ranks import context_local, run_on_ranks, tp_cp_groups
from reliability.oracle import (
    CASE_STRATEGIES,
    WRAPPERS,
    Packing,
    global_counts,
    grad_of,
    hyp,
    layout_tokens,
    make_data,
    make_logits,
    packings,
)
from tolerances import close

from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

pytestmark = pytest.mark.slow  # process groups on random cases

EXAMPLES = {"pg": 10, "nll": 4, "dpo": 4, "distill": 4, "mse": 4}
CONFIGS = [(2, 1), (1, 2), (2, 2)]  # (tp, cp) on 4 ranks: rank = cp_rank · tp + tp_rank (+ 2 per replica)
WIDTH = 12  # the vocabulary: even, above the data's ids
MULTIPLE = 4  # 2 · cp
TOL = close(torch.float32, "parallel")


def _for_context_parallelism(packing: Packing) -> Packing:
    pads = tuple(p + (-(n + p)) % MULTIPLE for n, p in zip(packing.lengths, packing.pads))
    return dataclasses.replace(packing, pads=pads)


def _examples() -> list:
    drawn = []
    for family, count in EXAMPLES.items():

        @hyp(count)
        @given(CASE_STRATEGIES[family](), packings(pairs=family == "dpo"))
        def collect(case, packing):
            drawn.append((family, case, _for_context_parallelism(packing)))

        collect()
    return drawn


def _local(x, which: str, packing: Packing, tp_group, cp_group):
    """This rank's share of full logits (or of their gradient): its vocabulary columns and
    its context-parallel positions."""
    if x.shape[-1] > 1 and tp_group is not None:
        width = x.shape[-1] // dist.get_world_size(tp_group)
        rank = dist.get_rank(tp_group)
        x = x[..., rank * width : (rank + 1) * width]
    return context_local(x, cp_group, None if which == "unpacked" else packing.cu_padded)


def _inputs(family: str, case, packing: Packing, which: str):
    """Full logits (a leaf), data and the global counts of one example in `which` layout."""
    vocab = 1 if family == "mse" else WIDTH
    if which == "unpacked":  # whole rows of a width that splits into 2·cp chunks
        rows, width = packing.rows, -(-packing.width // MULTIPLE) * MULTIPLE
        data = make_data(family, rows, width, packing.seed)
        lengths = [width] * rows
        logits = make_logits(rows * width, vocab, packing.seed).detach().reshape(rows, width, -1).requires_grad_()
    else:
        data = make_data(family, packing.rows, packing.width, packing.seed)
        lengths = packing.lengths
        logits = make_logits(layout_tokens(case, packing), vocab, packing.seed)
    return logits, data, global_counts(family, data, lengths)


def _wrapper(case, which: str, packing: Packing, tp_group=None, cp_group=None):
    groups = dict(vocab_parallel_group=tp_group, context_parallel_group=cp_group)
    if which == "unpacked":
        return lambda logits, data, gs, gt: wrap_loss_fn_with_input_preparation(
            logits, data, gs, gt, loss_fn=case.loss_fn, prepare_fn=case.prepare(False), **groups
        )
    cls = {w.__name__: w for w in WRAPPERS}[which]
    return cls(
        case.loss_fn,
        case.prepare(which == "SequencePackingFusionLossWrapper"),
        packing.cu,
        packing.cu_padded,
        bucket=packing.bucket,
        **groups,
    )


def _on_ranks(rank: int, world: int, examples: list) -> tuple[int, list[str]]:
    """(comparisons made, what differed) on this rank."""
    torch.set_num_threads(1)
    problems, compared = [], 0
    for tp, cp in CONFIGS:
        tp_group, cp_group = tp_cp_groups(rank, world, tp, cp)
        for family, case, packing in examples:
            for which in ("unpacked", *(w.__name__ for w in WRAPPERS)):
                logits, data, (gs, gt) = _inputs(family, case, packing, which)
                want, want_metrics = _wrapper(case, which, packing)(logits, data, gs, gt)
                want_grad = _local(grad_of(want, logits), which, packing, tp_group, cp_group) * cp
                local = _local(logits.detach(), which, packing, tp_group, cp_group).requires_grad_()
                got, metrics = _wrapper(case, which, packing, tp_group, cp_group)(local, data, gs, gt)
                label = f"tp={tp} cp={cp} {which} {case!r} {packing}"
                compared += 1
                try:
                    torch.testing.assert_close(got.detach(), want.detach(), **TOL)
                    assert sorted(metrics) == sorted(want_metrics), (sorted(metrics), sorted(want_metrics))
                    for key in want_metrics:
                        torch.testing.assert_close(
                            metrics[key].float(),
                            want_metrics[key].float(),
                            **TOL,
                            equal_nan=True,
                            msg=lambda m, k=key: f"metric {k}: {m}",
                        )
                    torch.testing.assert_close(grad_of(got, local), want_grad, **TOL)
                except AssertionError as e:
                    problems.append(f"{label}: {str(e).splitlines()[0]}")
    return compared, problems


def test_parallel_wrappers_equal_the_single_process_on_random_cases():
    examples = _examples()
    assert len(examples) == sum(EXAMPLES.values())
    results = run_on_ranks(_on_ranks, examples, world_size=4, timeout=600)
    errors = [r for r in results if isinstance(r, str)]  # a rank that raised
    assert errors == []
    assert [compared for compared, _ in results] == [len(CONFIGS) * len(examples) * 3] * 4
    problems = [p for _, found in results for p in found]
    assert problems == [], "\n".join(problems[:20])
