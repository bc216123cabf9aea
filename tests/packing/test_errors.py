"""Bad input → a clear error naming the argument and the expected value, raised on the
host before any compiled code runs. Messages are pinned: a change shows up in review."""

from __future__ import annotations

import torch
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch
from common import message
from expecttest import TestCase

from compiled_loss.loss_input import prepare_packed_loss_input
from compiled_loss.packing import BucketGrid, PackedLayout
from compiled_loss.utils import _pack_input_ids
from compiled_loss.wrapper import SequencePackingFusionLossWrapper

GRPO = CASE_BY_NAME["grpo"]


def fused(cu, cup=None, **kw):
    return SequencePackingFusionLossWrapper(GRPO.make_loss(), prepare_packed_loss_input, cu, cup, **kw)


class TestBoundaries(TestCase):
    def test_non_monotonic(self):
        self.assertExpectedInline(
            message(fused, (0, 5, 3, 9)),
            """ValueError: cu_seqlens_q must be non-decreasing, got cu_seqlens_q[1] = 5 > cu_seqlens_q[2] = 3""",
        )

    def test_not_starting_at_zero(self):
        self.assertExpectedInline(
            message(fused, (1, 5)), """ValueError: cu_seqlens_q must start at 0, got cu_seqlens_q[0] = 1"""
        )

    def test_wrongly_sized_padded(self):
        self.assertExpectedInline(
            message(fused, (0, 4, 8), (0, 8)),
            """ValueError: cu_seqlens_q_padded must have as many entries as cu_seqlens_q (3), got 2""",
        )

    def test_padded_smaller_than_true(self):
        self.assertExpectedInline(
            message(fused, (0, 4, 9), (0, 4, 8)),
            """ValueError: sequence 1: padded length cu_seqlens_q_padded[2] - cu_seqlens_q_padded[1] = 4 is smaller than its true length cu_seqlens_q[2] - cu_seqlens_q[1] = 5""",
        )

    def test_float_tensor_boundaries(self):
        self.assertExpectedInline(
            message(fused, torch.tensor([0.0, 4.0])),
            """ValueError: cu_seqlens_q must be a 1-D integer tensor, got dtype torch.float32 and shape (2,)""",
        )

    def test_bucket_rows_must_keep_pairs(self):
        self.assertExpectedInline(
            message(BucketGrid, rows=3),
            """ValueError: BucketGrid.rows must be 1 or even (padding rows must keep chosen/rejected pairs aligned), got 3""",
        )

    def test_cp_sharding_needs_divisible_padded_lengths(self):
        self.assertExpectedInline(
            message(_pack_input_ids, torch.ones(2, 6), (0, 6, 12), (0, 6, 14), cp_rank=0, cp_size=2),
            """ValueError: with cp_size=2 every padded sequence length must be a multiple of 2*cp_size=4; sequences [0] have padded lengths [6]""",
        )


class TestShapes(TestCase):
    def setUp(self):
        self.lengths, self.pads, self.width = [4, 3], [0, 1], 5
        self.data, self.logits = make_batch(GRPO, self.lengths, self.width, seed=0)
        self.cu, self.cup = boundaries(self.lengths, self.pads)
        self.g = globals_for(self.data)

    def test_packed_logits_too_short(self):
        wrapper = fused(self.cu, self.cup)
        self.assertExpectedInline(
            message(wrapper, torch.randn(1, 6, 16), self.data, *self.g),
            """ValueError: next_token_logits must be packed as [1, T, ...] with T >= 8 (the bucketed packed length), got shape (1, 6, 16)""",
        )

    def test_data_rows_do_not_match_the_packing(self):
        wrapper = fused(self.cu, self.cup)
        data = {**self.data, "advantages": torch.zeros(3, self.width)}
        self.assertExpectedInline(
            message(wrapper, torch.randn(1, 8, 16), data, *self.g),
            """ValueError: data['advantages'] must have 2 rows (one per packed sequence), got shape (3, 5)""",
        )


