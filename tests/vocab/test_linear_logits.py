"""`LinearLogits` (hidden states + LM head) in place of logits: the same losses, metrics and
gradients (w.r.t. hidden states, weight, bias) through every input type and wrapper — mixed
dtypes under autocast included, refused outside it as `linear` refuses them — no `[N, V]`
tensor at any point, at most 16 chunks whatever the chunk size, clear errors where logits
are needed, and one graph."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import CASES, VOCAB, assert_metrics_close, boundaries, globals_for, make_batch
from tolerances import close

from compiled_loss.loss_functions import MseValueLossFn, NLLLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.packing import BucketGrid
from compiled_loss.vocab import LinearLogits, token_logprobs, vocab_reduce
from compiled_loss.wrapper import (
    DraftLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

H = 8
LENGTHS, PADS, WIDTH = [5, 3, 6, 2], [1, 0, 2, 0], 7
LOGPROB_CASES = [c for c in CASES if c.logit_width == VOCAB and not c.name.startswith("opd_full")]


def _head(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(VOCAB, H, generator=g) / 2).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=g).to(dtype).requires_grad_()
    return w, b


def _packed_hidden(h: torch.Tensor, tokens: int, cu_padded, seed: int) -> torch.Tensor:
    """Row i's hidden states at its padded offset; every other slot random (it must not matter)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(1, tokens, H, generator=g).to(h.dtype)
    for i, length in enumerate(LENGTHS):
        packed[0, cu_padded[i] : cu_padded[i] + length] = h[i, :length].detach()
    return packed.requires_grad_()


def _loss_and_grads(call, logits, params):
    loss, metrics = call(logits)
    return loss, metrics, torch.autograd.grad(loss, params)


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], **close(torch.float32, "fused"))
    assert_metrics_close(got[1], want[1], **close(torch.float32, "fused"))
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, **close(torch.float32, "fused_grad"))


@pytest.mark.parametrize("wrapper", ["unpacked", "per_sequence", "fused"])
@pytest.mark.parametrize("case", LOGPROB_CASES, ids=[c.name for c in LOGPROB_CASES])
def test_every_loss_and_wrapper_equals_the_logits_path(case, wrapper):
    loss_fn = case.make_loss()
    data, _ = make_batch(case, LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    w, b = _head(1)
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    if wrapper == "unpacked":

        def call(logits):
            return wrap_loss_fn_with_input_preparation(
                logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=case.prepare(packed=False)
            )
    else:
        cu, cup = boundaries(LENGTHS, PADS)
        cls = SequencePackingFusionLossWrapper if wrapper == "fused" else SequencePackingLossWrapper
        wrapped = cls(
            loss_fn, case.prepare(packed=wrapper == "fused"), cu, cup, bucket=BucketGrid(tokens=16, rows=2, width=8)
        )
        h = _packed_hidden(h, wrapped.layout.tokens, cup, 3)

        def call(logits):
            return wrapped(logits, data, gs, gt)

    params = (h, w, b)
    want = _loss_and_grads(call, torch.nn.functional.linear(h, w, b), params)
    got = _loss_and_grads(call, LinearLogits(h, w, b), params)
    _assert_same(got, want)


def test_bf16_stays_within_the_documented_tolerance():
    """bf16 hidden states and head: the logits are the same bf16 products (the LM head's
    own dtype), reduced in fp32 both ways; loss within 1e-3 relative, gradients within
    bf16 rounding (2e-2)."""
    case = next(c for c in CASES if c.name == "grpo")
    loss_fn = case.make_loss()
    data, _ = make_batch(case, LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    w, b = _head(1, torch.bfloat16)
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()

    def call(logits):
        return wrap_loss_fn_with_input_preparation(logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=prepare_loss_input)

    want = _loss_and_grads(call, torch.nn.functional.linear(h, w, b), (h, w, b))
    got = _loss_and_grads(call, LinearLogits(h, w, b), (h, w, b))
    torch.testing.assert_close(got[0], want[0], **close(torch.bfloat16, "fused"))
    for a, c in zip(got[2], want[2]):
        torch.testing.assert_close(a.float(), c.float(), **close(torch.bfloat16, "fused_grad"))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_draft_teacher_from_the_lm_head(packed):
    """DraftLossWrapper: the DRAFT teacher (policy logits shifted left, mapped to the draft
    vocabulary) from the draft vocabulary's rows of the LM head, beside an NLL policy
    loss from the same LinearLogits: the same loss and gradients."""
    data, _ = make_batch(CASES[0], LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    w, b = _head(1)
    d2t = torch.tensor([0, 2, 3, 3, 5, 7])  # draft i -> target i + d2t[i]
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    if packed:
        cu, cup = boundaries(LENGTHS, PADS)
        grid = BucketGrid(tokens=16, rows=2, width=8)
        policy = SequencePackingFusionLossWrapper(NLLLossFn(), prepare_packed_loss_input, cu, cup, bucket=grid)
        h = _packed_hidden(h, policy.layout.tokens, cup, 3)
        student = torch.randn(*h.shape[:2], len(d2t), generator=torch.Generator().manual_seed(4), requires_grad=True)
        wrapper = DraftLossWrapper(
            policy,
            None,
            data,
            loss_weight=0.5,
            cu_seqlens_q=cu,
            cu_seqlens_q_padded=cup,
            d2t=d2t,
            student_logits=student,
            bucket=grid,
        )
    else:
        policy = functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn(), prepare_fn=prepare_loss_input
        )
        student = torch.randn(*h.shape[:2], len(d2t), generator=torch.Generator().manual_seed(4), requires_grad=True)
        data = {**data, "student_logits": student}
        wrapper = DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=d2t), data, loss_weight=0.5)
    params = (h, w, b, student)

    def call(logits):
        return wrapper(logits, data, gs, gt)

    want = _loss_and_grads(call, torch.nn.functional.linear(h, w, b), params)
    got = _loss_and_grads(call, LinearLogits(h, w, b), params)
    assert got[1]["draft_loss"] > 0
    _assert_same(got, want)


