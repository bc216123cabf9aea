"""The packing room: sequence boundaries on the host, the bucketed `PackedLayout` that
compiled code reads instead of them, the per-sequence / context-parallel chunk maps, the
token view input preparation works against, and the micro-batch loss over packed or padded
logits.

- `boundaries`: `CpuIntTuple`, `to_cpu_int_tuple`, `check_cu_seqlens`;
- `transforms`: `pack_source_index` (padding, roll, CP `2·cp` chunks) and the seed's
  packing utilities built on it;
- `layout`: `BucketGrid`, `round_to_bucket`, `pad_to_bucket`, `PackedLayout`;
- `view`: `TokenView`, `RowsView`, `PackedView` (where a micro-batch's tokens are);
- `micro_batch`: `micro_batch_loss` (the one micro-batch entry point), `Prepare` (its input
  preparation) and `check_inputs_agree` (the ranks' agreement on a micro-batch's shapes,
  host side); the seed's shells over it are `compiled_loss.nemo_rl.wrapper`'s.
"""

from compiled_loss.edge import edge_attribute
from compiled_loss.packing.boundaries import CpuIntTuple, check_cu_seqlens, to_cpu_int_tuple
from compiled_loss.packing.layout import BucketGrid, PackedLayout, pad_to_bucket, round_to_bucket, row_width
from compiled_loss.packing.micro_batch import Prepare, check_inputs_agree, micro_batch_loss
from compiled_loss.packing.transforms import (
    pack_input_ids,
    pack_rolled_draft_token_mask,
    pack_source_index,
    roll_packed_seq_dim,
    roll_within_segments,
)
from compiled_loss.packing.view import PackedView, RowsView, TokenView

# names with the seed's signatures, exported here and defined in the edge room (`compiled_loss.edge`)
_EDGE = {
    "sequence_packing_loss": "wrapper",
    "wrap_loss_fn_with_input_preparation": "wrapper",
    "seed_prepare": "wrapper",
}


def __getattr__(name: str) -> object:
    return edge_attribute(__name__, name, _EDGE)


__all__ = [
    "BucketGrid",
    "CpuIntTuple",
    "PackedLayout",
    "PackedView",
    "Prepare",
    "RowsView",
    "TokenView",
    "check_cu_seqlens",
    "check_inputs_agree",
    "micro_batch_loss",
    "pack_input_ids",
    "pack_rolled_draft_token_mask",
    "pack_source_index",
    "pad_to_bucket",
    "roll_packed_seq_dim",
    "roll_within_segments",
    "round_to_bucket",
    "row_width",
    "seed_prepare",
    "sequence_packing_loss",
    "to_cpu_int_tuple",
    "wrap_loss_fn_with_input_preparation",
]
