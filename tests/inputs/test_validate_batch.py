"""`validate_batch`: what compiled code cannot refuse (a gather past the vocabulary, a NaN
mask, a bad pair naming) is refused on the host with the key and the value named."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_BY_NAME, make_batch
from common import HostSyncs, message

from compiled_loss.inputs import validate_batch

DISTILL = CASE_BY_NAME["distill_reverse"]


def _batch():
    data, _ = make_batch(DISTILL, [4, 3], 5, seed=0)
    data["input_lengths"] = torch.tensor([4, 3])
    return data


def test_a_valid_batch_passes_with_one_host_read():
    with HostSyncs() as syncs:
        validate_batch(_batch(), vocab_size=16)
    assert syncs.calls == ["tolist"]


@pytest.mark.parametrize(
    ("key", "index", "value", "expected"),
    [
        (
            "input_ids",
            (1, 2),
            16,
            "data['input_ids'] must hold token ids in [0, 16) (the vocabulary), got 16 at index (1, 2)",
        ),
        (
            "input_ids",
            (0, 0),
            -1,
            "data['input_ids'] must hold token ids in [0, 16) (the vocabulary), got -1 at index (0, 0)",
        ),
        (
            "teacher_topk_indices",
            (0, 1, 3),
            99,
            "data['teacher_topk_indices'] must hold token ids in [0, 16) (the vocabulary), got 99 at index (0, 1, 3)",
        ),
        ("token_mask", (1, 1), float("nan"), "data['token_mask'] must hold values in [0, 1], got nan at index (1, 1)"),
        ("sample_mask", (0,), 2.0, "data['sample_mask'] must hold values in [0, 1], got 2.0 at index (0,)"),
        ("input_lengths", (1,), 6, "data['input_lengths'] must hold lengths in [0, S = 5], got 6 at index (1,)"),
    ],
)
def test_bad_values_are_named(key, index, value, expected):
    data = _batch()
    data[key][index] = value
    assert message(validate_batch, data, vocab_size=16) == f"ValueError: {expected}"


def test_bad_shapes_and_dtypes_are_named():
    data = _batch()
    assert message(validate_batch, {**data, "advantages": torch.zeros(2, 4)}, vocab_size=16) == (
        "ValueError: data['advantages'] must have shape [B, S] = (2, 5), got (2, 4)"
    )
    assert message(validate_batch, {**data, "input_ids": data["input_ids"].float()}, vocab_size=16) == (
        "TypeError: data['input_ids'] must be an integer tensor, got torch.float32"
    )
    assert message(validate_batch, {**data, "rewards": [1.0, 0.0]}, vocab_size=16) == (
        "TypeError: data['rewards'] must be a tensor, got list"
    )
    assert message(validate_batch, {**data, "reward_shift": torch.zeros(3)}, vocab_size=16) == (
        "ValueError: data['reward_shift'] must have shape [B] = (2,), got (3,)"
    )
    assert message(validate_batch, {**data, "opd_full_teacher_payload": torch.zeros(2, 4, 16)}, vocab_size=16) == (
        "ValueError: data['opd_full_teacher_payload'] must have shape [B, S, D] with [B, S] = (2, 5) (one entry per "
        "position of data['input_ids']), got (2, 4, 16)"
    )
    assert message(validate_batch, {**data, "opd_full_teacher_index": torch.zeros(2)}, vocab_size=16) == (
        "TypeError: data['opd_full_teacher_index'] must be an integer tensor, got torch.float32"
    )


def test_pair_naming_and_draft_map():
    data = {**_batch(), "pair_index": torch.tensor([0, 0]), "is_chosen": torch.tensor([1, 1])}
    assert message(validate_batch, data, vocab_size=16).startswith(
        "ValueError: data: pair_index / is_chosen must name exactly one chosen and one rejected row"
    )
    assert message(validate_batch, _batch(), vocab_size=16, d2t=torch.tensor([0, 20])) == (
        "ValueError: d2t maps draft index 1 to target id 21 outside the target vocabulary [0, 16) (1 such entries)"
    )