def test_no_logits_sized_tensor_exists():
    """Forward and backward through the fused wrapper with 4-row chunks: no tensor of
    `[T, V]` (or more) elements is ever produced, while the logits path produces them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    vocab, tokens = 512, 64
    g = torch.Generator().manual_seed(0)
    lengths, pads = [20, 30, 14], [0, 0, 0]
    cu, cup = boundaries(lengths, pads)
    data = {
        "input_ids": torch.randint(0, vocab, (3, 30), generator=g),
        "token_mask": (torch.arange(30)[None] < torch.tensor(lengths)[:, None]).float(),
        "sample_mask": torch.ones(3),
        "advantages": torch.randn(3, 30, generator=g),
        "prev_logprobs": -torch.rand(3, 30, generator=g),
        "generation_logprobs": -torch.rand(3, 30, generator=g),
        "reference_policy_logprobs": -torch.rand(3, 30, generator=g),
    }
    gs, gt = globals_for(data)
    from compiled_loss.loss_functions import ClippedPGLossFn

    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    wrapper = SequencePackingFusionLossWrapper(
        loss_fn, lambda **kw: prepare_packed_loss_input(**kw, chunk_size=4), cu, cup
    )
    h = torch.randn(1, tokens, H, generator=g, requires_grad=True)
    w = torch.randn(vocab, H, generator=g, requires_grad=True)
    largest = {}
    for name, make in (("linear", lambda: LinearLogits(h, w)), ("logits", lambda: torch.nn.functional.linear(h, w))):
        mode = Largest()
        with mode:
            loss, _ = wrapper(make(), data, gs, gt)
            loss.backward()
        largest[name] = mode.numel
    assert largest["logits"] >= tokens * vocab
    assert largest["linear"] <= max(vocab * H, 4 * vocab, tokens * H) < tokens * vocab


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_top_k_filtering_keeps_the_boundary_token(chunk_size):
    """Thresholds come from the very logits they filter (a recomputed chunk may differ in
    the last bit): with top_k=1 the target at each row's argmax keeps log-prob 0 — never
    -inf or NaN — whatever the chunking, and the top-k/top-p log-probs equal the dense ones."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, H, generator=g), torch.randn(VOCAB, H, generator=g)
    argmax = torch.nn.functional.linear(h, w).argmax(-1)
    lp = token_logprobs(LinearLogits(h, w), argmax, top_k_top_p=(1, 1.0), chunk_size=chunk_size)
    assert torch.equal(lp, torch.zeros(37))
    targets = torch.randint(0, VOCAB, (37,), generator=g)
    for top_k, top_p in ((3, 1.0), (0, 0.8), (5, 0.7)):
        want = token_logprobs(torch.nn.functional.linear(h, w), targets, top_k_top_p=(top_k, top_p))
        got = token_logprobs(LinearLogits(h, w), targets, top_k_top_p=(top_k, top_p), chunk_size=chunk_size)
        torch.testing.assert_close(got, want)


