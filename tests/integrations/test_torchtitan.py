"""`compiled_loss.integrations.torchtitan` against torchtitan 0.3.0's own losses
(`torchtitan.components.loss.CrossEntropyLoss`, the RL experiment's `DAPOLoss` and
`GRPOLoss`; CI: `pip install tyro && pip install --no-deps torchtitan==0.3.0
spmd_types==0.2.3`): the loss, every metric and the gradient of the logits, in one process
and on 2 gloo ranks (uneven vocabulary shards as plain tensors with their group and as a
`(Shard(-1),)` DTensor; data-parallel halves whose losses and gradients sum to the whole
batch's); one graph per shape bucket, no graph break, no host sync; the refusals."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types

import pytest
import torch
from ranks import run_on_ranks
from tolerances import close

from compiled_loss.integrations import torchtitan as ours
from compiled_loss.train.recorder import graph_sync_ops


def _torchtitan():
    """torchtitan's loss module and its RL losses, or None where torchtitan does not import.
    `torchtitan.experiments.rl`'s `__init__` imports vLLM and Triton; it is replaced by a
    bare package, so its `losses` submodules load from their files as usual."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        return None
    if "torchtitan.experiments.rl" not in sys.modules:
        import torchtitan.experiments

        package = types.ModuleType("torchtitan.experiments.rl")
        package.__path__ = [f"{list(torchtitan.experiments.__path__)[0]}/rl"]
        sys.modules["torchtitan.experiments.rl"] = package
    from torchtitan.components import loss
    from torchtitan.experiments.rl import losses

    return types.SimpleNamespace(
        CrossEntropyLoss=loss.CrossEntropyLoss, DAPOLoss=losses.DAPOLoss, GRPOLoss=losses.GRPOLoss
    )


titan = _torchtitan()
needs_torchtitan = pytest.mark.skipif(
    titan is None, reason="torchtitan does not import: pip install tyro && pip install --no-deps torchtitan==0.3.0 "
    "spmd_types==0.2.3"
)  # fmt: skip
pytestmark = needs_torchtitan


def _theirs(name, **options):
    if name == "ce":
        return titan.CrossEntropyLoss(titan.CrossEntropyLoss.Config())
    if name == "grpo":
        return titan.GRPOLoss(titan.GRPOLoss.Config(**options))
    return titan.DAPOLoss(titan.DAPOLoss.Config(**options))


def _mine(name, compiled=False, group=None, **options):
    cls = {"ce": ours.CrossEntropyLoss, "grpo": ours.GRPOLoss, "dapo": ours.DAPOLoss}[name]
    return cls(compiled=compiled, vocab_parallel_group=group, **options)


OPTIONS = {"ce": {}, "grpo": {"clip_eps": 0.2}, "dapo": {"ratio_clip_low": 0.2, "ratio_clip_high": 0.28}}


