"""Refused inputs raise `ValueError` or `TypeError` (a `ConfigError` is a ValueError) whose
message names the offending argument — never a raw torch error (IndexError /
RuntimeError / KeyError) or an assert, and never silently accepted (DESIGN: Conventions)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import pytest
import torch
from reliability.oracle import FIXED, VOCAB, WRAPPERS, make_data

import compiled_loss.inputs as inputs
from compiled_loss.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    DPOLossFn,
    DraftCrossEntropyLossFn,
    MseValueLossConfig,
    MseValueLossFn,
    NLLLossFn,
    PreferenceLossFn,
)
from compiled_loss.loss_input import TrainingSamplingParams, prepare_loss_input, prepare_packed_loss_input
from compiled_loss.vocab import vocab_reduce
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation


def refusal(fn, *args, **kwargs) -> BaseException:
    """The exception `fn` raises; fails unless it is a ValueError / TypeError."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return e
    except Exception as e:  # noqa: BLE001 - a raw torch / Python error is the failure reported
        pytest.fail(f"raised {type(e).__name__}, not ValueError/TypeError: {e}")
    pytest.fail("accepted (no error raised)")


def assert_refused(fn, *args, names: str | tuple[str, ...], **kwargs) -> None:
    e = refusal(fn, *args, **kwargs)
    names = (names,) if isinstance(names, str) else names
    assert any(n in str(e) for n in names), f"{type(e).__name__} does not name {names}: {e}"


# ---------------------------------------------------------------------------------------
# chunk_size
# ---------------------------------------------------------------------------------------

BAD_CHUNKS = [0, -1, 2.5, "4", True]


def _nll_inputs():
    data = make_data("nll", 2, 4, seed=0)
    return torch.randn(2, 4, VOCAB), data


@pytest.mark.parametrize("chunk", BAD_CHUNKS, ids=repr)
@pytest.mark.parametrize("where", ["prepare_loss_input", "prepare_packed_loss_input", "vocab_reduce"])
def test_bad_chunk_size_refused(where, chunk):
    """chunk_size 0 / -1 / non-int: ValueError/TypeError naming chunk_size."""
    logits, data = _nll_inputs()
    if where == "prepare_loss_input":
        assert_refused(prepare_loss_input, logits, data, NLLLossFn(), chunk_size=chunk, names="chunk_size")
    elif where == "prepare_packed_loss_input":
        assert_refused(
            prepare_packed_loss_input,
            logits.reshape(1, 8, VOCAB),
            data,
            NLLLossFn(),
            (0, 4, 8),
            chunk_size=chunk,
            names="chunk_size",
        )
    else:
        assert_refused(
            vocab_reduce,
            logits.reshape(8, VOCAB),
            torch.zeros(8, 1, dtype=torch.long),
            chunk_size=chunk,
            names="chunk_size",
        )


# ---------------------------------------------------------------------------------------
# sequence boundaries
# ---------------------------------------------------------------------------------------

BAD_BOUNDARIES = {
    "None": None,
    "2-D tensor": torch.tensor([[0, 3], [3, 7]]),
    "2-D tuple": ((0, 3), (3, 7)),
    "float tuple": (0.0, 3.0, 7.0),
    "float tensor": torch.tensor([0.0, 3.0, 7.0]),
    "nan": (0, float("nan"), 7),
    "decreasing": (0, 7, 3),
    "not starting at 0": (1, 4, 7),
    "empty (B = 0)": (0,),
    "string": "0,3,7",
}
GOOD = (0, 3, 7)


def _packing_call(kind: str, cu, cup):
    logits = torch.randn(1, 9, VOCAB)
    data = make_data("nll", 2, 4, seed=0)
    if kind == "prepare_packed_loss_input":
        return lambda: prepare_packed_loss_input(logits, data, NLLLossFn(), cu, cup)
    wrapper_cls = {w.__name__: w for w in WRAPPERS}[kind]
    prepare = prepare_packed_loss_input if kind == "SequencePackingFusionLossWrapper" else prepare_loss_input
    return lambda: wrapper_cls(NLLLossFn(), prepare, cu, cup)(logits, data, torch.tensor(2.0), torch.tensor(4.0))


KINDS = [w.__name__ for w in WRAPPERS] + ["prepare_packed_loss_input"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", list(BAD_BOUNDARIES), ids=str)
def test_bad_cu_seqlens_refused(bad, kind):
    """Malformed cu_seqlens_q: ValueError/TypeError naming cu_seqlens_q."""
    assert_refused(_packing_call(kind, BAD_BOUNDARIES[bad], None), names="cu_seqlens_q")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "bad", [b for b in BAD_BOUNDARIES if b != "None"] + ["shorter than true lengths", "wrong count"], ids=str
)
def test_bad_cu_seqlens_padded_refused(bad, kind):
    """Malformed cu_seqlens_q_padded: ValueError/TypeError naming cu_seqlens_q_padded."""
    value = {"shorter than true lengths": (0, 2, 7), "wrong count": (0, 3, 7, 9)}.get(bad) or BAD_BOUNDARIES[bad]
    assert_refused(_packing_call(kind, GOOD, value), names="cu_seqlens_q_padded")


