"""`LinearLogits` (hidden states × a vocabulary-sharded LM head) on real gloo groups, against
the single-process dense path: `torch.nn.functional.linear(hidden, weight, bias)` full
logits through the same wrapper with no group.

Each rank passes `LinearLogits(hidden, weight[r·V/tp : (r+1)·V/tp], bias[r·V/tp : (r+1)·V/tp])`
— under context parallelism its load-balanced slots of the hidden states, built exactly as
`test_parity.py` builds CP logits — through `wrap_loss_fn_with_input_preparation` (unpacked
`[B, S, H]`) or `SequencePackingFusionLossWrapper` (packed `[1, T, H]`), for a LOGPROB loss
(ClippedPG with a reference KL), the same with top-k/top-p, and DistillationLossFn with
zero_outside_topk True and False. Checked on every rank:

- the loss and every metric equal the single-process values;
- `d hidden` is exactly what the dense logits `hidden @ weight_shardᵀ` would give: this
  shard's share, cp × the single-process logit gradient at this rank's positions and
  vocabulary columns projected back (`G weight_shard`) — `LinearLogits` does not sum `dH`
  over the TP group, whoever replicated `hidden` does; and, summed over the TP group (what
  the training step's gradient all-reduce / Megatron's copy region does), the single-process
  gradient at this rank's positions **times cp**: the reference's context-parallel convention
  (docs/parallel.md: its all-gather backward sums the incoming gradient
  over the CP ranks and its trainer divides the loss by cp), so at cp = 1 it is the plain
  gradient;
- `d weight` / `d bias` of the shard: this rank's share, i.e. cp × the single-process logit
  gradient at its positions and vocabulary columns projected back (`Gᵀ hidden`, `Σ G`); and,
  summed over the CP group (what the trainer's gradient all-reduce does), cp × the matching
  vocabulary slice of the single-process `d weight` / `d bias` — exactly that slice at cp = 1.

One spawn per world size (2: tp2 and cp2; 4: tp2cp2) runs every case, cached for the module;
each (configuration, case) is its own test item, and `test_linear_logits_single_process` runs
the same checks at tp = cp = 1 in this process. `chunk_size=5` variants run the LOGPROB losses
through several row chunks of the fused reduction (forward and the recomputing backward; with
top-k/top-p, thresholds taken from each chunk's own logits). Like the other spawn tests, run from the
repository root with `python -m pytest` (the ranks import this module as `tests.parallel.…`).
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist
from cases import CASE_BY_NAME, VOCAB, boundaries, globals_for, make_batch, pack_logits
from ranks import context_local, run_on_ranks, tp_cp_groups
from tolerances import close

from compiled_loss.interfaces import LossInputType
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

pytestmark = pytest.mark.slow  # spawns process groups (one spawn per world size)

HIDDEN = 8
LOSSES = ["grpo", "grpo_topk_topp", "distill_mixed_zero_outside", "distill_reverse"]
LENGTHS, PADS, WIDTH = [6, 3, 8, 2], [2, 1, 0, 2], 8  # padded lengths 8, 4, 8, 4: multiples of 2·cp
TOL = close(torch.float32, "parallel")
GRAD_TOL = close(torch.float32, "fused_grad")  # d weight / d bias: sums over every position
CONFIGS = {"tp2": (2, 1), "cp2": (1, 2), "tp2cp2": (2, 2)}
SPAWNS = {2: ("tp2", "cp2"), 4: ("tp2cp2",)}  # world size → the configurations one spawn runs
TIMEOUT = {2: 120, 4: 240}  # generous: a loaded 2-core machine runs the 4-rank spawn in ~30 s


def _variants(name: str) -> list[tuple[str, int | None]]:
    """(wrapper, chunk_size): both wrappers; LOGPROB losses also through several row chunks."""
    out = [("unpacked", None), ("fused", None)]
    if CASE_BY_NAME[name].make_loss().input_type == LossInputType.LOGPROB:
        out += [("unpacked", 5), ("fused", 5)]
    return out


def _label(name: str, which: str, chunk: int | None) -> str:
    return f"{name}/{which}" + ("" if chunk is None else f"/chunk{chunk}")


def _param(config: str, name: str, which: str, chunk: int | None):
    return pytest.param(config, name, which, chunk, id=f"{config}-{_label(name, which, chunk)}")


ITEMS = [
    _param(config, name, which, chunk) for config in CONFIGS for name in LOSSES for which, chunk in _variants(name)
]


def _batch(name: str, which: str):
    """The case, its data, and the single-process hidden states (`[B, S, H]`, or packed
    `[1, T, H]` with random junk in the padding slots), LM-head weight `[V, H]` and bias `[V]`."""
    case = CASE_BY_NAME[name]
    data, _ = make_batch(case, LENGTHS, WIDTH, seed=21)
    g = torch.Generator().manual_seed(22)
    hidden = torch.randn(len(LENGTHS), WIDTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * (2.0 / HIDDEN**0.5)  # logits of std ~2
    bias = torch.randn(VOCAB, generator=g) * 0.5
    if which == "fused":
        cu, cup = boundaries(LENGTHS, PADS)
        hidden = pack_logits(hidden, cu, cup, cup[-1], seed=23).detach()
    return case, data, hidden, weight, bias


def _wrapper(which: str, case, chunk: int | None, tp_group=None, cp_group=None):
    groups = dict(vocab_parallel_group=tp_group, context_parallel_group=cp_group)
    prepare = case.prepare(packed=which == "fused")
    if chunk is not None:
        prepare = functools.partial(prepare, chunk_size=chunk)
    if which == "unpacked":
        return functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=case.make_loss(), prepare_fn=prepare, **groups
        )
    cu, cup = boundaries(LENGTHS, PADS)
    return SequencePackingFusionLossWrapper(case.make_loss(), prepare, cu, cup, **groups)


def _local(which: str, x: torch.Tensor, cp_group) -> torch.Tensor:
    """This CP rank's positions of a full `[B, S, ...]` / `[1, T, ...]` tensor."""
    return context_local(x, cp_group, None if which == "unpacked" else boundaries(LENGTHS, PADS)[1])


