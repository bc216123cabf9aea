"""A model's final-logit transform on the fused LM head: `LinearLogits(..., softcap=c)`
(Gemma's `final_logit_softcapping`) divided by a temperature gives, for every log-prob loss
and wrapper, the loss, metrics and gradients (hidden states, weight, bias) of the dense
logits `c · tanh((h Wᵀ + b) / c) / T` — the recomputing backward (coupled losses, top-k /
top-p) and the gradient in the forward (token-separable losses, fused packing) alike,
eager and compiled."""

from __future__ import annotations

import pytest
import torch
from cases import CASES, VOCAB, assert_metrics_close, boundaries, globals_for, make_batch
from tolerances import close

from compiled_loss.packing import BucketGrid
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

H = 8
LENGTHS, PADS, WIDTH = [5, 3, 6, 2], [1, 0, 2, 0], 7
SOFTCAP, TEMPERATURE = 2.5, 0.7  # logits of a few units: the tanh bends them
LOGPROB_CASES = [c for c in CASES if c.logit_width == VOCAB and not c.name.startswith("opd_full")]


def _params(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w = (2 * torch.randn(VOCAB, H, generator=g)).requires_grad_()
    b = torch.randn(VOCAB, generator=g).requires_grad_()
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=g, requires_grad=True)
    return h, w, b


def _dense(h, w, b):
    return torch.tanh(torch.nn.functional.linear(h, w, b) / SOFTCAP) * SOFTCAP / TEMPERATURE


def _fused(h, w, b):
    return LinearLogits(h, w, b, softcap=SOFTCAP) / TEMPERATURE


def _results(call, logits_fn, params):
    loss, metrics = call(logits_fn(*params))
    return loss.detach(), metrics, torch.autograd.grad(3 * loss, params)


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], **close(torch.float32, "fused"))
    assert_metrics_close(got[1], want[1], **close(torch.float32, "fused"))
    for a, c in zip(got[2], want[2]):
        torch.testing.assert_close(a, c, **close(torch.float32, "fused"))


def _call(case, packed: bool, h):
    loss_fn = case.make_loss()
    data, _ = make_batch(case, LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    if not packed:
        return h, lambda logits: wrap_loss_fn_with_input_preparation(
            logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=case.prepare(packed=False)
        )
    cu, cup = boundaries(LENGTHS, PADS)
    wrapped = SequencePackingFusionLossWrapper(
        loss_fn, case.prepare(packed=True), cu, cup, bucket=BucketGrid(tokens=16, rows=2, width=8)
    )
    packed_h = torch.zeros(1, wrapped.layout.tokens, H)
    for i, length in enumerate(LENGTHS):
        packed_h[0, cup[i] : cup[i] + length] = h[i, :length].detach()
    return packed_h.requires_grad_(), lambda logits: wrapped(logits, data, gs, gt)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "fused"])
@pytest.mark.parametrize("case", LOGPROB_CASES, ids=[c.name for c in LOGPROB_CASES])
def test_a_softcapped_head_equals_the_dense_softcapped_logits(case, packed):
    h, w, b = _params()
    h, call = _call(case, packed, h)
    _assert_same(_results(call, _fused, (h, w, b)), _results(call, _dense, (h, w, b)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "grpo_topk_topp"])
def test_compiled_it_is_one_graph_with_the_same_numbers(name):
    case = next(c for c in CASES if c.name == name)
    h, w, b = _params()
    h, call = _call(case, True, h)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *p: call(_fused(*p)), backend="aot_eager", fullgraph=True)
    loss, metrics = compiled(h, w, b)
    got = (loss.detach(), metrics, torch.autograd.grad(3 * loss, (h, w, b)))
    _assert_same(got, _results(call, _dense, (h, w, b)))


def test_the_transform_is_checked_and_kept_through_a_temperature():
    h, w, b = _params()
    capped = LinearLogits(h, w, b, softcap=SOFTCAP) / 2.0
    assert (capped.softcap, capped.scale, capped.hidden is h) == (SOFTCAP, 0.5, True)
    torch.testing.assert_close(capped.logits(), torch.tanh((h @ w.T + b) / SOFTCAP) * SOFTCAP / 2)
    for bad in (0.0, -1.0, float("inf"), "3"):
        with pytest.raises(ValueError, match=r"LinearLogits: softcap must be a finite float > 0 or None, got"):
            LinearLogits(h, w, b, softcap=bad)
    with pytest.raises(ValueError, match=r"LinearLogits: scale must be a finite float > 0, got nan"):
        LinearLogits(h, w, b, scale=float("nan"))
