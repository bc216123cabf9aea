"""The vocab room: every computation over a `[N, V]` logits row lives here.

- `reduce`: `vocab_reduce`, the one primitive (log-partition, picked logits, negative
  entropy, soft cross-entropy against a teacher) with a recomputing backward, over the
  full vocabulary or a tensor-parallel shard of it; `token_logprobs` on top of it; the
  global top-k `vocab_topk`; the total variation `total_variation` and the reverse KL to a
  fixed teacher `reverse_kl` between two rows' distributions;
- `fused`: `LinearLogits`, logits held as an LM head's factors (hidden states, weight,
  bias), which every primitive here accepts: the same statistics, chunked, with no
  `[N, V]` logits (`linear_vocab_reduce`), and for a loss that is a sum over rows the
  gradient in the forward (`linear_vocab_gradient`);
- `stats`: the statistics' pieces both share;
- `sampling`: top-k / top-p parameters and keep thresholds;
- `draft_vocab`: the drafter's draft→target vocabulary map (`DraftVocab`, `draft_vocab_logits`);
- `shards`: `local_logits`, DTensor logits unwrapped into this rank's tensor and their groups.
"""

from compiled_loss.edge import edge_attribute
from compiled_loss.vocab.draft_vocab import DraftVocab, draft_vocab_logits
from compiled_loss.vocab.fused import LinearLogits, linear_vocab_gradient, per_position
from compiled_loss.vocab.reduce import (
    VocabStats,
    check_chunk_size,
    reverse_kl,
    token_logprobs,
    total_variation,
    vocab_reduce,
    vocab_topk,
)
from compiled_loss.vocab.sampling import (
    TrainingSamplingParams,
    mask_out_neg_inf_logprobs,
    need_top_k_or_top_p_filtering,
    sampling_threshold,
)

# names with the seed's signatures, exported here and defined in the edge room (`compiled_loss.edge`)
_EDGE = {
    "map_teacher_logits_to_draft_vocab": "utils",
}


def __getattr__(name: str) -> object:
    return edge_attribute(__name__, name, _EDGE)


__all__ = [
    "DraftVocab",
    "LinearLogits",
    "TrainingSamplingParams",
    "VocabStats",
    "check_chunk_size",
    "draft_vocab_logits",
    "linear_vocab_gradient",
    "map_teacher_logits_to_draft_vocab",
    "mask_out_neg_inf_logprobs",
    "need_top_k_or_top_p_filtering",
    "per_position",
    "reverse_kl",
    "sampling_threshold",
    "token_logprobs",
    "total_variation",
    "vocab_reduce",
    "vocab_topk",
]
