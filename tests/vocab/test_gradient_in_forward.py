"""The gradient in the forward (`linear_vocab_gradient`): a token-separable loss from
`LinearLogits` runs three matmuls per chunk and none in the backward, with the values,
metrics and gradients of the dense logits path — eager and compiled, unpacked and packed,
scaled by whatever multiplies the loss — while a coupled loss keeps the recomputing path.
Every LOGPROB loss × wrapper is compared with the dense path in `test_linear_logits.py`."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import CASES, assert_metrics_close, boundaries, globals_for, make_batch
from tolerances import close
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_loss.interfaces import InputSpec, LossInputType
from compiled_loss.loss_functions import ClippedPGLossFn, DPOLossFn, NLLLossFn
from compiled_loss.packing import BucketGrid
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

H = 8
LENGTHS, PADS, WIDTH = [5, 3, 6, 2], [1, 0, 2, 0], 7
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def _case(name):
    return next(c for c in CASES if c.name == name)


def _inputs(case, seed=0):
    data, _ = make_batch(case, LENGTHS, WIDTH, seed)
    g = torch.Generator().manual_seed(1)
    vocab = data["input_ids"].max().item() + 5
    w = (torch.randn(vocab, H, generator=g) / 2).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_()
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=g, requires_grad=True)
    return data, h, w, b


def _unpacked(case, chunk_size=None):
    loss_fn = case.make_loss()

    def call(logits, data, gs, gt):
        prepare = case.prepare(packed=False)
        if chunk_size is not None:  # a partial of the seed's preparation: the library's own (a gradient in the forward)
            prepare = functools.partial(prepare, chunk_size=chunk_size)

        return wrap_loss_fn_with_input_preparation(logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=prepare)

    return call


@pytest.mark.parametrize("name, separable", [("grpo", True), ("nll", True), ("gspo_tis", False), ("seq_filter", False)])
def test_three_matmuls_per_chunk_and_none_in_the_backward(name, separable):
    """14 rows in 4-row chunks (the last padded): 4 chunks × 3 matmuls in the forward, 0 in
    the backward; a coupled loss projects forward (4) and recomputes backward."""
    case = _case(name)
    assert case.make_loss().input_spec.token_separable is separable
    data, h, w, b = _inputs(case)
    h = h[:2].detach().requires_grad_()  # 2 rows × 7 positions = 14 rows
    data = {k: v[:2] if v.dim() and v.shape[0] == len(LENGTHS) else v for k, v in data.items()}
    gs, gt = globals_for(data)
    call = _unpacked(case, chunk_size=4)
    forward, backward = _Matmuls(), _Matmuls()
    with forward:
        loss, _ = call(LinearLogits(h, w, b), data, gs, gt)
    with backward:
        loss.backward()
    if separable:
        assert (forward.count, backward.count) == (4 * 3, 0)
    else:
        assert forward.count == 4 and backward.count > 0


@pytest.mark.parametrize("name", ["grpo", "dual_clip_vapo", "nll"])
def test_compiled_equals_eager_and_the_dense_path_packed_with_the_loss_scaled(name):
    """Fused packing, compiled in one graph (aot_eager): loss, metrics and the gradients of
    hidden states, weight and bias equal the dense logits' (fp32, 1e-5) with the loss
    multiplied by 3 and another term of the hidden states beside it."""
    case = _case(name)
    data, h0, w, b = _inputs(case)
    gs, gt = globals_for(data)
    cu, cup = boundaries(LENGTHS, PADS)
    wrapped = SequencePackingFusionLossWrapper(
        case.make_loss(), case.prepare(packed=True), cu, cup, bucket=BucketGrid(tokens=16, rows=2, width=8)
    )
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(1, wrapped.layout.tokens, H, generator=g)
    for i, length in enumerate(LENGTHS):
        packed[0, cup[i] : cup[i] + length] = h0[i, :length].detach()
    h = packed.requires_grad_()

    def fused(hidden, weight, bias):
        return wrapped(LinearLogits(hidden, weight, bias), data, gs, gt)

    def dense(hidden, weight, bias):
        return wrapped(torch.nn.functional.linear(hidden, weight, bias), data, gs, gt)

    results = {}
    torch._dynamo.reset()
    for label, fn in (
        ("dense", dense),
        ("eager", fused),
        ("compiled", torch.compile(fused, backend="aot_eager", fullgraph=True)),
    ):
        loss, metrics = fn(h, w, b)
        total = 3 * loss + (h**2).sum()
        results[label] = (loss.detach(), metrics, torch.autograd.grad(total, (h, w, b)))
    want = results["dense"]
    for label in ("eager", "compiled"):
        got = results[label]
        torch.testing.assert_close(got[0], want[0], **close(torch.float32, "fused"))
        assert_metrics_close(got[1], want[1], **close(torch.float32, "fused"))
        for a, c in zip(got[2], want[2]):
            torch.testing.assert_close(a, c, **close(torch.float32, "fused"))


def test_which_losses_declare_themselves_token_separable():
    assert ClippedPGLossFn({}).input_spec.token_separable
    assert ClippedPGLossFn({"token_level_loss": False}).input_spec.token_separable  # per-sequence means of masks
    assert not ClippedPGLossFn(
        {"sequence_level_importance_ratios": True, "token_level_loss": False}
    ).input_spec.token_separable
    assert NLLLossFn().input_spec.token_separable
    assert not DPOLossFn({}).input_spec.token_separable  # sums over each sequence inside a sigmoid
    assert not InputSpec(LossInputType.LOGPROB).token_separable  # a loss that does not say so
