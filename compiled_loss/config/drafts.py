"""The `draft` config group: `none`, and one option class per draft runtime, each the runtime's
config dataclass plus `name` (`compiled_loss.config.options`), `build_draft_runtime`, and the
registry of kinds: `DRAFT_KINDS` maps each option class to its `DraftKind` — everything the
application, the memory estimate, a resume and the audit read of a drafter, declared once here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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


def _eagle3_metrics(option: Any) -> tuple[str, ...]:
    """The loss and top-1 agreement at the first and last TTT step."""
    last = option.ttt_steps - 1
    return ("draft_loss", "draft_full_acc@0") + ((f"draft_full_acc@{last}",) if last else ())


def _dflash_metrics(option: Any) -> tuple[str, ...]:
    """The loss, τ, the first slot's accept rate and top-1 agreement."""
    return ("draft_loss", "draft_tau", "draft_accept_rate@1", "draft_acc@1")


def _eagle3_logits(option: Any, slots: int, vocab: int) -> tuple[str, int]:
    return f"draft.ttt_steps × {slots} slots × {vocab}", option.ttt_steps * slots * vocab * 4


def _dflash_logits(option: Any, slots: int, vocab: int) -> tuple[str, int]:
    return f"draft.num_anchors × draft.block_size × {vocab}", option.num_anchors * option.block_size * vocab * 4


def _no_speculative_bound(option: Any, gamma: int) -> None:
    """Any `run.speculative_tokens` within the response: an EAGLE-3 chain is as long as asked."""


def _dflash_speculative_bound(option: Any, gamma: int) -> None:
    """One DFlash block proposes `block_size - 1` tokens."""
    require(
        gamma <= option.block_size - 1,
        f"run.speculative_tokens={gamma} exceeds draft.block_size - 1 = {option.block_size - 1}, the "
        "tokens one DFlash block proposes",
    )


@dataclasses.dataclass(frozen=True)
class DraftKind:
    """What the application, the memory estimate, a resume and the audit know of a drafter:
    `DRAFT_KINDS` maps each option class to its kind. `draft=none`'s kind has no `config`."""

    config: type | None = None
    """The runtime's config dataclass (None: no co-trained drafter)."""
    build: Any = None
    """`build(config, model, embedding, d2t, dp_group) -> runtime`: the runtime's builder."""
    metrics: Callable[[Any], tuple[str, ...]] = lambda option: ()
    """`metrics(option)`: the draft metrics shown on a step's line and in the summary."""
    logits: Callable[[Any, int, int], tuple[str, int]] | None = None
    """`logits(option, slots, vocab) -> (what, bytes)`: the drafter's float32 logits of a micro-batch."""
    speculative_bound: Callable[[Any, int], None] = _no_speculative_bound
    """`speculative_bound(option, gamma)`: ConfigError where one proposal cannot hold
    `run.speculative_tokens=gamma` tokens."""
    fixed_on_resume: tuple[str, ...] = ()
    """The keys a resume may not change (the drafter's state depends on them)."""

    @property
    def co_trained(self) -> bool:
        """A drafter trains beside the policy."""
        return self.config is not None


DraftOption = NoneDraftOption | Eagle3DraftOption | DflashDraftOption
"""A `draft` option: one of the keys of `DRAFT_KINDS`."""

# option class -> its kind
DRAFT_KINDS: dict[type, DraftKind] = {
    NoneDraftOption: DraftKind(),
    Eagle3DraftOption: DraftKind(Eagle3Config, build_eagle3_runtime, _eagle3_metrics, _eagle3_logits),
    DflashDraftOption: DraftKind(
        DFlashConfig,
        build_dflash_runtime,
        _dflash_metrics,
        _dflash_logits,
        _dflash_speculative_bound,
        # a static number of anchors per replica and micro-batch, seeded by both (`anchor_seed`):
        # these change what a step computes
        fixed_on_resume=("parallel.dp", "run.micro_batches"),
    ),
}


def draft_kind(option: Any) -> DraftKind:
    """The kind of a draft option."""
    return DRAFT_KINDS[type(option)]


def draft_names() -> dict[str, DraftKind]:
    """Every `draft` option name -> its kind."""
    return {cls().name: kind for cls, kind in DRAFT_KINDS.items()}


def drafter_name(option: Any) -> str | None:
    """The name of the co-trained drafter an option chooses (None for `draft=none`)."""
    return option.name if draft_kind(option).co_trained else None


def draft_config(option: Any) -> Any:
    """The runtime config an option describes (None for `draft=none`); ConfigError prefixed
    with `draft=<name>`."""
    kind = draft_kind(option)
    if kind.config is None:
        return None
    with named(f"draft={option.name}"):
        return config_of(option, kind.config)


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
    builder = draft_kind(option).build
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