@pytest.mark.parametrize("kind", [w.__name__ for w in WRAPPERS])
def test_packed_logits_too_short_refused(kind):
    """Packed logits with fewer slots than the packing: ValueError naming next_token_logits."""
    data = make_data("nll", 2, 4, seed=0)
    wrapper_cls = {w.__name__: w for w in WRAPPERS}[kind]
    prepare = prepare_packed_loss_input if kind == "SequencePackingFusionLossWrapper" else prepare_loss_input
    wrapper = wrapper_cls(NLLLossFn(), prepare, (0, 3, 7), (0, 4, 9))
    assert_refused(
        wrapper, torch.randn(1, 8, VOCAB), data, torch.tensor(2.0), torch.tensor(4.0), names="next_token_logits"
    )


# ---------------------------------------------------------------------------------------
# loss configs: NaN / inf / negative / string in every field
# ---------------------------------------------------------------------------------------

CONFIGS = [
    (ClippedPGLossConfig, ClippedPGLossFn),
    (DPOLossConfig, DPOLossFn),
    (DistillationLossConfig, DistillationLossFn),
    (MseValueLossConfig, MseValueLossFn),
]


def _bad_values(annotation) -> dict[str, object]:
    """Values no field of this type may hold: NaN, ±inf, a negative number, a string."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    bad: dict[str, object] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "negative": -0.5}
    if typing.get_origin(base) is typing.Literal:
        bad["string"] = "bogus"
    elif base is bool:
        bad["string"] = "True"
        bad["negative"] = -1
    else:
        bad["string"] = "0.5"
    return bad


CONFIG_CASES = []
for _cfg_cls, _loss_cls in CONFIGS:
    _hints = typing.get_type_hints(_cfg_cls)
    for _field in dataclasses.fields(_cfg_cls):
        for _label, _value in _bad_values(_hints[_field.name]).items():
            CONFIG_CASES.append((_cfg_cls, _loss_cls, _field.name, _label, _value))


@pytest.mark.parametrize(
    "cfg_cls,loss_cls,field,label,value",
    CONFIG_CASES,
    ids=[f"{c.__name__}.{f}={label}" for c, _, f, label, _ in CONFIG_CASES],
)
def test_bad_config_value_refused(cfg_cls, loss_cls, field, label, value):
    """A NaN / ±inf / negative / string config value is refused, naming the field, both as a
    config object and as a plain mapping given to the loss."""
    assert_refused(cfg_cls, **{field: value}, names=field)
    assert_refused(loss_cls, {field: value}, names=field)


@pytest.mark.parametrize(
    "label,value", [("nan", math.nan), ("inf", math.inf), ("negative", -1.0), ("string", "2.0")], ids=str
)
def test_bad_seq_logprob_error_threshold_refused(label, value):
    """seq_logprob_error_threshold NaN / inf / negative / string: refused, naming it."""
    cfg = {"force_on_policy_ratio": True, "seq_logprob_error_in_loss": True}
    assert_refused(ClippedPGLossFn, cfg, seq_logprob_error_threshold=value, names="seq_logprob_error_threshold")


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "4", 2.5, True], ids=repr)
def test_bad_draft_token_chunk_size_refused(value):
    """DraftCrossEntropyLossFn(token_chunk_size=0 / -1 / NaN / inf / string / float / bool): refused, naming it."""
    assert_refused(DraftCrossEntropyLossFn, token_chunk_size=value, names="token_chunk_size")


SAMPLING_CASES = (
    [("top_k", v) for v in (math.nan, 2.5, "5")]
    + [("top_p", v) for v in (math.nan, math.inf, -0.5, 0.0, "0.9")]
    + [("temperature", v) for v in (math.nan, math.inf, -1.0, 0.0, "1.0")]
)


@pytest.mark.parametrize("field,value", SAMPLING_CASES, ids=[f"{f}={v!r}" for f, v in SAMPLING_CASES])
def test_bad_sampling_params_refused(field, value):
    """TrainingSamplingParams: NaN / inf / out-of-range / string values refused, naming the field."""
    assert_refused(TrainingSamplingParams, **{field: value}, names=field)


# ---------------------------------------------------------------------------------------
# token ids outside the vocabulary
# ---------------------------------------------------------------------------------------

BAD_IDS = [
    ("input_ids", VOCAB),
    ("input_ids", VOCAB + 5),
    ("input_ids", -1),
    ("teacher_topk_indices", VOCAB),
    ("teacher_topk_indices", -1),
]


@pytest.mark.parametrize("key,bad", BAD_IDS, ids=[f"{k}={v}" for k, v in BAD_IDS])
def test_token_ids_outside_vocabulary_refused(key, bad):
    """An id outside [0, V) (or -1): `compiled_loss.inputs.validate_batch` (eager input
    preparation when the library has no validate_batch) raises ValueError naming the key."""
    data = make_data("distill", 3, 5, seed=6)
    data[key][1, 2] = bad
    if hasattr(inputs, "validate_batch"):
        assert_refused(inputs.validate_batch, data, vocab_size=VOCAB, names=key)
    else:
        case = FIXED["nll"] if key == "input_ids" else FIXED["distill"]
        assert_refused(prepare_loss_input, torch.randn(3, 5, VOCAB), data, case.loss_fn, names=key)


# ---------------------------------------------------------------------------------------
# preference pairs and data keys
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["unpacked", "preference_unpacked"] + [w.__name__ for w in WRAPPERS])
def test_odd_row_count_for_pairs_refused(path):
    """Three rows for a pairwise loss: ValueError naming the odd count and the pairing."""
    data = make_data("dpo", 3, 4, seed=7)
    if path == "unpacked":
        fn = functools.partial(
            wrap_loss_fn_with_input_preparation,
            torch.randn(3, 4, VOCAB),
            data,
            torch.tensor(3.0),
            torch.tensor(6.0),
            loss_fn=DPOLossFn({}),
            prepare_fn=prepare_loss_input,
        )
    elif path == "preference_unpacked":
        fn = functools.partial(
            wrap_loss_fn_with_input_preparation,
            torch.randn(3, 1),
            data,
            torch.tensor(3.0),
            torch.tensor(6.0),
            loss_fn=PreferenceLossFn(),
            prepare_fn=prepare_loss_input,
        )
    else:
        wrapper_cls = {w.__name__: w for w in WRAPPERS}[path]
        prepare = prepare_packed_loss_input if path == "SequencePackingFusionLossWrapper" else prepare_loss_input
        fn = functools.partial(wrapper_cls, DPOLossFn({}), prepare, (0, 4, 8, 12))
    e = refusal(fn)
    assert "3" in str(e) and "pair" in str(e), f"message does not name the odd count of pairs: {e}"


REQUIRED = {
    "pg": (
        "input_ids",
        "token_mask",
        "sample_mask",
        "advantages",
        "prev_logprobs",
        "generation_logprobs",
        "reference_policy_logprobs",
    ),
    "nll": ("input_ids", "token_mask", "sample_mask"),
    "dpo": ("input_ids", "token_mask", "sample_mask", "reference_policy_logprobs"),
    "distill": ("teacher_topk_logits", "teacher_topk_indices"),
    "mse": ("token_mask", "sample_mask", "returns", "values"),
}
PACKED_ONLY = {"distill": ("token_mask", "sample_mask")}  # docs/deviations.md: required under packing
MISSING = [
    (f, k, p)
    for f, keys in REQUIRED.items()
    for p in ["unpacked"] + [w.__name__ for w in WRAPPERS]
    for k in keys + (PACKED_ONLY.get(f, ()) if p != "unpacked" else ())
]


@pytest.mark.parametrize("family,key,path", MISSING, ids=[f"{f}-{k}-{p}" for f, k, p in MISSING])
def test_missing_data_key_refused(family, key, path):
    """A required data key missing: ValueError/TypeError naming the key (not a KeyError)."""
    case = FIXED[family]
    rows, width = 4, 5
    data = make_data(family, rows, width, seed=8)
    del data[key]
    gs, gt = torch.tensor(4.0), torch.tensor(10.0)
    if path == "unpacked":
        logits = torch.randn(rows, width, case.logit_width)
        fn = functools.partial(
            wrap_loss_fn_with_input_preparation,
            logits,
            data,
            gs,
            gt,
            loss_fn=case.loss_fn,
            prepare_fn=case.prepare(False),
        )
    else:
        wrapper_cls = {w.__name__: w for w in WRAPPERS}[path]
        fused = path == "SequencePackingFusionLossWrapper"
        cu = tuple(range(0, rows * width + 1, width))
        logits = torch.randn(1, rows * width, case.logit_width)
        fn = functools.partial(wrapper_cls(case.loss_fn, case.prepare(fused), cu, cu), logits, data, gs, gt)
    assert_refused(fn, names=key)