def test_where_the_logits_themselves_are_needed_it_says_so():
    h, w = torch.randn(2, 4, H), torch.randn(VOCAB, H)
    data = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "token_mask": torch.ones(2, 4),
        "sample_mask": torch.ones(2),
    }
    with pytest.raises(ValueError, match="MseValueLossFn \\(a LOGIT loss\\) reads the logits themselves"):
        prepare_loss_input(LinearLogits(h, w), data, MseValueLossFn())
    with pytest.raises(ValueError, match="use_fused_linear_logprobs the logits argument holds next-token log-probs"):
        prepare_loss_input(LinearLogits(h, w), data, NLLLossFn(use_fused_linear_logprobs=True))
    with pytest.raises(
        ValueError,
        match=r"hidden must be \[..., H\] and weight \[V, H\] with the same H, got "
        r"\(2, 4, 8\) and \(16, 5\)",
    ):
        LinearLogits(h, torch.randn(VOCAB, 5))
    with pytest.raises(ValueError, match=r"bias must be \[16\], got \(3,\)"):
        LinearLogits(h, w, torch.randn(3))
    with pytest.raises(ValueError, match=r"linear_vocab_reduce: hidden must be \[N, H\], got \(2, 4, 8\)"):
        vocab_reduce(LinearLogits(h, w))
    with pytest.raises(ValueError, match="LinearLogits filter with top_k_top_p=\\(top_k, top_p\\), not a threshold"):
        vocab_reduce(LinearLogits(h[0], w), threshold=torch.zeros(4))


