"""The log-prob compiled by Inductor on a CPU: its forward and backward graphs are stored in
Inductor's FX graph cache (a graph holding a higher-order operator such as `torch.cond`
bypasses it, and recompiles at every start), and give float64's log-softmax and gradient
to fp32 rounding — bf16 logits, `-inf` entries, a top-k filter and a logit of 1e4."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import close
from torch._dynamo.utils import counters

from compiled_loss.vocab import token_logprobs

pytestmark = pytest.mark.slow  # an Inductor compile (about 20 s)

N, V = 6, 300


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g) * 4
    logits[1, 100:110] = -math.inf  # masked entries
    logits[2, 200] = 1e4
    threshold = logits.sort(-1).values[:, V - 40]  # top-40 filter
    threshold[2] = -math.inf  # row 2 unfiltered
    targets = logits.argsort(-1, descending=True)[:, 4]  # each row's 5th largest entry
    targets[2] = 0  # far below its row's max: log-prob about -1e4
    targets[3] = logits[3].argmin()  # filtered: log-prob -inf
    return logits.bfloat16(), targets, threshold


def _reference(logits, targets, threshold):
    x = logits.double()
    x = torch.where(x < threshold.double()[:, None], -math.inf, x)
    return torch.log_softmax(x, -1).gather(-1, targets[:, None])[:, 0]


def test_compiled_log_prob_is_cached_and_equals_log_softmax():
    logits, targets, threshold = _inputs()

    def logprob(x, targets, threshold):  # a code object of its own: Dynamo traces it afresh
        return token_logprobs(x, targets, threshold=threshold)

    counters.clear()
    x = logits.clone().requires_grad_()
    lp = torch.compile(logprob, backend="inductor", fullgraph=True)(x, targets, threshold)
    (grad,) = torch.autograd.grad(lp.sum(), x)
    inductor = counters["inductor"]
    assert inductor["fxgraph_cache_bypass"] == 0
    # the forward and the backward graph, compiled and stored or read from the cache
    assert inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"] == 2

    want = _reference(logits, targets, threshold)
    assert want[2] < -9000 and want.isinf().tolist() == [False, False, False, True, False, False]
    torch.testing.assert_close(lp.double(), want, **close(torch.bfloat16, "vs_torch"))
    ref = logits.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(_reference(ref, targets, threshold).sum(), ref)
    torch.testing.assert_close(grad.double(), want_grad, **close(torch.bfloat16, "same"))  # the gradient is bf16
