"""The whole run's typed config, and the checks that span groups."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Any

import torch

from compiled_loss.checks import FLOAT32, ConfigError, require
from compiled_loss.config.drafts import DRAFT_KINDS, DraftOption, NoneDraftOption, check_draft
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
from compiled_loss.config.losses import (
    LOSS_KINDS,
    ClippedPgLossOption,
    LossOption,
    MpoLossOption,
    build_loss,
    loss_family,
)
from compiled_loss.interfaces import LossFunction, LossInputType
from compiled_loss.packing import round_to_bucket

if TYPE_CHECKING:
    _LossField = LossOption
    _DraftField = DraftOption
else:
    # What Hydra sees: OmegaConf's structured configs take a Union of primitive types only, not
    # one of dataclasses, so `ConfigStore` registers `loss` and `draft` as Any (each option's own
    # schema, `schema_loss_<name>` / `schema_draft_<name>`, types its keys); type checkers see
    # the union of the option classes.
    _LossField = _DraftField = Any


@dataclasses.dataclass(kw_only=True)
class Config:
    """One training run: a loss and every other group (see `compiled_loss.config.groups`)."""

    loss: _LossField = None  # type: ignore[assignment]  # None: replaced in __post_init__
    """A loss option (one of `compiled_loss.config.LOSS_KINDS`); None: GRPO with the reference's defaults."""
    packing: PackingConfig = dataclasses.field(default_factory=PackingConfig)
    """How micro-batches are laid out: padded rows or packed, and the bucket grid."""
    draft: _DraftField = None  # type: ignore[assignment]  # None: replaced in __post_init__
    """A draft option (one of `compiled_loss.config.DRAFT_KINDS`); None: no co-trained drafter."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Tensor-, context- and data-parallel sizes."""
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    """Whether and how the training step is compiled."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The embedded policy's sizes and dtype."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """The synthetic task and the global batch."""
    logprob: LogprobConfig = dataclasses.field(default_factory=LogprobConfig)
    """How log-probs are taken from the logits: sampling filters, temperature, chunking, fused LM head."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and gradient clipping."""
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Steps, micro-batches, seed, logging and checkpoints."""

    def plain(self) -> dict[str, Any]:
        """The config as plain data (dicts, lists, strings, numbers, None; enums as their
        values): what a checkpoint stores and a logger records."""
        return _plain(self)

    @functools.cached_property
    def loss_fn(self) -> LossFunction:
        """The loss `loss` describes, built once (`build_loss`): the checks below read its
        input type, the training step runs it. Not a field, so the Hydra schema,
        `dataclasses.fields`, equality and a checkpoint's config see only the options; a copy
        or a pickle carries it, `dataclasses.replace` builds a new `Config` and so a new loss."""
        return build_loss(self.loss)

    def __post_init__(self) -> None:
        """Cross-group checks, in this order; each group checked its own fields when it was built."""
        self._check_kinds()
        self._check_logprob()
        self._check_lengths()
        self._check_vocabulary()
        self._check_parallel()
        self._check_buckets()
        self._check_loss_options()
        if self.draft.name != "none":
            self._check_draft()

    def _check_kinds(self) -> None:
        """`loss` and `draft` are option objects of their kinds (None: the defaults)."""
        for group, kinds in (("loss", LOSS_KINDS), ("draft", DRAFT_KINDS)):
            value = getattr(self, group)
            if value is not None and not isinstance(value, tuple(kinds)):
                classes = ", ".join(f"{cls.__name__} ({cls().name})" for cls in kinds)
                raise ConfigError(
                    f"Config({group}={value!r}): {group} takes an option object, one of {classes}; "
                    f"by name, compose it: compiled_loss.app.compose_config('{group}=<name>')"
                )
        if self.loss is None:
            self.loss = ClippedPgLossOption()
        if self.draft is None:
            self.draft = NoneDraftOption()

    def _check_logprob(self) -> None:
        """The log-prob options against the inputs the loss reads."""
        loss, name, logprob = self.loss_fn, self.loss.name, self.logprob
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
            loss_family(self.loss) != "value" or logprob.temperature == 1.0,
            f"logprob.temperature={logprob.temperature} has no meaning for loss={name} (a value head)",
        )

    def _batch_units(self) -> tuple[int, str]:
        """What a global batch splits into (DPO's pairs, else the sampled rows) and their name."""
        if loss_family(self.loss) == "dpo":
            return self.data.prompts, "pairs"
        return self.data.prompts * self.data.group_size, "rows"

    def _check_lengths(self) -> None:
        """Micro-batches against the global batch, positions against the longest sequence."""
        units, unit = self._batch_units()
        require(
            self.run.micro_batches <= units,
            f"run.micro_batches={self.run.micro_batches} exceeds the {units} {unit} of a global batch "
            f"(data.prompts × {'1 pair' if unit == 'pairs' else 'data.group_size'})",
        )
        length, length_keys = self.longest_sequence()
        longest = length + self.packing.pad_to_multiple
        require(
            self.model.max_positions >= longest,
            f"model.max_positions={self.model.max_positions} is shorter than the longest padded sequence the "
            f"data can produce ({longest}: {length_keys} + packing.pad_to_multiple)",
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

    def _check_vocabulary(self) -> None:
        """What reads ids or top-k sets against the model's vocabulary."""
        vocab, top_k = self.model.vocab_size, self.logprob.top_k
        require(
            self.data.vocab_needed() <= vocab,
            f"data.modulus={self.data.modulus} needs model.vocab_size >= {self.data.vocab_needed()}, got {vocab}",
        )
        require(
            self.data.teacher_topk <= vocab,
            f"data.teacher_topk={self.data.teacher_topk} exceeds model.vocab_size={vocab}",
        )
        require(
            top_k is None or top_k <= vocab,
            f"logprob.top_k={top_k} exceeds model.vocab_size={vocab}: a top-k of the whole "
            "vocabulary filters nothing (null disables the filter)",
        )

    def _check_parallel(self) -> None:
        """The parallel sizes against the vocabulary, the loss, the compiler, the packing and the batch."""
        tp, cp, dp = self.parallel.tp, self.parallel.cp, self.parallel.data_parallel
        name = self.loss.name
        require(
            self.model.vocab_size % tp == 0,
            f"model.vocab_size={self.model.vocab_size} must divide evenly over parallel.tp={tp} vocabulary shards",
        )
        require(
            self.loss_fn.input_type != LossInputType.DISTILLATION_CROSS_TOKENIZER or (tp, cp) == (1, 1),
            f"loss={name} reads whole student and teacher distributions: it runs at parallel.tp = parallel.cp = 1 "
            f"(as NeMo-RL's does), got parallel.tp={tp}, parallel.cp={cp}",
        )
        require(
            not (self.compile.enabled and self.compile.backend == "eager" and (tp, cp) != (1, 1))
            or torch.__version__ >= "2.12",
            f"compile.backend=eager with parallel.tp={tp}, parallel.cp={cp} is refused on torch {torch.__version__}: "
            "torch 2.11's Dynamo drops the gradient of a collective inside an autograd.Function under the eager "
            "backend (the gradients come out zero, with no error); use compile.backend=aot_eager or inductor",
        )
        require(
            self.packing.pad_to_multiple % (2 * cp) == 0,
            f"packing.pad_to_multiple={self.packing.pad_to_multiple} must be a multiple of 2 × parallel.cp = "
            f"{2 * cp} (each sequence is cut into 2·cp context-parallel chunks)",
        )
        units, unit = self._batch_units()
        require(
            self.data.prompts % dp == 0 and self.run.micro_batches * dp <= units,
            f"data.prompts={self.data.prompts} must split evenly over the {dp} data-parallel ranks (parallel.dp × "
            f"parallel.dp_shard), each with at least run.micro_batches={self.run.micro_batches} {unit}",
        )

    def _check_buckets(self) -> None:
        """The bucket grid against the longest micro-batch and `compile.max_buckets`."""
        _, tokens, batch_keys = self.longest_micro_batch()
        packing = self.packing
        require(
            packing.per_octave <= tokens,
            f"packing.per_octave={packing.per_octave} exceeds {tokens}, the tokens of the longest micro-batch "
            f"({batch_keys}): with as many buckets per octave as the sizes it splits, the grid is the plain one "
            "(packing.per_octave=0)",
        )
        buckets = self.bucket_bound()
        require(
            buckets <= self.compile.max_buckets,
            f"the bucket grid (packing.tokens={packing.tokens}, .rows={packing.rows}, "
            f".width={packing.width}, .per_octave={packing.per_octave}) puts the longest micro-batch "
            f"({batch_keys}) and the smaller ones into up to {buckets} distinct shape buckets, more than "
            f"compile.max_buckets={self.compile.max_buckets} (one compile each): coarsen the grid or raise "
            "compile.max_buckets",
        )

    def _check_loss_options(self) -> None:
        """Loss options the embedded run constrains, and what the fused LM head can serve."""
        loss, name = self.loss_fn, self.loss.name
        if isinstance(self.loss, MpoLossOption):
            shift = self.loss.reward_shift
            rows, _, batch_keys = self.longest_micro_batch()
            require(
                abs(shift) * rows <= FLOAT32.max,
                f"loss.reward_shift={shift}: the BCO term sums about |reward_shift| per row of a micro-batch in "
                f"float32, which overflows for the {rows} rows of the longest one ({batch_keys}); "
                f"|loss.reward_shift| must be <= {FLOAT32.max / rows:.4g}",
            )
        if loss_family(self.loss) == "opd_full":
            payload = loss.opd_full.teacher_payload
            require(
                payload == "logits",
                f"loss.teacher_payload={payload} needs the teacher's LM head at input preparation; the embedded run "
                "hands the loss its teacher's logits: use loss.teacher_payload=logits",
            )
        if self.logprob.fused_linear:
            require(
                loss.input_type in (LossInputType.LOGPROB, LossInputType.DISTILLATION),
                f"logprob.fused_linear=true never forms the policy's logits; loss={name} reads "
                f"{loss.input_type.value} inputs, which are made from them (only log-prob and distillation losses "
                "take the final hidden states and the LM head)",
            )
            require(
                self.draft.name == "none",
                f"logprob.fused_linear=true never forms the policy's logits; draft={self.draft.name} reads them as "
                "its teacher: use draft=none or logprob.fused_linear=false",
            )

    def _check_draft(self) -> None:
        """The drafter against the loss, the model and the data: what one sequence and one
        micro-batch can hold."""
        draft = self.draft
        require(
            loss_family(self.loss) != "value",
            f"draft={draft.name} reads the policy's logits; loss={self.loss.name} trains a value head",
        )
        check_draft(draft, self.model)
        length, length_keys = self.longest_sequence()
        _, tokens, batch_keys = self.longest_micro_batch()
        sequence = f"the longest sequence the data can produce holds {length} tokens ({length_keys})"
        if draft.name == "eagle3":
            require(
                draft.ttt_steps <= length - 2,
                f"draft.ttt_steps={draft.ttt_steps} exceeds {length - 2}: step k predicts the token k + 2 places "
                f"after its slot inside one sequence, and {sequence}",
            )
        if draft.name == "dflash":
            require(
                draft.block_size <= length,
                f"draft.block_size={draft.block_size} exceeds {length}: a block's slots lie inside one sequence, and "
                f"{sequence}",
            )
            require(
                draft.num_anchors <= tokens,
                f"draft.num_anchors={draft.num_anchors} exceeds {tokens}, the tokens of the longest micro-batch "
                f"({batch_keys}): anchors are positions of one micro-batch",
            )

    def bucket_bound(self) -> int:
        """The most distinct shape buckets the training step's micro-batches can fall into
        (`BucketGrid.bound` of the longest micro-batch), times the micro-batch counts a step
        can run with a drafter (its loss is normalised by that count, a constant of the graph)."""
        rows, _, _ = self.longest_micro_batch()
        packing = self.packing
        bound = packing.grid().bound(
            rows,
            self.data.max_length(),
            packed=packing.mode != PackingMode.none,
            pad_to_multiple=packing.pad_to_multiple,
        )
        return bound * (self.run.micro_batches if self.draft.name != "none" else 1)

    def longest_sequence(self) -> tuple[int, str]:
        """The most tokens one sequence of the data holds (`DataConfig.max_length`) and the keys
        that give it."""
        data = self.data
        response = (
            "data.response_max + 2"
            if data.response_max >= data.total_terms - data.prompt_terms_min
            else "data.total_terms - data.prompt_terms_min + 2"
        )
        return data.max_length(), f"data.prompt_terms_max + {response}"

    def longest_micro_batch(self) -> tuple[int, int, str]:
        """(rows, tokens, the keys that give them) of the longest micro-batch a replica runs,
        before the bucket grid: the most rows a split of its share of the global batch over
        `run.micro_batches` gives one micro-batch — of the sampled rows (`data.prompts ×
        data.group_size`, the warm start's too) or of DPO's pairs — each as long as the
        longest sequence padded to `packing.pad_to_multiple`."""
        data, parts = self.data, self.parallel.data_parallel * self.run.micro_batches
        multiple = self.packing.pad_to_multiple
        rows = -(-data.prompts * data.group_size // parts)
        keys = "data.prompts × data.group_size"
        if loss_family(self.loss) == "dpo" and 2 * -(-data.prompts // parts) > rows:
            rows, keys = 2 * -(-data.prompts // parts), "2 × data.prompts"
        length = -(-self.data.max_length() // multiple) * multiple
        return (
            rows,
            rows * length,
            (
                f"{rows} rows ({keys} / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × {length} "
                "tokens (the longest sequence padded to packing.pad_to_multiple)"
            ),
        )


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
