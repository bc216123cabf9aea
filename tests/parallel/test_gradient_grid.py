"""The gradient-parity grid: every loss × {dense LM head, fused LM head (`LinearLogits`)}, the
value head included, through the runner's training step under `torchrun` on gloo at
several parallel sizes (below): the first step's loss, every metric and
every policy parameter's gradient equal the single process's (cross-tokenizer distillation
runs at tp = cp = 1 only: under tp or cp the config refuses it). The model is sharded with
torch.distributed's engine (`shard_model`): at (tp, cp, dp, dp_shard) ∈ {(2,1,1,1),
(1,2,1,1), (1,1,2,1), (2,2,1,1), (1,1,1,2), (2,1,1,2)} — the TP plan, the sequence over
cp (each rank's slots through the model, attention over the group's keys and values),
FSDP2 over cp and dp_shard, HSDP's replicas over dp — and every gradient is gathered whole
(`full_tensor`). `model=hf` and the co-trained drafters at some of those sizes: `EXTRA`.

The worker (`grid_worker.py`) builds each case as the runner does (`build_run`: seeded
models, loss, step, rollouts; eager, fp32, one step, no gradient clipping) and moves the
step off the fixed point where every ratio is 1 and every KL 0. Packing alternates between
the packed and the padded layout across the cases. Tolerance: rel 1e-4 and abs 1e-6 on
metrics, and on gradients rel 1e-4 with abs 1e-6 · (the largest entry of the parameter's
gradient) — fp32 sums taken in another order (over shards, CP chunks and replicas); the
largest differences measured are printed.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # torchrun: every loss at four parallel sizes

WORKER = Path(__file__).with_name("grid_worker.py")
SIZES = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1), (1, 1, 1, 2), (2, 1, 1, 2)]  # tp, cp, dp, dp_shard
REL, ABS = 1e-4, 1e-6
# cases the config refuses at a size, with the start of the refusal
REFUSED = {
    "cross_tokenizer-dense": (
        "ConfigError: loss=cross_tokenizer reads whole student and teacher "
        "distributions: it runs at parallel.tp = parallel.cp = 1"
    )
}


def _grid(out: Path, tp: int, cp: int, dp: int, dp_shard: int, *names: str) -> dict:
    procs = tp * cp * dp * dp_shard
    launcher = (
        [sys.executable]
        if procs == 1
        else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", "--standalone"]
    )
    proc = subprocess.run(
        [*launcher, str(WORKER), str(out), *map(str, (tp, cp, dp, dp_shard)), *names],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    results = _grid(tmp_path_factory.mktemp("grid") / "single.pt", 1, 1, 1, 1)
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors
    return results


def _differences(want: dict, got: dict) -> tuple[list[str], float, float]:
    """What differs beyond tolerance, and the largest relative metric / gradient difference."""
    problems, worst_metric, worst_grad = [], 0.0, 0.0
    if "error" in got:
        return [f"raised {got['error']}"], 0.0, 0.0
    if set(got["metrics"]) != set(want["metrics"]):
        problems.append(f"metric keys differ: {sorted(set(got['metrics']) ^ set(want['metrics']))}")
    for key in sorted(set(got["metrics"]) & set(want["metrics"])):
        a, b = want["metrics"][key], got["metrics"][key]
        if math.isnan(a) and math.isnan(b):
            continue
        if not b == pytest.approx(a, rel=REL, abs=ABS):
            problems.append(f"metric {key}: {b} != {a}")
        elif a:
            worst_metric = max(worst_metric, abs(b - a) / abs(a))
    if set(got["grads"]) != set(want["grads"]):
        problems.append(f"parameters with a gradient differ: {sorted(set(got['grads']) ^ set(want['grads']))}")
    for name in sorted(set(got["grads"]) & set(want["grads"])):
        a, b = want["grads"][name], got["grads"][name]
        scale = a.abs().max().item()
        try:
            torch.testing.assert_close(b, a, rtol=REL, atol=ABS * scale)
        except AssertionError:
            ratio = (b.norm() / a.norm()).item() if a.norm() > 0 else float("inf")
            problems.append(
                f"grad {name}: max |diff| {(b - a).abs().max().item():.3g} "
                f"(largest entry {scale:.3g}; norm ratio {ratio:.4g})"
            )
            continue
        if scale:
            worst_grad = max(worst_grad, (b - a).abs().max().item() / scale)
    return problems, worst_metric, worst_grad


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "tp{}cp{}dp{}dp_shard{}".format(*s))
def test_every_loss_and_head_equals_the_single_process(single, sizes, tmp_path):
    got = _grid(tmp_path / "grid.pt", *sizes)
    assert set(got) == set(single)
    report, worst = [], (0.0, 0.0)
    tp, cp, *_ = sizes
    for name in single:
        if name in REFUSED and tp * cp > 1:
            assert got[name].get("error", "").startswith(REFUSED[name]), got[name].get("error")
            continue
        problems, metric, grad = _differences(single[name], got[name])
        report += [f"{name}: {p}" for p in problems]
        worst = (max(worst[0], metric), max(worst[1], grad))
    assert not report, "\n".join(report)
    print(
        f"{sizes}: {len(single)} cases; largest relative difference: metrics {worst[0]:.2g}, "
        f"gradients {worst[1]:.2g} (of the parameter's largest entry)"
    )


EXTRA = {  # EXTRA_CASES (grid_worker.py) at the sizes each runs at: (the single process's case, the parallel run's)
    (2, 1, 1, 1): [(name, name) for name in ("hf-clipped_pg", "hf-dpo-fused_head", "eagle3", "dflash")],
    (1, 2, 1, 1): [(name, name) for name in ("eagle3", "dflash")],  # the hidden states gathered from the CP ranks
    # EAGLE-3 at one micro-batch per data-parallel rank (as tests/app/test_torchrun.py). DFlash draws a static
    # number of anchors per data-parallel rank: by design its data-parallel runs draw other anchors than one
    # process does
    (1, 1, 1, 2): [("eagle3-one_micro_batch", "eagle3-one_micro_batch")],
}


@pytest.mark.parametrize("sizes", list(EXTRA), ids=lambda s: "tp{}cp{}dp{}dp_shard{}".format(*s))
def test_hf_model_and_drafters_equal_the_single_process(sizes, tmp_path):
    """`model=hf` under its TP plan on two losses (dense and fused head), and both co-trained
    drafters at tp=2 and cp=2 (the drafter's gradients too): loss, every metric, every gradient."""
    pairs = EXTRA[sizes]
    want = _grid(tmp_path / "single.pt", 1, 1, 1, 1, *(single for single, _ in pairs))
    got = _grid(tmp_path / "grid.pt", *sizes, *(parallel for _, parallel in pairs))
    report = [f"{b}: {p}" for a, b in pairs for p in _differences(want[a], got[b])[0]]
    assert all(any(g.startswith("drafter.") for g in want[a]["grads"]) for a, _ in pairs if "hf" not in a)
    assert not report, "\n".join(report)
