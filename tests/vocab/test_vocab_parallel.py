"""The vocab room over real gloo ranks: each rank holds a vocabulary shard, and every
statistic equals the full-vocabulary single-process one, its gradient the matching slice
of the full gradient — eager (in row chunks) and compiled (one graph, no host sync); the
top-k / top-p thresholds, the global top-k and the draft-vocabulary map too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from tolerances import close

from compiled_loss.train import CompileRecorder
from compiled_loss.utils import map_teacher_logits_to_draft_vocab
from compiled_loss.vocab import sampling_threshold, vocab_reduce, vocab_topk

N, V, K = 9, 12, 3


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g) * 3
    teacher = torch.randn(N, V, generator=g) * 2
    index = torch.randint(0, V, (N, K), generator=g)
    threshold = logits.sort(-1).values[:, V // 3]  # keep the top two thirds of each row
    weights = [
        torch.randn(N, generator=g),
        torch.randn(N, K, generator=g),
        torch.randn(N, generator=g),
        torch.randn(N, generator=g),
    ]
    return logits, teacher, index, threshold, weights


def _run(fn, logits, teacher, index, threshold, weights, **kw):
    """The four statistics and the gradient of a weighted sum of them."""
    x = logits.clone().requires_grad_()
    stats = fn(x, index, threshold=threshold, teacher=teacher, entropy=True, **kw)
    total = sum((s * w).sum() for s, w in zip(stats, weights))
    return [s.detach() for s in stats], torch.autograd.grad(total, x)[0]


def _on_ranks(rank: int, world: int):
    logits, teacher, index, threshold, weights = _inputs()
    shard = slice(rank * V // world, (rank + 1) * V // world)
    group = dist.group.WORLD
    recorder = CompileRecorder("aot_eager")
    compiled = recorder.compile(vocab_reduce, fullgraph=True)
    out = {}
    for name, fn, kw in (("eager", vocab_reduce, {"chunk_size": 4}), ("compiled", compiled, {})):
        out[name] = _run(fn, logits[:, shard], teacher[:, shard], index, threshold, weights, group=group, **kw)
    threshold_fn = recorder.compile(sampling_threshold, fullgraph=True)
    out["thresholds"] = [
        sampling_threshold(logits[:, shard], 4, 0.8, chunk_size=2, group=group),
        threshold_fn(logits[:, shard], 4, 0.8, group=group),
    ]
    out["topk"] = vocab_topk(logits[:, shard], 5, group)
    out["draft"] = map_teacher_logits_to_draft_vocab(teacher[None, :, shard], D2T, rank, group)[0]
    out["problems"] = recorder.report.problems()
    return out


D2T = torch.tensor([0, 1, 3, 3, 5, 6])  # draft id i -> target id i + d2t[i]


@pytest.fixture(scope="module")
def rank_results():
    return run_on_ranks(_on_ranks)


@pytest.mark.slow
def test_thresholds_top_k_and_draft_map_over_shards(rank_results):
    logits, teacher, *_ = _inputs()
    want_thresholds = sampling_threshold(logits, 4, 0.8)
    want_values, want_ids = vocab_topk(logits, 5)
    want_draft = map_teacher_logits_to_draft_vocab(teacher, D2T)
    for rank, out in enumerate(rank_results):
        assert out["problems"] == []
        for got in out["thresholds"]:
            assert torch.equal(got, want_thresholds)
        assert torch.equal(out["topk"][0], want_values) and torch.equal(out["topk"][1], want_ids)
        assert torch.equal(out["draft"], want_draft[:, rank * 3 : (rank + 1) * 3])


def test_sharded_statistics_and_gradients_equal_the_full_vocabulary(rank_results):
    logits, teacher, index, threshold, weights = _inputs()
    want_stats, want_grad = _run(vocab_reduce, logits, teacher, index, threshold, weights)
    for rank, out in enumerate(rank_results):
        assert isinstance(out, dict), out
        assert out["problems"] == []
        for mode in ("eager", "compiled"):
            stats, grad = out[mode]
            for got, want, name in zip(stats, want_stats, ("lse", "picked", "negent", "cross")):
                torch.testing.assert_close(
                    got, want, **close(torch.float32, "parallel"), msg=f"rank {rank} {mode} {name}"
                )
            shard = slice(rank * V // 2, (rank + 1) * V // 2)
            torch.testing.assert_close(
                grad, want_grad[:, shard], **close(torch.float32, "parallel"), msg=f"rank {rank} {mode}"
            )