@pytest.mark.slow
def test_one_graph_when_compiled_and_when_passed_into_a_compiled_loss():
    """Built inside the compiled region or handed to it (DDP keeps the model outside):
    fullgraph tracing, no graph break, values equal to eager."""
    case = next(c for c in CASES if c.name == "grpo_topk_topp")
    loss_fn = case.make_loss()
    data, _ = make_batch(case, LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    cu, cup = boundaries(LENGTHS, PADS)
    wrapper = SequencePackingFusionLossWrapper(
        loss_fn, case.prepare(packed=True), cu, cup, bucket=BucketGrid(tokens=16, rows=2, width=8)
    )
    w, b = _head(1)
    h = _packed_hidden(torch.randn(len(LENGTHS), WIDTH, H), wrapper.layout.tokens, cup, 3)

    def inside(hidden, weight, bias):
        return wrapper(LinearLogits(hidden, weight, bias), data, gs, gt)

    def handed(logits):
        return wrapper(logits, data, gs, gt)

    want = wrapper(LinearLogits(h, w, b), data, gs, gt)[0]
    torch._dynamo.reset()
    got_inside = torch.compile(inside, backend="aot_eager", fullgraph=True)(h, w, b)[0]
    got_handed = torch.compile(handed, backend="aot_eager", fullgraph=True)(LinearLogits(h, w, b))[0]
    torch.testing.assert_close(got_inside, want)
    torch.testing.assert_close(got_handed, want)
    for g_want, g_got in zip(torch.autograd.grad(want, (h, w, b)), torch.autograd.grad(got_handed, (h, w, b))):
        torch.testing.assert_close(g_got, g_want, **close(torch.float32, "compiled"))


@pytest.mark.parametrize("wrapper", ["unpacked", "fused"])
def test_autocast_mixed_dtypes_equal_the_dense_path(wrapper):
    """bf16 hidden states and an fp32 head and bias under `torch.autocast` (the loss computed
    there, the backward after it): the logits are the autocast dtype's products both ways,
    and the loss, metrics and every gradient — each in its own input's dtype (bf16 for the
    hidden states, fp32 for the head) — equal the dense `linear` path's."""
    case = next(c for c in CASES if c.name == "grpo")
    loss_fn = case.make_loss()
    data, _ = make_batch(case, LENGTHS, WIDTH, 0)
    gs, gt = globals_for(data)
    w, b = _head(1)
    h = torch.randn(len(LENGTHS), WIDTH, H, generator=torch.Generator().manual_seed(2))
    if wrapper == "unpacked":

        def call(logits):
            return wrap_loss_fn_with_input_preparation(
                logits, data, gs, gt, loss_fn=loss_fn, prepare_fn=prepare_loss_input
            )
    else:
        cu, cup = boundaries(LENGTHS, PADS)
        wrapped = SequencePackingFusionLossWrapper(
            loss_fn, prepare_packed_loss_input, cu, cup, bucket=BucketGrid(tokens=16, rows=2, width=8)
        )
        h = _packed_hidden(h, wrapped.layout.tokens, cup, 3).detach()

        def call(logits):
            return wrapped(logits, data, gs, gt)

    h = h.bfloat16().requires_grad_()
    results = {}
    for name, make in (("dense", torch.nn.functional.linear), ("linear", LinearLogits)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, metrics = call(make(h, w, b))
        results[name] = loss, metrics, torch.autograd.grad(loss, (h, w, b))
    want, got = results["dense"], results["linear"]
    assert [g.dtype for g in got[2]] == [g.dtype for g in want[2]] == [torch.bfloat16, torch.float32, torch.float32]
    torch.testing.assert_close(got[0], want[0], **close(torch.bfloat16, "fused"))
    assert_metrics_close(got[1], want[1], **close(torch.bfloat16, "fused"))
    for a, c in zip(got[2], want[2]):
        torch.testing.assert_close(a.float(), c.float(), **close(torch.bfloat16, "fused_grad"))


def test_mixed_dtypes_outside_autocast_are_refused_as_linear_refuses_them():
    """Outside autocast the dense `linear` refuses bf16 hidden states with an fp32 head, and so
    does `LinearLogits`, when it is built (not in a backward); `dtype=` chooses one."""
    h, w = torch.randn(3, H, dtype=torch.bfloat16), torch.randn(VOCAB, H)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.nn.functional.linear(h, w)
    with pytest.raises(TypeError) as error:
        LinearLogits(h, w)
    assert str(error.value) == (
        "LinearLogits: hidden (torch.bfloat16), weight (torch.float32) and bias (None) must share one dtype outside "
        "torch.autocast, as torch.nn.functional.linear requires: build it inside the autocast region, or pass dtype="
    )
    h32 = h.float().requires_grad_()
    lp = token_logprobs(LinearLogits(h32, w, dtype=torch.bfloat16), torch.arange(3))
    torch.testing.assert_close(
        lp, token_logprobs(torch.nn.functional.linear(h32.bfloat16(), w.bfloat16()), torch.arange(3))
    )
    assert torch.autograd.grad(lp.sum(), h32)[0].dtype == torch.float32


def test_a_small_chunk_size_is_raised_to_at_most_16_chunks(monkeypatch):
    """Thin chunks starve the matmuls, so a chunk size is raised to N / 16 rows
    (and the backward's vocabulary column chunks to V / 16 columns): `chunk_size=1` over 100
    rows and 40 ids projects 15 row chunks of 7 rows forward and 14 column chunks of 3 ids
    backward (15 row chunks with top-k), where it made 100 and 40. The values are the
    default chunking's."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(100, H, generator=g, requires_grad=True), torch.randn(40, H, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (100,), generator=g)
    linear, shapes = torch.nn.functional.linear, []
    monkeypatch.setattr(
        torch.nn.functional,
        "linear",
        lambda x, weight, bias=None: shapes.append((x.shape[0], weight.shape[0])) or linear(x, weight, bias),
    )
    for top_k_top_p, backward in ((None, [(100, 3)] * 13 + [(100, 1)]), ((5, 1.0), [(7, 40)] * 14 + [(2, 40)])):
        want = token_logprobs(LinearLogits(h, w), targets, top_k_top_p=top_k_top_p)
        want_grads = torch.autograd.grad(want.sum(), (h, w))
        shapes.clear()
        got = token_logprobs(LinearLogits(h, w), targets, top_k_top_p=top_k_top_p, chunk_size=1)
        assert shapes == [(7, 40)] * 14 + [(2, 40)]
        shapes.clear()
        got_grads = torch.autograd.grad(got.sum(), (h, w))
        assert shapes == backward
        torch.testing.assert_close(got, want)
        for a, c in zip(got_grads, want_grads):
            torch.testing.assert_close(a, c)