def _check(name: str, which: str, chunk: int | None, tp_rank: int, tp: int, cp: int, tp_group, cp_group) -> list[str]:
    """One case on this rank: the list of mismatches (empty when it matches)."""
    case, data, hidden, weight, bias = _batch(name, which)
    gs, gt = globals_for(data)

    # single process, dense: full logits, no group
    full = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(*full)
    want, want_metrics = _wrapper(which, case, chunk)(logits, data, gs, gt)
    want_dh, want_dw, want_db, want_dlogits = torch.autograd.grad(want, [*full, logits])

    # this rank: its positions of the hidden states, its vocabulary shard of the LM head
    cols = slice(tp_rank * VOCAB // tp, (tp_rank + 1) * VOCAB // tp)
    h = _local(which, hidden, cp_group).requires_grad_()
    w, b = weight[cols].clone().requires_grad_(), bias[cols].clone().requires_grad_()
    got, metrics = _wrapper(which, case, chunk, tp_group, cp_group)(LinearLogits(h, w, b), data, gs, gt)
    dh, dw, db = torch.autograd.grad(got, [h, w, b])

    # this rank's share of d hidden / d weight / d bias: cp × its positions' logit gradient at
    # its vocabulary columns, projected back
    share = cp * _local(which, want_dlogits, cp_group)[..., cols]
    local_h = h.detach().flatten(0, 1)
    summed_dh, summed_dw, summed_db = dh.clone(), dw.clone(), db.clone()
    if tp_group is not None:  # the replicated hidden states' gradient all-reduce over the TP ranks
        dist.all_reduce(summed_dh, group=tp_group)
    if cp_group is not None:  # the trainer's gradient all-reduce over the CP ranks
        dist.all_reduce(summed_dw, group=cp_group)
        dist.all_reduce(summed_db, group=cp_group)
    checks = [
        ("loss", got, want, TOL),
        *((f"metric {key}", metrics.get(key), want_metrics[key], TOL) for key in want_metrics),
        ("d hidden (this rank's share)", dh, share @ weight[cols], TOL),
        ("d hidden (summed over tp)", summed_dh, cp * _local(which, want_dh, cp_group), TOL),
        ("d weight (this rank's share)", dw, share.flatten(0, 1).t() @ local_h, GRAD_TOL),
        ("d bias (this rank's share)", db, share.flatten(0, 1).sum(0), GRAD_TOL),
        ("d weight (summed over cp)", summed_dw, cp * want_dw[cols], GRAD_TOL),
        ("d bias (summed over cp)", summed_db, cp * want_db[cols], GRAD_TOL),
    ]
    problems = [] if sorted(metrics) == sorted(want_metrics) else [f"metric keys {sorted(metrics)}"]
    for what, value, expected, tol in checks:
        try:
            assert value is not None, "missing"
            torch.testing.assert_close(value.float(), expected.float(), **tol)
        except AssertionError as e:
            problems.append(f"{what}: {' '.join(str(e).split())[:300]}")
    return problems


def _on_ranks(rank: int, world: int) -> dict[str, dict[str, list[str]]]:
    """Every case of every configuration this world size runs: {config: {case: mismatches}}."""
    out = {}
    for config in SPAWNS[world]:
        tp, cp = CONFIGS[config]
        tp_group, cp_group = tp_cp_groups(rank, world, tp, cp)
        report = out[config] = {}
        for name in LOSSES:
            for which, chunk in _variants(name):
                label = _label(name, which, chunk)
                try:
                    report[label] = _check(name, which, chunk, rank % tp, tp, cp, tp_group, cp_group)
                except Exception:  # the same on every rank (no collective left half-done): report it
                    report[label] = [traceback.format_exc(limit=-3)]
    return out


@functools.cache
def _run(world: int) -> list | str:
    """Each rank's `_on_ranks` result, or why the spawn failed (cached too: one spawn per world size)."""
    try:
        return run_on_ranks(_on_ranks, world_size=world, timeout=TIMEOUT[world])
    except Exception as e:  # a timeout or a rank that died: every item of this world size fails on it
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize(("config", "name", "which", "chunk"), ITEMS)
def test_linear_logits_parallel_parity(config, name, which, chunk):
    tp, cp = CONFIGS[config]
    label = _label(name, which, chunk)
    results = _run(tp * cp)
    assert not isinstance(results, str), results
    for rank, result in enumerate(results):
        assert isinstance(result, dict), f"rank {rank}: {result}"  # the rank itself failed
        assert result[config][label] == [], f"rank {rank}"


@pytest.mark.parametrize(
    ("name", "which", "chunk"),
    [pytest.param(*p.values[1:], id=p.id.removeprefix("tp2-")) for p in ITEMS if p.values[0] == "tp2"],
)
def test_linear_logits_single_process(name, which, chunk):
    """The same checks at tp = cp = 1, in this process: non-identity LM head with a bias."""
    assert _check(name, which, chunk, 0, 1, 1, None, None) == []
