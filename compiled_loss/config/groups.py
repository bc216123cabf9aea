"""Typed configs of the config groups other than `loss` and `draft` (plain dataclasses; the Hydra
application registers them as schemas). Each validates its own fields when constructed:
types, finiteness and ranges, with messages that name the key."""

from __future__ import annotations

import dataclasses
import difflib
import enum

import torch

from compiled_loss.checks import FLOAT32, ConfigError, check_factor, check_fields, require
from compiled_loss.packing import BucketGrid
from compiled_loss.vocab import TrainingSamplingParams


def _fields(cfg: object, group: str) -> None:
    """`check_fields` with the group's name in front of each key."""
    try:
        check_fields(cfg)
    except ConfigError as e:
        raise ConfigError(f"{group}.{e}") from None


def _at_least(cfg: object, group: str, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        require(value >= minimum, f"{group}.{name} must be >= {minimum}, got {value}")


class PackingMode(enum.Enum):
    none = "none"  # padded [B, S] micro-batches
    per_sequence = "per_sequence"  # SequencePackingLossWrapper semantics
    fused = "fused"  # SequencePackingFusionLossWrapper


@dataclasses.dataclass(kw_only=True)
class PackingConfig:
    """How micro-batches are laid out for the model and the loss. The bucket steps are bounded
    by what the run can allocate (`compiled_loss.app.store.check_run`)."""

    mode: PackingMode = PackingMode.fused
    """none: padded [B, S] rows; per_sequence / fused: one packed [1, T] row per micro-batch."""
    pad_to_multiple: int = 8
    """Each packed sequence is padded to a multiple of this (Megatron's pad_individual_seqs_to_multiple_of)."""
    tokens: int = 256
    """Bucket grid step of the packed length T."""
    rows: int = 8
    """Bucket grid step of the number of sequences (1 or even)."""
    width: int = 128
    """Bucket grid step of the row width S."""
    per_octave: int = 2
    """At most this many buckets per power-of-two octave of each size (0: plain grid)."""

    def grid(self) -> BucketGrid:
        return BucketGrid(tokens=self.tokens, rows=self.rows, width=self.width, per_octave=self.per_octave)

    def __post_init__(self) -> None:
        _fields(self, "packing")
        _at_least(self, "packing", 1, "pad_to_multiple")
        try:
            self.grid()
        except ValueError as e:
            raise ValueError(f"packing: {e}") from None


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Parallel sizes; their product must equal the number of processes (`torchrun`)."""

    tp: int = 1
    """Tensor parallel size: the model's DTensor TP plan (attention heads, MLP, embedding and LM head sharded;
    the loss reads vocabulary-sharded logits)."""
    cp: int = 1
    """Context (sequence) parallel size: the loss's positions are sharded over it, the parameters with FSDP."""
    dp: int = 1
    """Data parallel replicas (FSDP2's replicate dimension)."""
    dp_shard: int = 1
    """Data parallel shards: FSDP2 shards parameters, gradients and optimizer state over dp_shard × cp; with dp
    > 1 too the run is HSDP."""

    def __post_init__(self) -> None:
        _fields(self, "parallel")
        _at_least(self, "parallel", 1, "tp", "cp", "dp", "dp_shard")

    @property
    def data_parallel(self) -> int:
        """The ranks that read rows of their own: dp · dp_shard."""
        return self.dp * self.dp_shard

    @property
    def world(self) -> int:
        """The processes the sizes describe: dp · dp_shard · cp · tp."""
        return self.dp * self.dp_shard * self.cp * self.tp


MAX_BUCKETS = 100_000  # the largest compile.max_buckets
_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(kw_only=True)
class CompileConfig:
    """torch.compile of the training step (model forward + loss)."""

    enabled: bool = True
    """False runs the step eagerly."""
    backend: str = "inductor"
    """A torch.compile backend: inductor, aot_eager, eager, …"""
    mode: str | None = None
    """Inductor's mode (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs)."""
    fullgraph: bool = True
    """Fail on a graph break instead of splitting the graph."""
    dynamic: bool | None = False
    """False: one compile per bucket (static shapes); True: one compile in all; None: torch's default."""
    max_buckets: int = 256
    """The most distinct shape buckets the training step compiles (Dynamo's recompile limit of the step is
    raised to it); a run whose bucket grid can produce more is refused when the config loads."""

    def __post_init__(self) -> None:
        registered = torch._dynamo.list_backends(exclude_tags=())  # torch's debugging and test backends too
        if self.backend not in registered:
            usual = sorted({*torch._dynamo.list_backends(), "aot_eager", "eager"})
            close = difflib.get_close_matches(self.backend, registered, n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"compile.backend={self.backend!r} is not a torch.compile backend; {guess}valid choices: {usual} (or "
                "any other torch._dynamo.list_backends(exclude_tags=()) names)"
            )
        require(self.mode in _COMPILE_MODES, f"compile.mode={self.mode!r}; valid choices: {list(_COMPILE_MODES)}")
        require(
            self.mode is None or self.backend == "inductor",
            f"compile.mode={self.mode!r} needs compile.backend=inductor, got {self.backend!r}",
        )
        _fields(self, "compile")
        _at_least(self, "compile", 1, "max_buckets")
        require(
            self.max_buckets <= MAX_BUCKETS,
            f"compile.max_buckets must be <= {MAX_BUCKETS} (Dynamo keeps every graph it compiles), "
            f"got {self.max_buckets}",
        )


