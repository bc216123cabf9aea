"""The packing room: sequence boundaries on the host, the bucketed `PackedLayout` that
compiled code reads instead of them, the per-sequence / context-parallel chunk maps, and
the micro-batch loss over packed or padded logits.

- `boundaries`: `CpuIntTuple`, `to_cpu_int_tuple`, `check_cu_seqlens`;
- `transforms`: `pack_source_index` (padding, roll, CP `2·cp` chunks) and the seed's
  packing utilities built on it;
- `layout`: `BucketGrid`, `round_to_bucket`, `pad_to_bucket`, `PackedLayout`;
- `loss`: `sequence_packing_loss`, `wrap_loss_fn_with_input_preparation`, and
  `check_inputs_agree` (the ranks' agreement on a micro-batch's shapes, host side).
"""

from compiled_loss.packing.boundaries import CpuIntTuple, check_cu_seqlens, to_cpu_int_tuple
from compiled_loss.packing.layout import BucketGrid, PackedLayout, pad_to_bucket, round_to_bucket, row_width
from compiled_loss.packing.loss import check_inputs_agree, sequence_packing_loss, wrap_loss_fn_with_input_preparation
from compiled_loss.packing.transforms import (
    pack_input_ids,
    pack_rolled_draft_token_mask,
    pack_source_index,
    roll_packed_seq_dim,
    roll_within_segments,
)

__all__ = [
    "BucketGrid",
    "CpuIntTuple",
    "PackedLayout",
    "check_cu_seqlens",
    "check_inputs_agree",
    "pack_input_ids",
    "pack_rolled_draft_token_mask",
    "pack_source_index",
    "pad_to_bucket",
    "roll_packed_seq_dim",
    "roll_within_segments",
    "round_to_bucket",
    "row_width",
    "sequence_packing_loss",
    "to_cpu_int_tuple",
    "wrap_loss_fn_with_input_preparation",
]
