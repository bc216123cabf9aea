"""The config room: typed dataclasses for every config group and the builders from a
config to what it describes. Plain dataclasses — the Hydra application (`compiled_loss.app`)
registers them as schemas, and code can build them directly.

- `groups`: packing, draft, parallel, compile, logprob, optim, run, model, data;
- `losses`: one option per loss kind, `build_loss`, `loss_family`;
- `root`: `Config` and its cross-group checks.
"""

from compiled_loss.config.groups import (
    TASK_SPECIAL_TOKENS,
    CompileConfig,
    DataConfig,
    DraftConfig,
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
    "LOSS_KINDS",
    "TASK_SPECIAL_TOKENS",
    "CompileConfig",
    "Config",
    "DataConfig",
    "DraftConfig",
    "Family",
    "LogprobConfig",
    "ModelConfig",
    "OptimConfig",
    "PackingConfig",
    "PackingMode",
    "ParallelConfig",
    "RunConfig",
    "build_loss",
    "loss_family",
]
