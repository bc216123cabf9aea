"""Ray-style use: every loss object, config and wrapper round-trips through `pickle` and
`copy.deepcopy` and gives identical results after; a loss that compiles itself
(`enable_torch_compile`) never pickles its compiled function and compiles again, lazily,
after unpickling. Also `metrics_level="minimal"`: the reference's minimal metric set with
loss and gradients bit-identical to "full"."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle

import pytest
import torch
from cases import CASES, boundaries, globals_for, make_batch, pack_logits

from compiled_loss.compile import compile_loss
from compiled_loss.interfaces import MetricNormalizer
from compiled_loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import (
    DraftLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

LENGTHS, PADS, WIDTH = [6, 3, 8, 2], [2, 1, 0, 2], 8


def _round_trips(obj):
    return pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)


def _wrappers(case):
    cu, cup = boundaries(LENGTHS, PADS)
    loss_fn = case.make_loss()
    return {
        "unpacked": functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, prepare_fn=case.prepare(packed=False)
        ),
        "per_sequence": SequencePackingLossWrapper(loss_fn, case.prepare(packed=False), cu, cup),
        "fused": SequencePackingFusionLossWrapper(loss_fn, case.prepare(packed=True), cu, cup),
    }


def _call(which, wrapper, logits, data):
    cu, cup = boundaries(LENGTHS, PADS)
    if which != "unpacked":
        logits = pack_logits(logits, cu, cup, cup[-1], seed=3)
    logits = logits.detach().requires_grad_()
    loss, metrics = wrapper(logits, data, *globals_for(data))
    return loss, metrics, torch.autograd.grad(loss, logits)[0]


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert sorted(a[1]) == sorted(b[1])
    for key in a[1]:
        assert torch.equal(torch.as_tensor(a[1][key]), torch.as_tensor(b[1][key])), key
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_losses_configs_and_wrappers_round_trip(case):
    loss_fn = case.make_loss()
    for copied in _round_trips(loss_fn):
        assert copied == loss_fn
    cfg = getattr(loss_fn, "cfg", None)
    if cfg is not None:
        assert all(c == cfg for c in _round_trips(cfg))
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=1)
    for which, wrapper in _wrappers(case).items():
        want = _call(which, wrapper, logits, data)
        for copied in _round_trips(wrapper):
            _assert_same(_call(which, copied, logits, data), want)


def test_draft_wrappers_round_trip():
    case = next(c for c in CASES if c.name == "grpo")
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=2)
    cu, cup = boundaries(LENGTHS, PADS)
    d2t = torch.tensor([0, 1, 1, 3, 5, 5, 6, 8])
    student = torch.randn(len(LENGTHS), WIDTH, len(d2t))
    policy = functools.partial(
        wrap_loss_fn_with_input_preparation, loss_fn=case.make_loss(), prepare_fn=prepare_loss_input
    )
    unpacked = DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=d2t), None, 0.3)
    packed_policy = SequencePackingFusionLossWrapper(case.make_loss(), case.prepare(packed=True), cu, cup)
    packed = DraftLossWrapper(
        packed_policy,
        None,
        None,
        0.3,
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cup,
        d2t=d2t,
        student_logits=pack_logits(student, cu, cup, cup[-1], seed=4).detach(),
    )
    for which, wrapper, batch in (("unpacked", unpacked, {**data, "student_logits": student}), ("fused", packed, data)):
        want = _call(which, wrapper, logits, batch)
        for copied in _round_trips(wrapper):
            _assert_same(_call(which, copied, logits, batch), want)


def _self_compiling(compiled: bool) -> ClippedPGLossFn:
    return ClippedPGLossFn({"reference_policy_kl_penalty": 0.05, "enable_torch_compile": compiled})


def test_enable_torch_compile_compiles_lazily_and_never_pickles_the_compiled_function(monkeypatch):
    """The loss compiles its objective on the first call (counted through the recorder's
    backend), gives eager's values and gradients, pickles after that call without the
    compiled function, and the copy compiles its own on its first call."""
    import compiled_loss.losses.policy_gradient as pg

    compiles = []

    def recorded(fn, **kwargs):  # the project's compile_loss, through a recorder on aot_eager
        compiles.append(CompileRecorder("aot_eager"))
        return compile_loss(fn, recorder=compiles[-1], **kwargs)

    monkeypatch.setattr(pg, "compile_loss", recorded)
    torch._dynamo.reset()
    case = next(c for c in CASES if c.name == "grpo")
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=5)
    want = _call(
        "unpacked",
        _wrappers(dataclasses.replace(case, make_loss=lambda: _self_compiling(False)))["unpacked"],
        logits,
        data,
    )
    loss_fn = _self_compiling(True)
    wrapper = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, prepare_fn=prepare_loss_input)
    assert not compiles  # nothing compiles before the first call
    got = _call("unpacked", wrapper, logits, data)
    assert len(compiles) == 1 and compiles[0].report.compiles == 1 and not compiles[0].report.problems()
    torch.testing.assert_close(got[0], want[0])
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], msg=key)
    torch.testing.assert_close(got[2], want[2])
    blob = pickle.dumps(loss_fn)  # a compiled function does not pickle: it is left out
    copied = pickle.loads(blob)
    assert copied == loss_fn and copied._compiled is None and copy.deepcopy(loss_fn)._compiled is None
    again = _call(
        "unpacked",
        functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=copied, prepare_fn=prepare_loss_input),
        logits,
        data,
    )
    assert len(compiles) == 2
    torch.testing.assert_close(again[0], want[0])


MINIMAL_CASES = ["grpo", "gspo_tis", "cispo_icepop", "seq_filter", "dual_clip_vapo", "opd_full_logits"]


@pytest.mark.parametrize("name", MINIMAL_CASES)
@pytest.mark.parametrize("mode", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_minimal_metrics_level(name, mode):
    case = next(c for c in CASES if c.name == name)
    full = case.make_loss()
    minimal = dataclasses.replace(full, cfg=dataclasses.replace(full.cfg, metrics_level="minimal"))
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=6)
    results = []
    for loss_fn in (full, minimal):
        wrapper = SequencePackingFusionLossWrapper(loss_fn, case.prepare(packed=True), *boundaries(LENGTHS, PADS))
        if mode == "aot_eager":
            torch._dynamo.reset()
            recorder = CompileRecorder("aot_eager")
            wrapper = recorder.compile(wrapper, fullgraph=True)
        results.append(_call("fused", wrapper, logits, data))
    (loss_f, metrics_f, grad_f), (loss_m, metrics_m, grad_m) = results
    assert torch.equal(loss_m, loss_f) and torch.equal(grad_m, grad_f)  # bit-identical
    cfg = full.cfg
    keep = {"loss", "kl_penalty", "num_valid_samples"}
    if full.opd_full is None:
        keep.add("positive_nll_loss")
        if cfg.use_importance_sampling_correction:
            keep.add("sampling_importance_ratio")
        if cfg.truncated_importance_sampling_ratio is not None:
            keep.add("is_oob_ratio")
        if cfg.seq_logprob_error_in_loss:
            keep |= {
                "seq_logprob_error_valid_tokens",
                "seq_logprob_error_valid_seqs",
                "num_masked_seqs_by_logprob_error",
            }
    assert set(metrics_m) == keep
    for key in keep:
        assert torch.equal(metrics_m[key], metrics_f[key]), key
    assert set(minimal.metric_normalizations) == keep
    assert all(isinstance(v, MetricNormalizer) for v in minimal.metric_normalizations.values())


def test_metrics_level_is_checked():
    with pytest.raises(ValueError, match="metrics_level"):
        ClippedPGLossConfig(metrics_level="some")


def test_other_public_objects_round_trip():
    """Configs compare equal after the copy; objects holding tensors give the same results."""
    from compiled_loss.draft.dflash import DFlashConfig
    from compiled_loss.draft.eagle3 import Eagle3Config
    from compiled_loss.loss_functions import (
        DistillationLossConfig,
        DPOLossConfig,
        DraftCrossEntropyLossFn,
        MseValueLossConfig,
        OPDFullConfig,
        PreferenceLossFn,
    )
    from compiled_loss.loss_input import TrainingSamplingParams
    from compiled_loss.packing import BucketGrid, PackedLayout
    from compiled_loss.vocab import DraftVocab

    for obj in (
        DistillationLossConfig(kl_type="reverse"),
        DPOLossConfig(sft_loss_weight=0.5),
        MseValueLossConfig(),
        OPDFullConfig(chunk_size=4),
        TrainingSamplingParams(top_k=4, top_p=0.9),
        BucketGrid(tokens=64),
        Eagle3Config(),
        DFlashConfig(),
        PreferenceLossFn(),
        DraftCrossEntropyLossFn(token_chunk_size=3),
    ):
        assert all(copied == obj for copied in _round_trips(obj)), obj
    g = torch.Generator().manual_seed(9)
    teacher, student = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    mask, sm = torch.ones(2, 5), torch.ones(2)
    draft_ce = DraftCrossEntropyLossFn(token_chunk_size=3)
    want = draft_ce(teacher, student, mask, {"sample_mask": sm}, sm.sum(), mask.sum())
    for copied in _round_trips(draft_ce):
        assert torch.equal(copied(teacher, student, mask, {"sample_mask": sm}, sm.sum(), mask.sum()), want)
    vocab = DraftVocab.build(torch.tensor([0, 1, 1, 3]))
    for copied in _round_trips(vocab):
        assert torch.equal(copied.target_ids, vocab.target_ids) and copied.max_target == vocab.max_target
    layout = PackedLayout.build((0, 3, 7), (0, 4, 8), grid=BucketGrid(tokens=16, rows=4, width=8))
    x = torch.arange(16.0)
    for copied in _round_trips(layout):
        assert torch.equal(copied.unpack(x, 8), layout.unpack(x, 8))
