"""The config room: typed dataclasses for every config group and the builders from a
config to what it describes. Plain dataclasses — the Hydra application (`compiled_loss.app`)
registers them as schemas, and code can build them directly.

- `groups`: packing, parallel, compile, logprob, optim, run, model, data;
- `options`: option dataclasses generated from a loss's or a drafter's config;
- `losses`: one option per loss kind, `build_loss`, `loss_family`;
- `drafts`: `none` and one option per draft runtime, `build_draft_runtime`;
- `root`: `Config` and its cross-group checks.
"""

from compiled_loss.config.drafts import DRAFT_KINDS, build_draft_runtime, draft_config
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
from compiled_loss.config.losses import LOSS_KINDS, Family, build_loss, loss_family
from compiled_loss.config.root import Config

__all__ = [
    "DRAFT_KINDS",
    "LOSS_KINDS",
    "TASK_SPECIAL_TOKENS",
    "CompileConfig",
    "Config",
    "DataConfig",
    "Family",
    "LogprobConfig",
    "ModelConfig",
    "OptimConfig",
    "PackingConfig",
    "PackingMode",
    "ParallelConfig",
    "RunConfig",
    "build_draft_runtime",
    "build_loss",
    "draft_config",
    "loss_family",
]
