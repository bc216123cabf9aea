"""`compile_loss`: a user's own compiled loss call with dynamic shapes holds to one graph
with no host sync, because the loss configs' floats stay constants."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from cases import CASE_BY_NAME, assert_metrics_close, boundaries, globals_for, make_batch, pack_logits
from tolerances import close

import compiled_loss.compile
import compiled_loss.train
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder, compile_loss
from compiled_loss.wrapper import SequencePackingFusionLossWrapper

GRPO = CASE_BY_NAME["grpo_topk_topp"]


def _call(wrapper, logits, data, gs, gt):
    return wrapper(logits, data, gs, gt)


def _packings(seed: int):
    rng = random.Random(seed)
    for i in range(3):  # three different buckets
        width = 6 + 5 * i
        lengths = [rng.randint(2, width) for _ in range(2 + i)]
        yield lengths, [rng.randint(0, 2) for _ in lengths], width


def _run(fn, lengths, pads, width, seed):
    data, logits = make_batch(GRPO, lengths, width, seed)
    cu, cup = boundaries(lengths, pads)
    wrapper = SequencePackingFusionLossWrapper(
        GRPO.make_loss(), GRPO.prepare(packed=True), cu, cup, bucket=BucketGrid(tokens=10, rows=2, width=4)
    )
    packed = pack_logits(logits, cu, cup, wrapper.layout.tokens, seed)
    loss, metrics = fn(wrapper, packed, wrapper.layout.pad_data(data), *globals_for(data))
    return loss, metrics, torch.autograd.grad(loss, packed)[0]


def _compiled_over_buckets(fn, recorder):
    for seed, packing in enumerate(_packings(0)):
        got = _run(fn, *packing, seed)
        want = _run(_call, *packing, seed)
        torch.testing.assert_close(got[0], want[0], **close(torch.float32, "compiled"))
        assert_metrics_close(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], **close(torch.float32, "compiled"))
    return recorder.report


@pytest.mark.slow
def test_dynamic_shapes_one_graph_no_sync():
    torch._dynamo.reset()
    recorder = CompileRecorder("aot_eager")
    report = _compiled_over_buckets(compile_loss(_call, recorder=recorder, fullgraph=True, dynamic=True), recorder)
    assert (report.compiles, report.problems()) == (1, [])


@pytest.mark.slow
def test_without_it_the_config_floats_become_graph_inputs_read_back_on_the_host():
    torch._dynamo.reset()
    recorder = CompileRecorder("aot_eager")
    report = _compiled_over_buckets(recorder.compile(_call, fullgraph=True, dynamic=True), recorder)
    assert any("host sync" in p for p in report.problems())


def test_one_definition_under_both_import_paths():
    """`compiled_loss.compile` (layer 0, which the losses import) defines `compile_loss`;
    `compiled_loss.train` re-exports it, with no module of its own."""
    assert compiled_loss.train.compile_loss is compiled_loss.compile.compile_loss is compile_loss
    assert importlib.util.find_spec("compiled_loss.train.compile") is None
