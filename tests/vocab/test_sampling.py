"""Top-k / top-p keep thresholds (ref §3.3): the kept set is the reference's, in any row
chunking; under torch.compile the threshold stays an opaque chunked op, so no fp32 copy
of the logits is sorted."""

from __future__ import annotations

import pytest
import torch

from compiled_loss.vocab import sampling_threshold


def reference_keep(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """`apply_top_k_top_p`'s keep mask, written from ref §3.3 (sort, top-k mask, cumsum);
    a top-k of at least the vocabulary keeps every token."""
    x = logits.float()
    vocab = x.shape[-1]
    keep = torch.ones_like(x, dtype=torch.bool)
    top_k = top_k if top_k is not None and 0 < top_k < vocab else None
    if top_k is not None:
        keep &= x >= torch.topk(x, top_k, -1).values[:, -1:]
    if top_p != 1.0:
        srt, idx = torch.sort(x, -1)
        if top_k is not None:
            srt = torch.where(srt >= srt[:, vocab - top_k : vocab - top_k + 1], srt, float("-inf"))
        p_keep = torch.cumsum(torch.softmax(srt, -1), -1) > 1 - top_p
        p_keep[:, -1] = True
        keep &= torch.zeros_like(keep).scatter(-1, idx, p_keep)
    return keep


@pytest.mark.parametrize("top_k", [None, 3, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_kept_set_is_the_reference_one(top_k, top_p, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(13, 32, generator=g) * 3).to(torch.bfloat16)
    threshold = sampling_threshold(logits, top_k, top_p, chunk)
    kept = logits.float() >= threshold[:, None]
    assert torch.equal(kept, reference_keep(logits, top_k, top_p))


def test_compiled_threshold_is_one_opaque_op_with_no_sort():
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda x: sampling_threshold(x, 8, 0.9), backend=backend, fullgraph=True)
    x = torch.randn(64, 100)
    assert torch.equal(fn(x), sampling_threshold(x, 8, 0.9))
    assert any("compiled_loss.sampling_threshold" in t for t in targets), targets
    assert not any("sort" in t or "topk" in t for t in targets), targets


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1, got 0"):
        sampling_threshold(torch.zeros(2, 4), 2, 1.0, chunk_size=0)
