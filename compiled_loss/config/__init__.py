"""The config room: typed dataclasses for every config group and the builders from a
config to what it describes. Plain dataclasses — the Hydra application (`compiled_loss.app`)
registers them as schemas, and code can build them directly.

- `groups`: packing, parallel, compile, logprob, optim, run, model, data;
- `options`: what the `loss` and `draft` options share (`Option`: their `name`);
- `losses`: one option class per loss kind (its loss's config dataclass plus `name`),
  `build_loss`, and the registry `LOSS_KINDS` (option class -> `LossKind`: what the run
  builds and feeds the loss; `loss_kind`, `loss_family`);
- `drafts`: `none` and one option class per draft runtime (its config plus `name`),
  `build_draft_runtime`, and the registry `DRAFT_KINDS` (option class -> `DraftKind`;
  `draft_kind`);
- `root`: `Config`, the loss it describes built once (`Config.loss_fn`), and its cross-group
  checks.
"""

from compiled_loss.config.drafts import (
    DRAFT_KINDS,
    DraftKind,
    build_draft_runtime,
    draft_config,
    draft_kind,
    draft_names,
    drafter_name,
)
from compiled_loss.config.groups import (
    TASK_SPECIAL_TOKENS,
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
    LOSS_FAMILIES,
    LOSS_KINDS,
    Family,
    LossKind,
    ModelOutputs,
    Teacher,
    build_loss,
    loss_family,
    loss_kind,
    loss_names,
)
from compiled_loss.config.root import Config

__all__ = [
    "DRAFT_KINDS",
    "LOSS_FAMILIES",
    "LOSS_KINDS",
    "TASK_SPECIAL_TOKENS",
    "CompileConfig",
    "Config",
    "DataConfig",
    "DraftKind",
    "Family",
    "LogprobConfig",
    "LossKind",
    "ModelConfig",
    "ModelOutputs",
    "OptimConfig",
    "PackingConfig",
    "PackingMode",
    "ParallelConfig",
    "RunConfig",
    "Teacher",
    "build_draft_runtime",
    "build_loss",
    "draft_config",
    "draft_kind",
    "draft_names",
    "drafter_name",
    "loss_family",
    "loss_kind",
    "loss_names",
]
