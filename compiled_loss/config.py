"""Hydra structured configs: the dataclasses are the truth, YAML under `conf/` picks defaults.

Every config group's schema is registered in the `ConfigStore` (`<group>/<kind>_schema`);
each YAML option names its schema first in its defaults list, so Hydra type-checks it.
Loss schemas are generated from the loss config dataclasses, so every loss field is a
Hydra key without being written twice. `load_config` turns a composed `DictConfig` into a
typed `Config` and rejects, before anything is built: unknown keys (including Hydra's
silently accepted `+key=` additions), invalid values and impossible combinations — each
message names the key.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from compiled_loss.data import FIRST_VALUE, DataConfig, Family
from compiled_loss.interfaces import LossInputType
from compiled_loss.layout import BucketGrid
from compiled_loss.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossConfig,
    DPOLossFn,
    MseValueLossConfig,
    MseValueLossFn,
    NLLLossFn,
)
from compiled_loss.loss_input import TrainingSamplingParams
from compiled_loss.model import ModelConfig


def _hydra_type(annotation: Any, name: str) -> Any:
    """OmegaConf has no `Literal`: closed string choices become an Enum (so a bad value
    fails with "expected one of [...]")."""
    if typing.get_origin(annotation) is typing.Literal:
        return enum.Enum(name, {v: v for v in typing.get_args(annotation)})
    return annotation


def _loss_schema(kind: str, config_cls: type | None, *extra: tuple[str, Any, Any]) -> type:
    """Hydra schema of a loss option: `name` plus every field of its loss config."""
    fields: list[tuple[str, Any, Any]] = [("name", str, dataclasses.field(default=kind))]
    if config_cls is not None:
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            kind_type = _hydra_type(hints[f.name], f"{config_cls.__name__}_{f.name}")
            is_enum = isinstance(kind_type, type) and issubclass(kind_type, enum.Enum)
            default = kind_type(f.default) if is_enum else f.default
            fields.append((f.name, kind_type, dataclasses.field(default=default)))
    fields += [(n, t, dataclasses.field(default=d)) for n, t, d in extra]
    return dataclasses.make_dataclass(f"{kind.title().replace('_', '')}LossSchema", fields)


ClippedPGLossSchema = _loss_schema(
    "clipped_pg", ClippedPGLossConfig, ("seq_logprob_error_threshold", typing.Optional[float], None)
)
NLLLossSchema = _loss_schema("nll", None)
DPOLossSchema = _loss_schema("dpo", DPOLossConfig)
DistillationLossSchema = _loss_schema("distillation", DistillationLossConfig)
MseValueLossSchema = _loss_schema("mse_value", MseValueLossConfig)

# schema -> (loss class, its config class, rollout family)
_LOSSES: dict[type, tuple[type, type | None, Family]] = {
    ClippedPGLossSchema: (ClippedPGLossFn, ClippedPGLossConfig, "policy_gradient"),
    NLLLossSchema: (NLLLossFn, None, "nll"),
    DPOLossSchema: (DPOLossFn, DPOLossConfig, "dpo"),
    DistillationLossSchema: (DistillationLossFn, DistillationLossConfig, "distillation"),
    MseValueLossSchema: (MseValueLossFn, MseValueLossConfig, "value"),
}


class PackingMode(enum.Enum):
    none = "none"  # padded [B, S] micro-batches
    per_sequence = "per_sequence"  # SequencePackingLossWrapper semantics
    fused = "fused"  # SequencePackingFusionLossWrapper


@dataclasses.dataclass
class PackingConfig:
    """`tokens` / `rows` / `width`: the bucket grid (see `BucketGrid`); `pad_to_multiple`:
    per-sequence padding of the packed layout (Megatron's `pad_individual_seqs_to_multiple_of`)."""

    mode: PackingMode = MISSING
    pad_to_multiple: int = 8
    tokens: int = 256
    rows: int = 8
    width: int = 128
    per_octave: int = 2

    def grid(self) -> BucketGrid:
        return BucketGrid(tokens=self.tokens, rows=self.rows, width=self.width, per_octave=self.per_octave)

    def __post_init__(self) -> None:
        if self.pad_to_multiple < 1:
            raise ValueError(f"packing.pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        try:
            self.grid()
        except ValueError as e:
            raise ValueError(f"packing: {e}") from None


@dataclasses.dataclass
class DraftConfig:
    """Co-trained drafter. Only `none` exists until the drafter runtimes land."""

    name: str = "none"

    def __post_init__(self) -> None:
        if self.name != "none":
            raise ValueError(f"draft={self.name!r} is not available yet; valid choices: ['none']")


@dataclasses.dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for key, what in (("tp", "tensor"), ("cp", "context"), ("dp", "data")):
            size = getattr(self, key)
            if size < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {size}")
            if size > 1:
                raise ValueError(
                    f"parallel.{key}={size}: {what} parallelism is not implemented yet; use parallel.{key}=1"
                )


_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class CompileConfig:
    enabled: bool = True
    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = True
    dynamic: bool | None = False

    def __post_init__(self) -> None:
        backends = sorted(torch._dynamo.list_backends(exclude_tags=()))
        if self.backend not in backends:
            raise ValueError(
                f"compile.backend={self.backend!r} is not a torch.compile backend; valid choices: {backends}"
            )
        if self.mode not in _COMPILE_MODES:
            raise ValueError(f"compile.mode={self.mode!r}; valid choices: {list(_COMPILE_MODES)}")
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"compile.mode={self.mode!r} needs compile.backend=inductor, got {self.backend!r}")


@dataclasses.dataclass
class LogprobConfig:
    """How log-probs are computed from the logits (LOGPROB losses): the generation-time
    top-k / top-p filter, the temperature the logits are divided by, and the eager-mode
    row chunk of the vocab primitive."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0
    chunk_size: int | None = None

    def sampling_params(self) -> TrainingSamplingParams | None:
        if self.top_k is None and self.top_p == 1.0 and self.temperature == 1.0:
            return None
        return TrainingSamplingParams(self.top_k, self.top_p, self.temperature)

    def __post_init__(self) -> None:
        try:
            self.sampling_params()
        except ValueError as e:
            raise ValueError(f"logprob: {e}") from None
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"logprob.chunk_size must be >= 1, got {self.chunk_size}")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0


@dataclasses.dataclass
class RunConfig:
    steps: int = 20
    micro_batches: int = 2
    seed: int = 0
    log_every: int = 1

    def __post_init__(self) -> None:
        for key in ("steps", "micro_batches", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"run.{key} must be >= 1, got {getattr(self, key)}")


@dataclasses.dataclass
class Config:
    loss: Any = MISSING
    packing: PackingConfig = MISSING
    draft: DraftConfig = MISSING
    parallel: ParallelConfig = MISSING
    compile: CompileConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    logprob: LogprobConfig = MISSING
    optim: OptimConfig = MISSING
    run: RunConfig = MISSING


_SCHEMAS: dict[str, dict[str, type]] = {
    "loss": {
        "clipped_pg_schema": ClippedPGLossSchema,
        "nll_schema": NLLLossSchema,
        "dpo_schema": DPOLossSchema,
        "distillation_schema": DistillationLossSchema,
        "mse_value_schema": MseValueLossSchema,
    },
    "packing": {"packing_schema": PackingConfig},
    "draft": {"draft_schema": DraftConfig},
    "parallel": {"parallel_schema": ParallelConfig},
    "compile": {"compile_schema": CompileConfig},
    "model": {"model_schema": ModelConfig},
    "data": {"data_schema": DataConfig},
    "logprob": {"logprob_schema": LogprobConfig},
    "optim": {"optim_schema": OptimConfig},
    "run": {"run_schema": RunConfig},
}


def register() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=group, name=name, node=node)


register()


def _strict(cfg: DictConfig) -> None:
    """Reject keys the schemas do not declare (Hydra accepts `+group.key=` silently)."""
    for group in _SCHEMAS:
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        try:
            OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node))
        except ConfigKeyError as e:
            valid = [f.name for f in dataclasses.fields(schema)]
            raise ValueError(f"{group}.{e.key}: unknown key; valid keys: {valid}") from None
    extra = sorted(set(cfg) - {f.name for f in dataclasses.fields(Config)})
    if extra:
        raise ValueError(f"unknown top-level keys {extra}; valid: {[f.name for f in dataclasses.fields(Config)]}")


def load_config(cfg: DictConfig) -> Config:
    """Composed Hydra config → validated, typed `Config` (raises ValueError naming the key)."""
    _strict(cfg)
    typed: Config = OmegaConf.to_object(cfg)
    _check_combinations(typed)
    return typed


def loss_family(cfg: Config) -> Family:
    return _LOSSES[type(cfg.loss)][2]


def build_loss(loss_cfg: Any) -> Any:
    """The loss object a `loss` config node describes."""
    loss_cls, config_cls, _ = _LOSSES[type(loss_cfg)]
    values = {
        f.name: getattr(loss_cfg, f.name).value if isinstance(getattr(loss_cfg, f.name), enum.Enum)
        else getattr(loss_cfg, f.name)
        for f in dataclasses.fields(loss_cfg)
    }
    name = values.pop("name")
    try:
        if config_cls is None:
            return loss_cls()
        extra = {k: values.pop(k) for k in list(values) if k not in {f.name for f in dataclasses.fields(config_cls)}}
        return loss_cls(config_cls(**values), **extra)
    except ValueError as e:
        raise ValueError(f"loss={name}: {e}") from None


def _check_combinations(cfg: Config) -> None:
    loss = build_loss(cfg.loss)
    name = cfg.loss.name
    logprob = cfg.logprob
    if loss.input_type != LossInputType.LOGPROB:
        for key, value, default in (("top_k", logprob.top_k, None), ("top_p", logprob.top_p, 1.0),
                                    ("chunk_size", logprob.chunk_size, None)):
            if value != default:
                raise ValueError(
                    f"logprob.{key}={value} applies to log-prob losses only; loss={name} reads "
                    f"{loss.input_type.value} inputs"
                )
    if loss_family(cfg) == "value" and logprob.temperature != 1.0:
        raise ValueError(f"logprob.temperature={logprob.temperature} has no meaning for loss={name} (a value head)")
    rows = cfg.data.prompts * (2 if loss_family(cfg) == "dpo" else cfg.data.group_size)
    units = rows // 2 if loss_family(cfg) == "dpo" else rows
    if cfg.run.micro_batches > units:
        raise ValueError(
            f"run.micro_batches={cfg.run.micro_batches} exceeds the {units} "
            f"{'pairs' if loss_family(cfg) == 'dpo' else 'rows'} of a global batch "
            f"(data.prompts × {'1 pair' if loss_family(cfg) == 'dpo' else 'data.group_size'})"
        )
    longest = cfg.data.max_length() + cfg.packing.pad_to_multiple
    if cfg.model.max_positions < longest:
        raise ValueError(
            f"model.max_positions={cfg.model.max_positions} is shorter than the longest padded "
            f"sequence the data can produce ({longest}: data.prompt_terms_max + data.response_max "
            f"+ 2 + packing.pad_to_multiple)"
        )
    if cfg.data.modulus + FIRST_VALUE > cfg.model.vocab_size:
        raise ValueError(
            f"data.modulus={cfg.data.modulus} needs model.vocab_size >= {cfg.data.modulus + FIRST_VALUE}, "
            f"got {cfg.model.vocab_size}"
        )
    if loss_family(cfg) == "distillation" and cfg.data.teacher_topk > cfg.model.vocab_size:
        raise ValueError(
            f"data.teacher_topk={cfg.data.teacher_topk} exceeds model.vocab_size={cfg.model.vocab_size}"
        )