@dataclasses.dataclass(kw_only=True)
class LogprobConfig:
    """How log-probs are computed from the logits (log-prob losses)."""

    top_k: int | None = None
    """Generation-time top-k filter; None or <= 0 disables."""
    top_p: float = 1.0
    """Generation-time nucleus filter in (0, 1]; 1.0 disables."""
    temperature: float = 1.0
    """The logits are divided by it before the loss and the sampler, in [1e-6, 1e6]: it scales the logits
    and their gradient by 1/temperature (`compiled_loss.checks.FACTOR_MAX`)."""
    chunk_size: int | None = None
    """Rows per chunk of the vocab primitive in eager mode (None: ~4 MiB of fp32); with
    fused_linear, rows per LM-head chunk, compiled or not (None: ~16 MiB of fp32 logits),
    raised to N / 16 rows where it would make more than 16 chunks (the values do not depend
    on the chunking)."""
    fused_linear: bool = False
    """Compute the loss from the final hidden states and the LM head, chunk by chunk,
    without the [T, V] logits (the model is called with `linear_logits=True` and returns
    `LinearLogits`)."""

    def sampling_params(self) -> TrainingSamplingParams | None:
        if self.top_k is None and self.top_p == 1.0 and self.temperature == 1.0:
            return None
        return TrainingSamplingParams(self.top_k, self.top_p, self.temperature)

    def __post_init__(self) -> None:
        _fields(self, "logprob")
        try:
            self.sampling_params()
        except ValueError as e:
            raise ValueError(f"logprob: {e}") from None
        check_factor(
            "logprob.temperature", self.temperature, "the logits and their gradient are scaled by 1/temperature"
        )
        if self.chunk_size is not None:
            _at_least(self, "logprob", 1, "chunk_size")


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """AdamW."""

    lr: float = 5e-4
    """Learning rate of the loss's steps; > 0, lr / (1 - beta1) (AdamW's first step) a float32, and
    lr · weight_decay < 1."""
    sft_lr: float = 3e-3
    """Learning rate of the warm start (`run.sft_steps`, its own AdamW); bounded as `lr`."""
    draft_lr: float = 3e-3
    """Learning rate of the co-trained drafter (`draft=eagle3` / `dflash`) in both phases: its own parameter group
    in each AdamW, so it keeps up with the policy it imitates; bounded as `lr`."""
    weight_decay: float = 0.0
    """Decoupled weight decay: every weight is multiplied by 1 - lr · weight_decay per step; >= 0."""
    beta1: float = 0.9
    """First-moment decay in [0, 1)."""
    beta2: float = 0.95
    """Second-moment decay in [0, 1)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this, in [1e-6, 1e6] (it scales the gradient, `FACTOR_MAX`); None
    disables."""

    def __post_init__(self) -> None:
        _fields(self, "optim")
        for name in ("lr", "sft_lr", "draft_lr"):
            require(getattr(self, name) > 0, f"optim.{name} must be > 0, got {getattr(self, name)}")
        require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"optim.{name} must be in [0, 1), got {value}")
        clip = self.grad_clip
        require(clip is None or clip > 0, f"optim.grad_clip must be > 0 (or null to disable), got {clip}")
        check_factor("optim.grad_clip", clip, "the gradient is scaled to at most this norm")
        for name in ("lr", "sft_lr", "draft_lr"):
            lr = getattr(self, name)
            require(
                lr / (1 - self.beta1) <= FLOAT32.max,
                f"optim.{name}={lr} with optim.beta1={self.beta1}: AdamW's first step size lr / (1 - beta1) = "
                f"{lr / (1 - self.beta1):.3g} overflows float32",
            )
            require(
                lr * self.weight_decay < 1,
                f"optim.{name} × optim.weight_decay = {lr * self.weight_decay:.3g} must be < 1: decoupled weight "
                "decay multiplies every weight by 1 - lr · weight_decay per step, which zeroes or flips the weights "
                "at 1 and above",
            )


