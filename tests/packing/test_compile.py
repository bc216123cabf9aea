"""Compile hygiene: every wrapper × loss traces as ONE graph with no break, no in-graph
host sync and no eager fallback; packings in one bucket share one compile; compiled and
eager results agree. Dynamo tracing is what breaks graphs, so most tests use the cheap
`aot_eager` backend (it also traces the backward); Inductor runs on a representative case.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from cases import CASE_BY_NAME, CASES, assert_metrics_close, boundaries, globals_for, make_batch, pack_logits
from tolerances import close

from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import (
    DraftLossWrapper,
    DraftRuntimeLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

pytestmark = pytest.mark.slow  # compiles every loss and wrapper

GRID = BucketGrid(tokens=64, rows=4, width=16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def call_wrapper(wrapper, logits, data, gs, gt):
    return wrapper(logits, data, gs, gt)


def random_packing(rng: random.Random, pairs: bool, max_rows: int = 4, max_width: int = 16):
    rows = 2 * rng.randint(1, max_rows // 2) if pairs else rng.randint(1, max_rows)
    width = rng.randint(4, max_width)
    lengths = [rng.randint(2, width) for _ in range(rows)]
    pads = [rng.randint(0, 2) for _ in range(rows)]
    return lengths, pads, width


def run_packed(case, wrapper_cls, fn, lengths, pads, width, seed, grid=GRID):
    """One packed micro-batch through `fn` (compiled or eager): loss, metrics, grad."""
    fused = wrapper_cls is SequencePackingFusionLossWrapper
    data, logits = make_batch(case, lengths, width, seed)
    gs, gt = globals_for(data)
    cu, cup = boundaries(lengths, pads)
    wrapper = wrapper_cls(case.make_loss(), case.prepare(packed=fused), cu, cup, bucket=grid)
    packed = pack_logits(logits, cu, cup, wrapper.layout.tokens, seed)
    loss, metrics = fn(wrapper, packed, wrapper.layout.pad_data(data), gs, gt)
    (grad,) = torch.autograd.grad(loss, packed)
    return loss, metrics, grad


@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_wrapper_compiles_to_one_clean_graph(case, wrapper_cls):
    recorder = CompileRecorder("aot_eager")
    compiled = recorder.compile(call_wrapper, fullgraph=True)
    rng = random.Random(case.name)
    for seed in range(3):  # three packings in one bucket
        packing = random_packing(rng, case.pairs)
        got = run_packed(case, wrapper_cls, compiled, *packing, seed)
        want = run_packed(case, wrapper_cls, call_wrapper, *packing, seed)
        torch.testing.assert_close(got[0], want[0], **close(torch.float32, "compiled"))
        assert_metrics_close(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], **close(torch.float32, "compiled"))
    report = recorder.report
    assert report.problems() == []
    assert (report.compiles, len(report.graphs), len(report.recompiles)) == (1, 1, 0)


@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
def test_fifty_packings_in_one_bucket_compile_once(wrapper_cls):
    case = CASE_BY_NAME["grpo"]
    recorder = CompileRecorder("aot_eager")
    compiled = recorder.compile(call_wrapper, fullgraph=True)
    rng = random.Random(50)
    run_packed(case, wrapper_cls, compiled, *random_packing(rng, False), 0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in range(1, 50):
            run_packed(case, wrapper_cls, compiled, *random_packing(rng, False), seed)
    assert recorder.report.calls == 50
    assert (recorder.report.compiles, recorder.report.problems()) == (1, [])


def test_inductor_fused_grpo_one_compile_matches_eager():
    case = CASE_BY_NAME["grpo_topk_topp"]
    recorder = CompileRecorder("inductor")
    compiled = recorder.compile(call_wrapper, fullgraph=True)
    rng = random.Random(7)
    for seed in range(4):
        packing = random_packing(rng, False)
        got = run_packed(case, SequencePackingFusionLossWrapper, compiled, *packing, seed)
        want = run_packed(case, SequencePackingFusionLossWrapper, call_wrapper, *packing, seed)
        torch.testing.assert_close(got[0], want[0], **close(torch.float32, "compiled"))
        assert_metrics_close(got[1], want[1], **close(torch.float32, "compiled"))
        torch.testing.assert_close(got[2], want[2], **close(torch.float32, "accumulated"))
    assert (recorder.report.compiles, recorder.report.problems()) == (1, [])


class _ToyRuntime:
    """A drafter runtime: loss = weighted sum of its own parameter times the prepared
    log-probs' mean (enough to have a real graph and gradient)."""

    loss_weight = 0.5

    def __init__(self):
        self.param = torch.tensor(2.0, requires_grad=True)

    def compute_loss(self, prepared):
        value = self.param * prepared["token_mask"].float().mean()
        return value, {"draft_loss": value.detach()}


