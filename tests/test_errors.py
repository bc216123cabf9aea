"""Bad input → a clear error naming the argument and the expected value, raised on the
host before any compiled code runs. Messages are pinned: a change shows up in review."""

from __future__ import annotations

import torch
import torch.distributed as dist
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch
from expecttest import TestCase

from compiled_loss.layout import BucketGrid, PackedLayout
from compiled_loss.loss_functions import ClippedPGLossFn, DistillationLossFn, MseValueLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.utils import _pack_input_ids, _project_hidden_states_per_teacher, map_teacher_logits_to_draft_vocab
from compiled_loss.wrapper import DraftLossWrapper, SequencePackingFusionLossWrapper


def message(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


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


class TestShapesAndKeys(TestCase):
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

    def test_missing_data_key_is_named(self):
        data = {k: v for k, v in self.data.items() if k != "generation_logprobs"}
        lp = torch.zeros(2, self.width - 1)
        self.assertExpectedInline(
            message(GRPO.make_loss(), next_token_logprobs=lp, data=data, global_valid_seqs=None, global_valid_toks=None),
            """ValueError: ClippedPGLossFn: data is missing key 'generation_logprobs' (present: ['advantages', 'input_ids', 'prev_logprobs', 'reference_policy_logprobs', 'returns', 'rewards', 'sample_mask', 'teacher_topk_indices', 'teacher_topk_logits', 'token_mask', 'values'])""",
        )

    def test_logprob_shape_mismatch(self):
        lp = torch.zeros(2, self.width)
        self.assertExpectedInline(
            message(GRPO.make_loss(), next_token_logprobs=lp, data=self.data, global_valid_seqs=None, global_valid_toks=None),
            """ValueError: ClippedPGLossFn: next_token_logprobs ([B, S-1]) must have shape (2, 4), got (2, 5)""",
        )

    def test_unpacked_logits_narrower_than_input_ids(self):
        self.assertExpectedInline(
            message(prepare_loss_input, torch.randn(2, 3, 16), self.data, GRPO.make_loss()),
            """ValueError: logits must cover the 5 positions of input_ids, got shape (2, 3, 16)""",
        )

    def test_value_head_shape(self):
        self.assertExpectedInline(
            message(MseValueLossFn(), torch.randn(2, 4, 1), self.data, None, torch.tensor(3.0)),
            """ValueError: MseValueLossFn: values (logits squeezed, [B, S]) must have shape (2, 5), got (2, 4)""",
        )

    def test_topk_must_be_positive(self):
        data = {**self.data, "teacher_topk_logits": torch.zeros(2, 5, 0),
                "teacher_topk_indices": torch.zeros(2, 5, 0, dtype=torch.long)}
        loss_fn = DistillationLossFn({"zero_outside_topk": True})
        self.assertExpectedInline(
            message(prepare_loss_input, self.logits, data, loss_fn),
            """ValueError: topk must be positive, got k=0""",
        )


class TestConfigs(TestCase):
    def test_tis_min_above_max(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 1.0,
                "truncated_importance_sampling_ratio_min": 2.0,
            }),
            """ValueError: truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio""",
        )

    def test_cispo_with_dual_clip(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"use_cispo": True, "ratio_clip_c": 3.0}),
            """ValueError: use_cispo=True is incompatible with ratio_clip_c""",
        )

    def test_gspo_needs_sequence_level_loss(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"sequence_level_importance_ratios": True}),
            """ValueError: sequence_level_importance_ratios=True requires token_level_loss=False (GSPO is a sequence-level loss)""",
        )

    def test_seq_filter_needs_threshold(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"force_on_policy_ratio": True, "seq_logprob_error_in_loss": True}),
            """ValueError: seq_logprob_error_in_loss requires seq_logprob_error_threshold""",
        )

    def test_unknown_key(self):
        self.assertExpectedInline(
            message(MseValueLossFn, {"clip_range": 0.2}),
            """ValueError: MseValueLossFn: unknown config keys ['clip_range']; valid keys: ['cliprange', 'scale']""",
        )

    def test_negative_beta(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"reference_policy_kl_penalty": -0.1}),
            """ValueError: reference_policy_kl_penalty must be finite and >= 0, got -0.1""",
        )

    def test_distillation_kl_type(self):
        self.assertExpectedInline(
            message(DistillationLossFn, {"kl_type": "jsd"}),
            """ValueError: kl_type must be one of 'forward', 'reverse', 'mixed', got 'jsd'""",
        )


class TestDraftAndTeachers(TestCase):
    def test_d2t_out_of_vocab(self):
        self.assertExpectedInline(
            message(map_teacher_logits_to_draft_vocab, torch.randn(1, 3, 6), torch.tensor([0, 2, 4])),
            """ValueError: d2t maps draft index 2 to target id 6 outside the target vocabulary [0, 6) (1 such entries)""",
        )

    def test_packed_draft_needs_student_logits(self):
        self.assertExpectedInline(
            message(DraftLossWrapper, None, None, None, cu_seqlens_q=(0, 4)),
            """ValueError: DraftLossWrapper: student_logits must be passed explicitly in packed mode""",
        )

    def test_teacher_index_without_loaded_head(self):
        self.assertExpectedInline(
            message(_project_hidden_states_per_teacher, torch.randn(2, 3, 4), {0: torch.randn(5, 4)}, torch.tensor([0, 1])),
            """ValueError: teacher_index names teacher 1 but no teacher LM head is loaded for that index (loaded: [0])""",
        )


class TestParallelNotYet(TestCase):
    def test_world_size_above_one(self):
        patches = {"is_initialized": lambda: True, "get_world_size": lambda group=None: 2}
        saved = {k: getattr(dist, k) for k in patches}
        try:
            for k, v in patches.items():
                setattr(dist, k, v)
            self.assertExpectedInline(
                message(fused, (0, 4), vocab_parallel_group=object()),
                """NotImplementedError: vocab_parallel_group has world size 2; tensor/context parallelism (world size > 1) is not implemented yet — pass vocab_parallel_group=None or a single-rank group""",
            )
        finally:
            for k, v in saved.items():
                setattr(dist, k, v)


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