LOGGERS = ("jsonl", "tensorboard", "wandb")  # the choices of `run.loggers`


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """The training loop."""

    sft_steps: int = 27
    """Warm start: the first this many of `steps` train NLL on correct responses (a value head, which has no LM
    head, skips them); at least one of `steps` must be left for the loss (`compiled_loss.app.store.check_run`)."""
    steps: int = 177
    """Optimizer steps of the whole run, the warm start's included: the first `sft_steps` train NLL, the rest the
    loss."""
    micro_batches: int = 2
    """Micro-batches per step (gradients accumulate)."""
    seed: int = 0
    """Seed of the model init, the prompts and the sampler (with the step count, it must keep the sampler's
    generator seed in 64 bits: checked by `compiled_loss.app.store.check_run`)."""
    log_every: int = 1
    """Log a line of metrics every this many steps and after the last (<= steps)."""
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    """Where each step's metrics go ([jsonl] by default), a list of: jsonl (metrics.jsonl in the run directory;
    curves.png is drawn from it), tensorboard (an event file in the run directory; pip install
    'compiled_loss[tensorboard]'), wandb (a Weights & Biases run, offline unless WANDB_MODE says otherwise; pip
    install 'compiled_loss[wandb]')."""
    validate_inputs: bool = True
    """Check each batch on the host before the compiled step reads it (`validate_batch`)."""
    save_every: int = 0
    """Write a checkpoint every this many steps (warm start included) and after the last; 0: never (<= steps)."""
    keep_last: int = 0
    """Keep this run's newest this many checkpoints (an older one is deleted once a newer one is written); 0: all
    (<= steps)."""
    resume: str | None = None
    """Continue from this checkpoint (a file `run.save_every` wrote)."""
    deterministic: bool = False
    """Deterministic kernels and Inductor's deterministic mode: bitwise-repeatable runs."""
    compile_cache: str | None = None
    """A file of torch's portable compile-cache artifacts and Inductor's C++ kernel libraries: loaded at start when it
    exists (a graph or kernel it holds is read, not compiled; `load_compile_cache`, which also sets the Inductor
    options the file is for), written after a step that compiled something it lacks (rank 0; `save_compile_cache`)."""
    speculative: bool = False
    """Sample with speculative decoding: the co-trained drafter (draft=eagle3 or dflash) proposes speculative_tokens
    tokens a round and the policy verifies them in one forward, its distribution kept exactly
    (`compiled_loss.app.speculative`); each step also times plain decoding of the same prompts for the speed-up."""
    speculative_tokens: int = 4
    """γ: the tokens the drafter proposes a round (>= 1; draft=dflash: <= draft.block_size - 1)."""

    def warm_start_steps(self, family: str) -> int:
        """The steps of the warm start of a run whose loss is of `family`: `sft_steps`, none for a value head."""
        return 0 if family == "value" else self.sft_steps

    def __post_init__(self) -> None:
        _fields(self, "run")
        _at_least(self, "run", 1, "steps", "micro_batches", "log_every", "speculative_tokens")
        _at_least(self, "run", 0, "sft_steps", "save_every", "keep_last")
        require(
            isinstance(self.loggers, list) and all(isinstance(name, str) for name in self.loggers),
            f"run.loggers must be a list of names ({', '.join(LOGGERS)}), got {self.loggers!r}",
        )
        given = f"run.loggers=[{','.join(self.loggers)}]"
        for name in self.loggers:
            require(name in LOGGERS, f"{given}: unknown logger {name!r}; choices: {', '.join(LOGGERS)}")
        require(len(set(self.loggers)) == len(self.loggers), f"{given} names a logger twice")
        require(self.compile_cache != "", "run.compile_cache must name a file or be null, got ''")
        for name, larger in (
            ("log_every", "logs the last step's line only"),
            ("save_every", "writes after the last step only"),
            ("keep_last", "keeps every checkpoint: a run writes at most one per step"),
        ):
            value = getattr(self, name)
            require(
                value <= self.steps,
                f"run.{name}={value} exceeds run.steps={self.steps}: a larger value {larger}, as "
                f"run.{name}={self.steps} does",
            )


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The policy's causal LM: the embedded one (random init) or a Hugging Face `transformers`
    one (`architecture=hf`). Its sizes are bounded by what the run can allocate
    (`compiled_loss.app.store.check_run`)."""

    vocab_size: int = 2048
    """Vocabulary size."""
    hidden_size: int = 128
    """Width of the residual stream (divisible by num_heads)."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    mlp_ratio: int = 4
    """MLP width / hidden_size."""
    max_positions: int = 1024
    """Learned positions (longest packed sequence)."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    architecture: str = "tiny"
    """tiny: the embedded TinyLM; hf: a Hugging Face transformers causal LM (`model=hf`; pip install
    'compiled_loss[hf]'), built from the sizes above (random init, no download) or loaded from hf_path."""
    hf_model_type: str = "llama"
    """architecture=hf: the transformers model_type built from the sizes above (one of
    compiled_loss.demo.hf.SUPPORTED_MODEL_TYPES: llama, qwen2, mistral, granite, cohere, …;
    its MLP is mlp_ratio × hidden_size wide, max_positions its max_position_embeddings); unused with hf_path."""
    hf_path: str | None = None
    """architecture=hf: a local directory of a transformers causal LM (config.json and weights, as
    save_pretrained writes them; nothing is downloaded), loaded with its own sizes in place of the built one;
    its vocabulary must be vocab_size."""

    def __post_init__(self) -> None:
        _fields(self, "model")
        _at_least(
            self, "model", 1, "vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "max_positions"
        )
        require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})",
        )
        require(
            self.dtype in ("float32", "bfloat16"), f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}"
        )
        require(
            self.architecture in ("tiny", "hf"),
            f"model.architecture must be 'tiny' or 'hf', got {self.architecture!r}",
        )
        require(
            self.hf_path is None or self.architecture == "hf",
            f"model.hf_path={self.hf_path} needs model.architecture=hf (model=hf)",
        )


TASK_SPECIAL_TOKENS = 3  # PAD, BOS, EOS precede the task's values in the vocabulary


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """The synthetic task: continue an arithmetic progression modulo `modulus`. The batch and
    the sequences are bounded by the model (`Config`) and by what the run can allocate
    (`compiled_loss.app.store.check_run`)."""

    prompts: int = 8
    """Prompts per global batch."""
    group_size: int = 16
    """Responses per prompt (a GRPO group; DPO trains on its best and worst)."""
    prompt_terms_min: int = 3
    """Fewest progression terms in a prompt."""
    prompt_terms_max: int = 8
    """Most progression terms in a prompt."""
    response_median: float = 16.0
    """Median response length (log-normal, > 0)."""
    response_sigma: float = 0.7
    """Log-normal sigma of the response length (>= 0)."""
    response_max: int = 96
    """Longest response."""
    modulus: int = 64
    """Values are taken modulo this (the task vocabulary)."""
    max_stride: int = 3
    """Largest progression stride (<= modulus)."""
    total_terms: int = 16
    """Sampled (on-policy) rows: a correct response continues the progression until the
    sequence holds this many terms, then EOS (> prompt_terms_max)."""
    use_leave_one_out_baseline: bool = False
    """GRPO baseline: the mean reward of the group's OTHER responses (RLOO) instead of the group's mean."""
    normalize_rewards: bool = True
    """GRPO: divide each advantage by its baseline's reward std (+1e-6) where that is > 0."""
    error_rate_max: float = 0.6
    """Pre-made rows are drawn with a per-token error rate in [0, this], in [0, 1]."""
    teacher_topk: int = 16
    """Teacher top-k width for distillation."""

    def __post_init__(self) -> None:
        _fields(self, "data")
        _at_least(
            self,
            "data",
            1,
            "prompts",
            "group_size",
            "prompt_terms_min",
            "response_max",
            "modulus",
            "max_stride",
            "teacher_topk",
        )
        require(
            self.prompt_terms_max >= self.prompt_terms_min,
            f"data.prompt_terms_max ({self.prompt_terms_max}) must be >= data.prompt_terms_min "
            f"({self.prompt_terms_min})",
        )
        require(
            self.max_stride <= self.modulus,
            f"data.max_stride ({self.max_stride}) must be <= data.modulus ({self.modulus}): a stride d + modulus "
            "continues a progression as the stride d does",
        )
        require(
            self.total_terms > self.prompt_terms_max,
            f"data.total_terms ({self.total_terms}) must be > data.prompt_terms_max ({self.prompt_terms_max})",
        )
        require(self.response_median > 0, f"data.response_median must be > 0, got {self.response_median}")
        require(self.response_sigma >= 0, f"data.response_sigma must be >= 0, got {self.response_sigma}")
        require(0.0 <= self.error_rate_max <= 1.0, f"data.error_rate_max must be in [0, 1], got {self.error_rate_max}")

    def max_length(self) -> int:
        """Longest sequence: BOS + prompt + response + EOS (pre-made), or a longest prompt and
        the sampler's response bucket (on-policy: the longest correct response and EOS)."""
        return 1 + self.prompt_terms_max + max(self.response_max + 1, self.total_terms - self.prompt_terms_min + 1)

    def vocab_needed(self) -> int:
        """Token ids the task uses: the special tokens, then `modulus` values."""
        return TASK_SPECIAL_TOKENS + self.modulus