def test_draft_wrappers_compile_to_one_clean_graph():
    case = CASE_BY_NAME["grpo"]
    lengths, pads, width = [5, 3, 4], [3, 1, 0], 6
    data, logits = make_batch(case, lengths, width, seed=1)
    gs, gt = globals_for(data)
    cu, cup = boundaries(lengths, pads)
    policy = SequencePackingFusionLossWrapper(case.make_loss(), case.prepare(packed=True), cu, cup, bucket=GRID)
    tokens = policy.layout.tokens
    packed = pack_logits(logits, cu, cup, tokens, seed=1)
    d2t = torch.tensor([0, 2, 4, 5, 6, 6, 7])
    student = torch.randn(1, tokens, len(d2t), requires_grad=True)
    packed_draft = DraftLossWrapper(
        policy,
        None,
        None,
        loss_weight=0.3,
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cup,
        d2t=d2t,
        student_logits=student,
        bucket=GRID,
    )
    unpacked_draft = DraftLossWrapper(
        functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=case.make_loss(), prepare_fn=prepare_loss_input),
        functools.partial(prepare_loss_input, d2t=d2t),
        None,
        loss_weight=0.3,
    )
    unpacked_data = {**data, "student_logits": torch.randn(len(lengths), width, len(d2t))}
    runtime = DraftRuntimeLossWrapper(case.make_loss(), prepare_loss_input, _ToyRuntime())
    for wrapper, logits_in, data_in in (
        (packed_draft, packed, policy.layout.pad_data(data)),
        (unpacked_draft, logits, unpacked_data),
        (runtime, logits, data),
    ):
        torch._dynamo.reset()
        recorder = CompileRecorder("aot_eager")
        compiled = recorder.compile(call_wrapper, fullgraph=True)
        got_loss, got_metrics = compiled(wrapper, logits_in, data_in, gs, gt)
        want_loss, want_metrics = wrapper(logits_in, data_in, gs, gt)
        torch.testing.assert_close(got_loss, want_loss)
        assert_metrics_close(got_metrics, want_metrics)
        got_loss.backward()
        assert (recorder.report.compiles, recorder.report.problems()) == (1, [])


def test_recorder_reports_planted_sync_and_eager_fallback():
    """The recorder sees what fullgraph=True and Dynamo's break counter hide."""

    def with_item(x):
        n = int((x > 0).sum().item())
        return x[:n].sum()

    def loop_break(x, lens):
        out = []
        for length in lens:  # iterating a tensor: a break inside a loop skips the frame
            out.append(x[: int(length)].sum())
        return torch.stack(out)

    recorder = CompileRecorder("eager")
    recorder.compile(with_item, fullgraph=True)(torch.randn(8))
    assert any("host sync" in p and "item" in p for p in recorder.report.problems())

    torch._dynamo.reset()
    recorder = CompileRecorder("eager")
    recorder.compile(loop_break)(torch.randn(8), torch.tensor([2, 3]))
    assert recorder.report.eager_fallbacks and recorder.report.graphs == []
