"""The whole run's typed config, and the checks that span groups."""

from __future__ import annotations

import dataclasses
from typing import Any

from compiled_loss.checks import require
from compiled_loss.config.drafts import NoneDraftOption, check_draft
from compiled_loss.config.groups import (
    CompileConfig,
    DataConfig,
    LogprobConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
    PackingMode,
    ParallelConfig,
    RunConfig,
)
from compiled_loss.config.losses import ClippedPgLossOption, build_loss, loss_family
from compiled_loss.interfaces import LossInputType
from compiled_loss.packing import round_to_bucket


@dataclasses.dataclass(kw_only=True)
class Config:
    """One training run: a loss and every other group (see `compiled_loss.config.groups`)."""

    loss: Any = None
    """A loss option (`compiled_loss.config.losses`); None: GRPO with the reference's defaults."""
    packing: PackingConfig = dataclasses.field(default_factory=PackingConfig)
    draft: Any = None
    """A draft option (`compiled_loss.config.drafts`); None: no co-trained drafter."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    logprob: LogprobConfig = dataclasses.field(default_factory=LogprobConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        """Cross-group checks; each group checked its own fields when it was built."""
        if self.loss is None:
            self.loss = ClippedPgLossOption()
        if self.draft is None:
            self.draft = NoneDraftOption()
        loss = build_loss(self.loss)
        name, family = self.loss.name, loss_family(self.loss)
        logprob = self.logprob
        if loss.input_type != LossInputType.LOGPROB:
            for key, value, default in (("top_k", logprob.top_k, None), ("top_p", logprob.top_p, 1.0)):
                require(
                    value == default,
                    f"logprob.{key}={value} applies to log-prob losses only; loss={name} reads "
                    f"{loss.input_type.value} inputs",
                )
        require(
            logprob.chunk_size is None or loss.input_type in (LossInputType.LOGPROB, LossInputType.DISTILLATION),
            f"logprob.chunk_size={logprob.chunk_size} applies to log-prob and distillation losses; loss={name} "
            f"reads {loss.input_type.value} inputs",
        )
        require(
            family != "value" or logprob.temperature == 1.0,
            f"logprob.temperature={logprob.temperature} has no meaning for loss={name} (a value head)",
        )
        pairs = family == "dpo"
        units = self.data.prompts if pairs else self.data.prompts * self.data.group_size
        require(
            self.run.micro_batches <= units,
            f"run.micro_batches={self.run.micro_batches} exceeds the {units} {'pairs' if pairs else 'rows'} of a "
            f"global batch (data.prompts × {'1 pair' if pairs else 'data.group_size'})",
        )
        longest = self.data.max_length() + self.packing.pad_to_multiple
        data = self.data
        response = ("data.response_max + 2" if data.response_max >= data.total_terms - data.prompt_terms_min
                    else "data.total_terms - data.prompt_terms_min + 2")
        require(
            self.model.max_positions >= longest,
            f"model.max_positions={self.model.max_positions} is shorter than the longest padded sequence the "
            f"data can produce ({longest}: data.prompt_terms_max + {response} + packing.pad_to_multiple)",
        )
        if self.packing.mode == PackingMode.none:  # padded rows: a micro-batch's width rounds up to the bucket grid
            grid = self.packing.grid()
            width = round_to_bucket(self.data.max_length(), grid.width, grid.per_octave)
            width += -width % (2 * self.parallel.cp)
            require(
                self.model.max_positions >= width,
                f"model.max_positions={self.model.max_positions} is shorter than the padded row width of the longest "
                f"sequence under packing=none ({width}: the data's longest row rounded up to packing.width="
                f"{grid.width}); raise model.max_positions or lower packing.width",
            )
        require(
            self.data.vocab_needed() <= self.model.vocab_size,
            f"data.modulus={self.data.modulus} needs model.vocab_size >= {self.data.vocab_needed()}, "
            f"got {self.model.vocab_size}",
        )
        require(
            family != "distillation" or self.data.teacher_topk <= self.model.vocab_size,
            f"data.teacher_topk={self.data.teacher_topk} exceeds model.vocab_size={self.model.vocab_size}",
        )
        tp, cp, dp = self.parallel.tp, self.parallel.cp, self.parallel.dp
        require(
            self.model.vocab_size % tp == 0,
            f"model.vocab_size={self.model.vocab_size} must divide evenly over parallel.tp={tp} vocabulary shards",
        )
        require(
            self.packing.pad_to_multiple % (2 * cp) == 0,
            f"packing.pad_to_multiple={self.packing.pad_to_multiple} must be a multiple of 2 × parallel.cp = "
            f"{2 * cp} (each sequence is cut into 2·cp context-parallel chunks)",
        )
        require(
            self.data.prompts % dp == 0 and self.run.micro_batches * dp <= units,
            f"data.prompts={self.data.prompts} must split evenly over parallel.dp={dp} replicas, each with at "
            f"least run.micro_batches={self.run.micro_batches} {'pairs' if pairs else 'rows'}",
        )
        if self.logprob.fused_linear:
            require(
                family != "value",
                f"logprob.fused_linear=true computes the loss from the LM head; loss={name} trains a value head",
            )
            require(
                family != "opd_full",
                f"logprob.fused_linear=true never forms the policy's logits; loss={name} compares them with the "
                "teacher's over the whole vocabulary",
            )
            require(
                self.draft.name == "none",
                f"logprob.fused_linear=true never forms the policy's logits; draft={self.draft.name} reads them as "
                "its teacher: use draft=none or logprob.fused_linear=false",
            )
        if self.draft.name != "none":
            require(
                family != "value",
                f"draft={self.draft.name} reads the policy's logits; loss={name} trains a value head",
            )
            check_draft(self.draft, self.model)
