"""PackedLayout's device placement: index tensors built where the logits live, or copied
there once per device and kept."""

from __future__ import annotations

import torch

from compiled_loss.loss_functions import NLLLossFn
from compiled_loss.loss_input import prepare_packed_loss_input
from compiled_loss.packing import PackedLayout
from compiled_loss.wrapper import SequencePackingFusionLossWrapper


def test_a_layout_is_copied_once_per_device():
    layout = PackedLayout.build((0, 3, 7), (0, 4, 8))
    meta = torch.device("meta")
    assert layout.on(layout.device) is layout
    copy = layout.on(meta)
    assert copy.device == meta and copy.tokens == layout.tokens
    assert layout.on(meta) is copy


def test_wrappers_build_their_layout_on_the_given_device():
    wrapper = SequencePackingFusionLossWrapper(NLLLossFn(), prepare_packed_loss_input, (0, 3, 7), device="meta")
    assert wrapper.layout.device == torch.device("meta")
    assert all(
        getattr(wrapper.layout, f).is_meta for f in ("slot_row", "slot_col", "slot_last", "row_start", "row_len")
    )
