"""The input preparation's own preconditions (not only the runner's `validate_batch`): a
batch key whose shape or dtype cannot be right is refused, for every input type and every
packing path, before any vocabulary work; an eager call refuses a token id outside the
vocabulary, naming the key, the id and the vocabulary size, instead of scoring it; compiled,
neither check adds a graph break or a host sync."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch, pack_logits
from common import message

from compiled_loss.loss_functions import NLLLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.train import CompileRecorder, compile_loss
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, SequencePackingLossWrapper

LENGTHS, WIDTH = [5, 3, 6], 6
CU, CU_PADDED = boundaries(LENGTHS, [1, 0, 2])
PATHS = ["unpacked", "SequencePackingLossWrapper", "SequencePackingFusionLossWrapper"]


def _run(path: str, case_name: str, data: dict, logits: torch.Tensor):
    """The loss through `path` (unpacked: `prepare_loss_input` then the loss)."""
    case = CASE_BY_NAME[case_name]
    loss_fn = case.make_loss()
    if path == "unpacked":
        inputs, data = case.prepare(False)(logits, data, loss_fn)
        return loss_fn(
            data=data, global_valid_seqs=globals_for(data)[0], global_valid_toks=globals_for(data)[1], **inputs
        )
    fused = path == "SequencePackingFusionLossWrapper"
    wrapper = (SequencePackingFusionLossWrapper if fused else SequencePackingLossWrapper)(
        loss_fn, case.prepare(fused), CU, CU_PADDED
    )
    return wrapper(pack_logits(logits, CU, CU_PADDED, CU_PADDED[-1], 0), data, *globals_for(data))


def _who(path: str) -> str:
    return "prepare_packed_loss_input" if path == "SequencePackingFusionLossWrapper" else "prepare_loss_input"


def _cut(key: str, positions: int):
    return lambda data: {**data, key: data[key][:, :positions]}


def _cast(key: str, dtype: torch.dtype):
    return lambda data: {**data, key: data[key].to(dtype)}


PER_POSITION = "with [B, S] = (3, 6) (one entry per position of data['input_ids'])"
BAD_SHAPES = {
    # an OPD_FULL teacher that covers one position fewer than the batch (zero-padded before: a uniform teacher)
    "opd_logits_payload_short": (
        "opd_full_logits",
        _cut("opd_full_teacher_payload", WIDTH - 1),
        f"ValueError: {{who}}: data['opd_full_teacher_payload'] must have shape [B, S, D] "
        f"{PER_POSITION}, got (3, 5, 16)",
    ),
    "opd_hidden_payload_short": (
        "opd_full_hidden_seq_level",
        _cut("opd_full_teacher_payload", 2),
        f"ValueError: {{who}}: data['opd_full_teacher_payload'] must have shape [B, S, D] "
        f"{PER_POSITION}, got (3, 2, 6)",
    ),
    "opd_payload_integer": (
        "opd_full_logits",
        _cast("opd_full_teacher_payload", torch.long),
        "TypeError: {who}: data['opd_full_teacher_payload'] must be a floating-point tensor, got torch.int64",
    ),
    "opd_index_float": (
        "opd_full_hidden_seq_level",
        _cast("opd_full_teacher_index", torch.float32),
        "TypeError: {who}: data['opd_full_teacher_index'] must be an integer tensor, got torch.float32",
    ),
    # a top-k teacher that covers fewer positions (the student was cut to its width, or packed zeros read as id 0)
    "topk_teacher_short": (
        "distill_reverse",
        lambda d: _cut("teacher_topk_indices", 4)(_cut("teacher_topk_logits", 4)(d)),
        f"ValueError: {{who}}: data['teacher_topk_logits'] must have shape [B, S, k] {PER_POSITION}, got (3, 4, 4)",
    ),
    "topk_indices_short": (
        "distill_mixed_zero_outside",
        _cut("teacher_topk_indices", 4),
        f"ValueError: {{who}}: data['teacher_topk_indices'] must have shape [B, S, k] {PER_POSITION}, got (3, 4, 4)",
    ),
    "input_ids_float": (
        "grpo",
        _cast("input_ids", torch.float32),
        "TypeError: {who}: data['input_ids'] must be an integer tensor, got torch.float32",
    ),
    "sample_mask_2d": (
        "nll",
        lambda d: {**d, "sample_mask": d["sample_mask"][:, None]},
        "ValueError: {who}: data['sample_mask'] must have shape [B] = (3,), got (3, 1)",
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", list(BAD_SHAPES))
def test_a_batch_key_of_the_wrong_shape_or_dtype_is_refused_on_every_path(bad, path):
    case_name, mutate, expected = BAD_SHAPES[bad]
    data, logits = make_batch(CASE_BY_NAME[case_name], LENGTHS, WIDTH, seed=1)
    assert message(_run, path, case_name, mutate(data), logits) == expected.format(who=_who(path))


def test_rows_that_disagree_are_refused_unpacked():
    """(The packing wrappers refuse them when padding to the bucket.)"""
    data, logits = make_batch(CASE_BY_NAME["opd_full_hidden_seq_level"], LENGTHS, WIDTH, seed=1)
    index = data["opd_full_teacher_index"]
    assert (
        message(_run, "unpacked", "opd_full_hidden_seq_level", {**data, "opd_full_teacher_index": index[:2]}, logits)
        == "ValueError: prepare_loss_input: data['opd_full_teacher_index'] must have shape [B] = "
        "(3,), got (2,)"
    )
    data, logits = make_batch(CASE_BY_NAME["grpo"], LENGTHS, WIDTH, seed=1)
    assert message(_run, "unpacked", "grpo", {**data, "input_ids": data["input_ids"][:2]}, logits) == (
        "ValueError: prepare_loss_input: data['token_mask'] must have shape [B, S] = (2, 6), got (3, 6)"
    )


# ---- token ids outside the vocabulary -------------------------------------------------

BAD_IDS = {  # case, key, where, id
    "logprob_past_the_vocabulary": ("grpo", "input_ids", (0, 2), 16),
    "logprob_negative": ("nll", "input_ids", (1, 1), -1),
    "logprob_top_k_top_p": ("grpo_topk_topp", "input_ids", (2, 3), 99),
    "opd_full_kl_term": ("opd_full_logits", "input_ids", (1, 2), 16),
    "top_k_teacher_gathered": ("distill_reverse", "teacher_topk_indices", (1, 1, 2), 16),
    "top_k_teacher_full_vocab": ("distill_mixed_zero_outside", "teacher_topk_indices", (0, 3, 0), -3),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_an_eager_call_refuses_an_id_outside_the_vocabulary(bad, path):
    """Never a value computed from it (the vocab primitive reads such an id as logit 0)."""
    case_name, key, where, value = BAD_IDS[bad]
    data, logits = make_batch(CASE_BY_NAME[case_name], LENGTHS, WIDTH, seed=2)
    data[key][where] = value
    assert message(_run, path, case_name, data, logits) == (
        f"ValueError: {_who(path)}: data[{key!r}] must hold token ids in [0, 16) (the vocabulary), got {value} at "
        f"index {where}"
    )


def test_the_vocabulary_of_linear_logits_and_of_a_pre_packed_batch():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 5, 4, generator=g), torch.randn(12, 4, generator=g)
    data = {
        "input_ids": torch.randint(0, 12, (2, 5), generator=g),
        "token_mask": torch.ones(2, 5),
        "sample_mask": torch.ones(2),
    }
    data["input_ids"][1, 4] = 12
    assert message(prepare_loss_input, LinearLogits(hidden, weight), data, NLLLossFn()) == (
        "ValueError: prepare_loss_input: data['input_ids'] must hold token ids in [0, 12) (the vocabulary), got 12 at "
        "index (1, 4)"
    )
    packed = {
        "input_ids": data["input_ids"].reshape(1, 10),
        "token_mask": torch.ones(1, 10),
        "sample_mask": torch.ones(1),
        "cu_seqlens": torch.tensor([0, 5, 10]),
    }
    assert message(prepare_packed_loss_input, torch.randn(1, 10, 12), packed, NLLLossFn(), None) == (
        "ValueError: prepare_loss_input: data['input_ids'] must hold token ids in [0, 12) (the vocabulary), got 12 at "
        "index (0, 9)"
    )


def test_compiled_the_checks_add_no_break_and_no_sync():
    """The shape checks run while tracing; the id check is eager only (compiled code cannot
    raise without a host sync: `validate_batch` checks the batch on the host first)."""
    torch._dynamo.reset()
    case = CASE_BY_NAME["opd_full_logits"]
    loss_fn = case.make_loss()
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=4)
    recorder = CompileRecorder("aot_eager", "prepare")
    compiled = compile_loss(lambda lg, d: prepare_loss_input(lg, d, loss_fn)[0], recorder=recorder, fullgraph=True)
    want = prepare_loss_input(logits, data, loss_fn)[0]
    got = compiled(logits, data)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)
    assert (recorder.report.compiles, recorder.report.problems()) == (1, [])
    # torch 2.11's Dynamo wraps an error raised under fullgraph in `Unsupported: Observed exception`,
    # which names the ValueError and its message's pieces
    message = r"data\['opd_full_teacher_payload'\] must have shape \[B, S, D\]"
    if torch.__version__ < "2.12":
        message = r"raised exception ValueError\(.*'opd_full_teacher_payload'.*must have shape .*\[B, S, D\]"
    with pytest.raises(Exception, match=message):
        compiled(logits, _cut("opd_full_teacher_payload", WIDTH - 1)(data))
