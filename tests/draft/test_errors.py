"""Bad input → a clear error naming the argument and the expected value, raised on the
host before any compiled code runs. Messages are pinned: a change shows up in review."""

from __future__ import annotations

import torch
from common import message
from expecttest import TestCase

from compiled_loss.utils import _project_hidden_states_per_teacher, map_teacher_logits_to_draft_vocab
from compiled_loss.wrapper import DraftLossWrapper


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
            message(
                _project_hidden_states_per_teacher, torch.randn(2, 3, 4), {0: torch.randn(5, 4)}, torch.tensor([0, 1])
            ),
            """ValueError: teacher_index names teacher 1 but no teacher LM head is loaded for that index (loaded: [0])""",
        )
