"""`PrepareOptions`: what one input preparation is given besides the logits, the batch and
the loss's declaration (`compiled_loss.interfaces.InputSpec`)."""

from __future__ import annotations

import dataclasses

import torch

from compiled_loss.parallel import ParallelGroups
from compiled_loss.vocab import DraftVocab, TrainingSamplingParams, check_chunk_size

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class PrepareOptions:
    """The keyword options of `prepare_loss_input`, checked once when built."""

    parallel: ParallelGroups = dataclasses.field(default_factory=ParallelGroups)
    """The tensor-parallel group the vocabulary is sharded over (`tp`) and the context-parallel
    group the positions are sharded over (`cp`)."""
    sampling_params: TrainingSamplingParams | None = None
    """The generation-time top-k / top-p filter LOGPROB inputs apply (ref §3.3)."""
    chunk_size: int | None = None
    """Rows per chunk of the eager vocab primitive (LOGPROB, DISTILLATION); None: its default."""
    d2t: Tensor | DraftVocab | None = None
    """DRAFT: the draft → target vocabulary map (a `DraftVocab` skips the per-call check)."""
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None
    """OPD_FULL hidden-state payloads: each loaded teacher's LM-head shard `[V_local, H]`."""

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