def _batch(seed, lead=(2, 7), vocab=13, dtype=torch.float32, spread=1.0):
    """`(logits, labels, rl inputs)`: some labels IGNORE_INDEX, generator log-probs with a NaN,
    a -inf and (with `spread` 10) log-ratios beyond torchtitan's ±10 clamp."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=g)
    labels.view(-1)[:2] = -100
    gen = -torch.rand(lead, generator=g) * 3 - torch.rand(lead, generator=g) * spread * 3
    gen.view(-1)[3], gen.view(-1)[4] = float("nan"), float("-inf")
    rl = {
        "generator_logprobs": gen,
        "advantages": torch.randn(lead, generator=g),
        "loss_mask": torch.rand(lead, generator=g) > 0.3,
    }
    return logits, labels, rl


def _run(fn, logits, labels, gvt, rl):
    """`fn`'s loss, metrics and the gradient of the logits. torchtitan's losses take `[B, L, V]`
    only: `[T, V]` reaches them as `[1, T, V]`."""
    logits = logits.clone().requires_grad_(True)
    flat = labels.dim() == 1 and not isinstance(fn, ours._TorchtitanLoss)
    args = (logits[None], labels[None], gvt, {k: v[None] for k, v in rl.items()}) if flat else (logits, labels, gvt, rl)
    loss, metrics = fn(*args[:3], **args[3])
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, logits.grad


def _assert_same(mine, theirs, kind="reordered"):
    (loss, metrics, grad), (loss_t, metrics_t, grad_t) = mine, theirs
    torch.testing.assert_close(loss, loss_t, **close(torch.float32, kind))
    assert list(metrics) == list(metrics_t)
    for key, value in metrics_t.items():
        assert metrics[key].dim() == 0, key
        torch.testing.assert_close(metrics[key], value, **close(torch.float32, kind), msg=key)
    assert grad.dtype == grad_t.dtype
    torch.testing.assert_close(grad.float(), grad_t.float(), **close(grad.dtype, kind))


@pytest.mark.parametrize("name", ["ce", "grpo", "dapo"])
def test_loss_equals_torchtitan(name):
    """[T, V] and [B, T, V] logits × fp32 and bf16 × global_valid_tokens None, a number, a
    tensor and 0 × log-ratios within and beyond the clamp: loss, every metric (torchtitan's
    keys, 0-d tensors) and the gradient of the logits."""
    cases = itertools.product(
        ((14,), (2, 7)), (torch.float32, torch.bfloat16), (None, 9, torch.tensor(11.0), 0), (1, 10)
    )
    for i, (lead, dtype, gvt, spread) in enumerate(cases):
        if name == "ce" and (spread != 1 or gvt == 0):
            continue  # CE has no log-ratio; torchtitan's CE divides by 0 (no floor)
        logits, labels, rl = _batch(i, lead, dtype=dtype, spread=spread)
        rl = {} if name == "ce" else rl
        mine = _run(_mine(name, **OPTIONS[name]), logits, labels, gvt, rl)
        theirs = _run(_theirs(name, **OPTIONS[name]), logits, labels, gvt, rl)
        _assert_same(mine, theirs)


class _Counting:
    """A `torch.compile` backend that runs each graph eagerly, counting the graphs and the
    in-graph host syncs it is handed."""

    def __init__(self) -> None:
        self.graphs, self.syncs = 0, []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.syncs += graph_sync_ops(gm)
        return gm.forward


@pytest.mark.parametrize("name", ["ce", "dapo"])
def test_one_graph_per_bucket(name):
    """Token counts 5, 9 and 16 share the bucket 16, 17 and 20 the bucket 32: two graphs, no
    host sync, each call equal to the uncompiled loss with a new global_valid_tokens;
    `max_buckets=2` refuses a third bucket on the host, naming it."""
    torch._dynamo.reset()
    backend = _Counting()
    compiled = _mine(name, compiled=backend, max_buckets=2, **OPTIONS[name])
    eager = _mine(name, **OPTIONS[name])
    for i, tokens in enumerate((5, 9, 16, 17, 20)):
        logits, labels, rl = _batch(i, (tokens,))
        rl = {} if name == "ce" else rl
        _assert_same(_run(compiled, logits, labels, 30 + i, rl), _run(eager, logits, labels, 30 + i, rl), "compiled")
    assert (backend.graphs, backend.syncs) == (2, [])
    logits, labels, rl = _batch(0, (33,))
    with pytest.raises(ValueError, match="would be distinct bucket 3, and max_buckets=2") as refused:
        compiled(logits, labels, 5, **({} if name == "ce" else rl))
    assert "float32[48, 13]" in str(refused.value)


def test_refusals():
    """Inputs of the wrong kind or shape are named before any compiled code."""
    logits, labels, rl = _batch(0)
    ce, dapo = ours.CrossEntropyLoss(compiled=False), ours.DAPOLoss(compiled=False)
    with pytest.raises(ValueError, match=r"labels must have shape \[2, 7\] \(pred's less its vocabulary\), got \[14\]"):
        ce(logits, labels.flatten())
    with pytest.raises(ValueError, match="labels must be an int64 or int32 tensor"):
        ce(logits, labels.float())
    with pytest.raises(ValueError, match=r"pred must be floating-point logits \[T, V\] or \[B, T, V\], got int64"):
        ce(labels, labels)
    with pytest.raises(ValueError, match=r"advantages must be a tensor of shape \[2, 7\], got \[7\]"):
        dapo(logits, labels, 4, **{**rl, "advantages": rl["advantages"][0]})
    with pytest.raises(ValueError, match="global_valid_tokens must be a number or a one-element tensor"):
        ce(logits, labels, torch.ones(2))
    with pytest.raises(ValueError, match="ratio_clip_high must be a number >= 0, got -0.1"):
        ours.DAPOLoss(ratio_clip_high=-0.1)
    with pytest.raises(ValueError, match="bucket must be a BucketGrid"):
        ours.GRPOLoss(bucket=16)


# ---------------------------------------------------------------------------------------
# 2 gloo ranks
# ---------------------------------------------------------------------------------------

VOCAB = 11
"""Shards of 6 and 5 ids: torchtitan's (and torch.chunk's) uneven split."""


def _ranks_worker(rank, world_size, case, name, compiled):
    """This rank's (mine, torchtitan's dense) `(loss, metrics, grad)`; the dense gradient
    sliced to the rank's part (its vocabulary shard under tp, its tokens under dp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    logits, labels, rl = _batch(5, (3, 8), vocab=VOCAB, spread=10)
    rl = {} if name == "ce" else rl
    gvt = torch.tensor(17.0)
    theirs = _run(_theirs(name, **OPTIONS[name]), logits, labels, gvt, rl)
    start, stop = (0, 6) if rank == 0 else (6, VOCAB)
    if case == "dp":  # each rank its half of the rows, the global denominator
        rows = slice(0, 2) if rank == 0 else slice(2, 3)
        local = {k: v[rows] for k, v in rl.items()}
        mine = _run(_mine(name, compiled, **OPTIONS[name]), logits[rows], labels[rows], gvt, local)
        sums = torch.stack([mine[0], *mine[1].values()])
        dist.all_reduce(sums)  # every metric sums over the ranks but the max
        return mine, theirs, sums, theirs[2][rows]
    if case == "tp":
        group = dist.new_group([0, 1])
        mine = _run(_mine(name, compiled, group, **OPTIONS[name]), logits[..., start:stop], labels, gvt, rl)
        return mine, theirs, None, theirs[2][..., start:stop]
    mesh = init_device_mesh("cpu", (world_size,))
    dtensor = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_(True)
    loss, metrics = _mine(name, compiled, **OPTIONS[name])(dtensor, labels, gvt, **rl)
    loss.backward()
    grad = dtensor.grad
    assert grad.placements == (Shard(2),), grad.placements
    mine = (loss.detach(), {k: v.detach() for k, v in metrics.items()}, grad.to_local())
    return mine, theirs, None, theirs[2][..., start:stop]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,name,compiled",
    [("tp", "dapo", False), ("tp", "ce", "aot_eager"), ("dtensor", "grpo", "aot_eager"), ("dp", "dapo", False)],
)
def test_two_ranks_equal_torchtitan_dense(case, name, compiled):
    """2 gloo ranks, torchtitan's dense loss on the whole batch the oracle. tp: uneven
    vocabulary shards (6 and 5 ids) as plain tensors with their group; dtensor: the logits a
    `(Shard(-1),)` DTensor, its gradient one too; each rank's loss and metrics are the dense
    ones and its gradient the dense gradient's shard. dp: each rank its rows with the global
    global_valid_tokens; the losses and metrics sum over the ranks to the dense ones (the
    max is the larger), each rank's gradient the dense gradient of its rows."""
    results = run_on_ranks(_ranks_worker, case, name, compiled, timeout=240)
    for result in results:
        assert not isinstance(result, str), result
        (loss, metrics, grad), (loss_t, metrics_t, _), sums, grad_t = result
        torch.testing.assert_close(grad, grad_t, **close(torch.float32, "reordered"))
        if sums is None:
            _assert_same((loss, metrics, grad), (loss_t, metrics_t, grad_t))
            continue
        expected = torch.stack([loss_t, *metrics_t.values()])
        keys = ["loss", *metrics_t]
        for key, value, want in zip(keys, sums, expected, strict=True):
            if key.endswith("/max"):
                continue
            torch.testing.assert_close(value, want, **close(torch.float32, "reordered"), msg=key)
    maxes = [r[0][1]["bit_wise/logprob_diff/max"] for r in results] if name != "ce" else []
    if maxes:
        torch.testing.assert_close(max(maxes), results[0][1][1]["bit_wise/logprob_diff/max"])