def test_truncation_hides_data_past_each_length():
    """Per-sequence semantics (ref §7.2): values past a sequence's length — even a
    token_mask of 1 and NaN log-probs there — never reach the loss, as if sliced away."""
    lengths, pads, width = [4, 3], [1, 2], 6
    data, logits = make_batch(GRPO, lengths, width, seed=5)
    cu, cup = boundaries(lengths, pads)
    gs, gt = globals_for(data)
    wrapper = fused(cu, cup)
    tokens = wrapper.layout.tokens
    packed = torch.randn(1, tokens, 16)
    clean_loss, clean_metrics = wrapper(packed, data, gs, gt)
    dirty = dict(data)
    dirty["token_mask"] = data["token_mask"].clone()
    dirty["prev_logprobs"] = data["prev_logprobs"].clone()
    for i, length in enumerate(lengths):
        dirty["token_mask"][i, length:] = 1
        dirty["prev_logprobs"][i, length:] = float("nan")
    dirty_loss, dirty_metrics = wrapper(packed, dirty, gs, gt)
    torch.testing.assert_close(dirty_loss, clean_loss)
    for key in clean_metrics:
        torch.testing.assert_close(dirty_metrics[key], clean_metrics[key], msg=key)
    assert PackedLayout.build(cu, cup).tokens == tokens


class TestUnclearInputs(TestCase):
    def test_missing_or_malformed_boundaries(self):
        import numpy as np

        self.assertExpectedInline(
            message(fused, None),
            """ValueError: cu_seqlens_q must be a 1-D sequence of ints [0, ..., total], got NoneType""",
        )
        self.assertExpectedInline(
            message(fused, np.array([[0, 4], [4, 8]])),
            """ValueError: cu_seqlens_q must be a 1-D integer tensor, got dtype torch.int64 and shape (2, 2)""",
        )
        self.assertExpectedInline(
            message(fused, (0, 10**12)),
            """ValueError: cu_seqlens_q totals 1000000000000 packed tokens, more than the 2147483647 an int32 cu_seqlens can address""",
        )

    def test_roll_past_the_tensor(self):
        from compiled_loss.utils import roll_packed_seq_dim

        self.assertExpectedInline(
            message(roll_packed_seq_dim, torch.arange(8.0)[None], [0, 4, 12], 1),
            """ValueError: cu_seqlens_padded ends at 12, but the tensor has 8 packed slots along dim 1""",
        )

    def test_distillation_without_masks_under_packing(self):
        data, _ = make_batch(CASE_BY_NAME["distill_reverse"], [4, 3], 5, seed=0)
        data = {k: v for k, v in data.items() if k not in ("token_mask", "sample_mask")}
        wrapper = SequencePackingFusionLossWrapper(
            CASE_BY_NAME["distill_reverse"].make_loss(), prepare_packed_loss_input, (0, 4, 7)
        )
        self.assertExpectedInline(
            message(wrapper, torch.randn(1, 7, 16), data, None, None),
            """ValueError: DistillationLossFn under packing needs data['token_mask'] and data['sample_mask']: without them it takes a plain mean over every position of the micro-batch, which is not the per-sequence loop's sum of per-sequence means""",
        )

    def test_packed_draft_without_masks(self):
        from compiled_loss.wrapper import DraftLossWrapper

        wrapper = DraftLossWrapper(
            lambda *a: (torch.tensor(0.0), {}), None, {}, cu_seqlens_q=(0, 4), student_logits=torch.randn(1, 4, 3)
        )
        self.assertExpectedInline(
            message(wrapper, torch.randn(1, 4, 3), {"token_mask": torch.ones(1, 4)}, None, torch.tensor(3.0)),
            """ValueError: DraftLossWrapper (packed): data is missing key 'sample_mask' (present: ['token_mask'])""",
        )
