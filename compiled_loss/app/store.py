"""Hydra's side of the configs: the dataclasses of `compiled_loss.config` registered as
schemas in the ConfigStore, and `load_config`, which turns a composed config into a typed,
validated `Config`.

Schemas are stored at the root of the store (`schema_<group>`, `schema_loss_<kind>`, `schema_draft_<kind>`),
outside the config groups, so `--help` lists only the real options; each YAML option under
`conf/<group>/` names its schema first (`- /schema_packing@_here_`), so Hydra type-checks
it. `load_config` rejects, before anything is built: unknown keys (including Hydra's
silently accepted `+key=` additions), invalid values and impossible combinations — each
message names the key.
"""

from __future__ import annotations

import dataclasses

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from compiled_loss.config import (
    DRAFT_KINDS,
    LOSS_KINDS,
    CompileConfig,
    Config,
    DataConfig,
    LogprobConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
    ParallelConfig,
    RunConfig,
)

GROUP_SCHEMAS: dict[str, type] = {
    "packing": PackingConfig,
    "parallel": ParallelConfig,
    "compile": CompileConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "logprob": LogprobConfig,
    "optim": OptimConfig,
    "run": RunConfig,
}


def register() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="schema_config", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        store.store(name=f"schema_{group}", node=node)
    for option in LOSS_KINDS:
        store.store(name=f"schema_loss_{option().name}", node=option)
    for option in DRAFT_KINDS:
        store.store(name=f"schema_draft_{option().name}", node=option)


register()


def _strict(cfg: DictConfig) -> None:
    """Reject keys the schemas do not declare (Hydra accepts `+group.key=` silently)."""
    for group in ("loss", "draft", *GROUP_SCHEMAS):
        node = cfg[group]
        schema = OmegaConf.get_type(node)
        try:
            OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node))
        except ConfigKeyError as e:
            valid = [f.name for f in dataclasses.fields(schema)]
            raise ValueError(f"{group}.{e.key}: unknown key; valid keys: {valid}") from None
    top = [f.name for f in dataclasses.fields(Config)]
    extra = sorted(set(cfg) - set(top))
    if extra:
        raise ValueError(f"unknown top-level keys {extra}; valid: {top}")


def load_config(cfg: DictConfig) -> Config:
    """Composed Hydra config → validated, typed `Config` (raises ValueError naming the key)."""
    _strict(cfg)
    return OmegaConf.to_object(cfg)


def compose_config(*overrides: str) -> Config:
    """The typed `Config` of `python -m compiled_loss.run <overrides>`, without running it."""
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        return load_config(compose(config_name="config", overrides=list(overrides)))
