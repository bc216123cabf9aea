"""Bad input → a clear error naming the argument and the expected value, raised on the
host before any compiled code runs. Messages are pinned: a change shows up in review."""

from __future__ import annotations

import torch
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch
from common import message
from expecttest import TestCase

from compiled_loss.loss_functions import ClippedPGLossFn, DistillationLossFn, MseValueLossFn
from compiled_loss.loss_input import prepare_loss_input

GRPO = CASE_BY_NAME["grpo"]


class TestShapesAndKeys(TestCase):
    def setUp(self):
        self.lengths, self.pads, self.width = [4, 3], [0, 1], 5
        self.data, self.logits = make_batch(GRPO, self.lengths, self.width, seed=0)
        self.cu, self.cup = boundaries(self.lengths, self.pads)
        self.g = globals_for(self.data)

    def test_missing_data_key_is_named(self):
        data = {k: v for k, v in self.data.items() if k != "generation_logprobs"}
        lp = torch.zeros(2, self.width - 1)
        self.assertExpectedInline(
            message(
                GRPO.make_loss(), next_token_logprobs=lp, data=data, global_valid_seqs=None, global_valid_toks=None
            ),
            """ValueError: ClippedPGLossFn: data is missing key 'generation_logprobs' (present: ['advantages', 'input_ids', 'prev_logprobs', 'reference_policy_logprobs', 'returns', 'rewards', 'sample_mask', 'teacher_topk_indices', 'teacher_topk_logits', 'token_mask', 'values'])""",
        )

    def test_logprob_shape_mismatch(self):
        lp = torch.zeros(2, self.width)
        self.assertExpectedInline(
            message(
                GRPO.make_loss(), next_token_logprobs=lp, data=self.data, global_valid_seqs=None, global_valid_toks=None
            ),
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
        data = {
            **self.data,
            "teacher_topk_logits": torch.zeros(2, 5, 0),
            "teacher_topk_indices": torch.zeros(2, 5, 0, dtype=torch.long),
        }
        loss_fn = DistillationLossFn({"zero_outside_topk": True})
        self.assertExpectedInline(
            message(prepare_loss_input, self.logits, data, loss_fn),
            """ValueError: topk must be positive, got k=0""",
        )


class TestConfigs(TestCase):
    def test_tis_min_above_max(self):
        self.assertExpectedInline(
            message(
                ClippedPGLossFn,
                {
                    "use_importance_sampling_correction": True,
                    "truncated_importance_sampling_type": "icepop",
                    "truncated_importance_sampling_ratio": 1.0,
                    "truncated_importance_sampling_ratio_min": 2.0,
                },
            ),
            """ConfigError: truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio""",
        )

    def test_cispo_with_dual_clip(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"use_cispo": True, "ratio_clip_c": 3.0}),
            """ConfigError: use_cispo=True is incompatible with ratio_clip_c""",
        )

    def test_gspo_needs_sequence_level_loss(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"sequence_level_importance_ratios": True}),
            """ConfigError: sequence_level_importance_ratios=True requires token_level_loss=False (GSPO is a sequence-level loss)""",
        )

    def test_seq_filter_needs_threshold(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"force_on_policy_ratio": True, "seq_logprob_error_in_loss": True}),
            """ConfigError: seq_logprob_error_in_loss requires seq_logprob_error_threshold""",
        )

    def test_unknown_key(self):
        self.assertExpectedInline(
            message(MseValueLossFn, {"clip_range": 0.2}),
            """ConfigError: MseValueLossFn: unknown config keys ['clip_range']; valid keys: ['cliprange', 'scale']""",
        )

    def test_negative_beta(self):
        self.assertExpectedInline(
            message(ClippedPGLossFn, {"reference_policy_kl_penalty": -0.1}),
            """ConfigError: reference_policy_kl_penalty must be finite and >= 0, got -0.1""",
        )

    def test_distillation_kl_type(self):
        self.assertExpectedInline(
            message(DistillationLossFn, {"kl_type": "jsd"}),
            """ConfigError: kl_type must be one of 'forward', 'reverse', 'mixed', got 'jsd'""",
        )
