"""The `draft` config group: `none`, and one option class per draft runtime, each the runtime's
config dataclass plus `name` (`compiled_loss.config.options`), and `build_draft_runtime`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from compiled_loss.checks import ConfigError, require
from compiled_loss.config.groups import ModelConfig
from compiled_loss.config.options import Option, config_of, named
from compiled_loss.draft import DraftRuntimeBase
from compiled_loss.draft.dflash import DFlashConfig, build_dflash_runtime
from compiled_loss.draft.eagle3 import Eagle3Config, build_eagle3_runtime


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoneDraftOption(Option):
    """`draft=none`: no co-trained drafter."""

    name: str = "none"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3DraftOption(Eagle3Config, Option):
    """`draft=eagle3`: the EAGLE-3 drafter; every field of `Eagle3Config` is a key."""

    name: str = "eagle3"

    def __post_init__(self) -> None:
        with named(f"draft={self.name}"):
            super().__post_init__()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DflashDraftOption(DFlashConfig, Option):
    """`draft=dflash`: the DFlash block drafter; every field of `DFlashConfig` is a key."""

    name: str = "dflash"

    def __post_init__(self) -> None:
        with named(f"draft={self.name}"):
            super().__post_init__()


# option class -> (its runtime config class, the runtime's builder)
DRAFT_KINDS: dict[type, tuple[type, Any] | None] = {
    NoneDraftOption: None,
    Eagle3DraftOption: (Eagle3Config, build_eagle3_runtime),
    DflashDraftOption: (DFlashConfig, build_dflash_runtime),
}


def draft_config(option: Any) -> Any:
    """The runtime config an option describes (None for `draft=none`); ConfigError prefixed
    with `draft=<name>`."""
    kind = DRAFT_KINDS[type(option)]
    if kind is None:
        return None
    with named(f"draft={option.name}"):
        return config_of(option, kind[0])


def draft_vocab_map(config: Any, model: ModelConfig) -> torch.Tensor | None:
    """The embedded task's draft vocabulary: the first `draft_vocab_size` ids of the
    policy's (which hold the task's tokens when `draft_vocab_size >= data.vocab_needed()`),
    as a d2t map; None when the drafter predicts the whole vocabulary."""
    size = config.draft_vocab_size
    # on the host even under a meta default device (`check_draft`): the builder reads the map
    return None if size is None or size == model.vocab_size else torch.zeros(size, dtype=torch.long, device="cpu")


def build_draft_runtime(
    option: Any, model: ModelConfig, policy: torch.nn.Module | None = None, dp_group: Any = None
) -> DraftRuntimeBase | None:
    """The draft runtime a `draft` option describes for the policy `model` (None for
    `draft=none`): the drafter's token embedding copied from `policy.embed` (frozen), on
    the policy's device; its denominators summed over `dp_group`. Errors name the option."""
    config = draft_config(option)
    if config is None:
        return None
    builder = DRAFT_KINDS[type(option)][1]
    embedding = None if policy is None else policy.embed.weight
    try:
        return builder(config, model, embedding, draft_vocab_map(config, model), dp_group)
    except ValueError as e:
        raise ConfigError(f"draft={option.name}: {e}") from None


def check_draft(option: Any, model: ModelConfig) -> None:
    """Every check of the option's runtime config and of the builder against the embedded
    policy `model`: the builder builds the drafter on the meta device (no memory, whatever the
    sizes) with one decoder layer — they are alike, and no check reads their count, which only
    costs time to build — and drops it."""
    config = draft_config(option)
    require(
        config.draft_vocab_size is None or config.draft_vocab_size <= model.vocab_size,
        f"draft.draft_vocab_size={config.draft_vocab_size} exceeds model.vocab_size={model.vocab_size}: the draft "
        "vocabulary is a subset of the policy's",
    )
    require(
        not isinstance(config, Eagle3Config) or config.hidden_size in (None, model.hidden_size),
        f"draft.hidden_size={config.hidden_size} must be null or model.hidden_size={model.hidden_size}: the EAGLE-3 "
        "drafter takes the policy's token embedding (frozen)",
    )
    if getattr(option, "num_layers", 1) > 1:
        option = dataclasses.replace(option, num_layers=1)
    try:
        with torch.device("meta"):
            build_draft_runtime(option, model)
    except RuntimeError as e:  # a weight of more elements than an int64 counts
        message = f"{size_keys(option)}: a weight would have more elements than an int64 counts ({e})"
        raise ConfigError(message) from None


def size_keys(option: Any) -> str:
    """The keys of a draft option that size the drafter's weights."""
    return ", ".join(
        f"draft.{k}"
        for k in ("hidden_size", "intermediate_size", "num_layers", "draft_vocab_size")
        if hasattr(option, k)
    )
