"""The `draft` config group: `none`, and one option per draft runtime generated from the
runtime's config dataclass (every field of it is a key, `compiled_loss.config.options`), and
`build_draft_runtime`."""

from __future__ import annotations

from typing import Any

import torch

from compiled_loss.checks import ConfigError
from compiled_loss.config.groups import ModelConfig
from compiled_loss.config.options import option_class, option_values
from compiled_loss.draft import DraftRuntimeBase
from compiled_loss.draft.dflash import DFlashConfig, build_dflash_runtime
from compiled_loss.draft.eagle3 import Eagle3Config, build_eagle3_runtime

NoneDraftOption = option_class("none", None, "NoneDraftOption", __name__)
Eagle3DraftOption = option_class("eagle3", Eagle3Config, "Eagle3DraftOption", __name__)
DflashDraftOption = option_class("dflash", DFlashConfig, "DflashDraftOption", __name__)

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
    values = option_values(option)
    name = values.pop("name")
    try:
        return kind[0](**values)
    except ConfigError as e:
        raise ConfigError(f"draft={name}: {e}") from None


def draft_vocab_map(config: Any, model: ModelConfig) -> torch.Tensor | None:
    """The embedded task's draft vocabulary: the first `draft_vocab_size` ids of the
    policy's (which hold the task's tokens when `draft_vocab_size >= data.vocab_needed()`),
    as a d2t map; None when the drafter predicts the whole vocabulary."""
    size = config.draft_vocab_size
    return None if size is None or size == model.vocab_size else torch.zeros(size, dtype=torch.long)


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
    """Every check the runtime's builder makes (it builds the drafter of the embedded model,
    a few MB, and drops it)."""
    build_draft_runtime(option, model)
