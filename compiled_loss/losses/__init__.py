"""The losses room: one module per family, each a frozen config plus a frozen loss object
whose `__call__` is pure tensor math returning `(loss, metrics)` with 0-d tensor metrics
under NeMo-RL's keys.

- `common`: `masked_mean`, `calculate_kl`, mask / shape helpers, `ConfigError` and the
  config checks;
- `policy_gradient`: `ClippedPGLossConfig`, `ClippedPGLossFn`;
- `opd`: `OPDFullConfig`, the full-vocabulary on-policy distillation branch of `ClippedPGLossFn`;
- `nll`: `NLLLossFn`;
- `preference`: `PreferenceLossFn`, `DPOLossConfig`, `DPOLossFn`, `MPOLossConfig`, `MPOLossFn`,
  `update_reward_shift` (the MPO driver's EMA step);
- `distillation`: `DistillationLossConfig`, `DistillationLossFn`;
- `cross_tokenizer`: `CrossTokenizerDistillationLossConfig`, `CrossTokenizerDistillationLossFn`,
  `TokenProjection`;
- `value`: `MseValueLossConfig`, `MseValueLossFn`;
- `draft_ce`: `DraftLossStats` and the draft soft cross-entropy statistics (`soft_ce_stats`,
  `projected_soft_ce_stats`, `dflash_soft_ce_stats`).
"""

from compiled_loss.checks import ConfigError
from compiled_loss.edge import edge_attribute
from compiled_loss.losses.common import calculate_kl, masked_mean
from compiled_loss.losses.cross_tokenizer import (
    CrossTokenizerDistillationLossConfig,
    CrossTokenizerDistillationLossFn,
    TokenProjection,
)
from compiled_loss.losses.distillation import DistillationLossConfig, DistillationLossFn
from compiled_loss.losses.draft_ce import DEFAULT_DRAFT_TOKEN_CHUNK_SIZE, DraftLossStats
from compiled_loss.losses.nll import NLLLossFn
from compiled_loss.losses.opd import OPDFullConfig
from compiled_loss.losses.policy_gradient import (
    APPROX_ENTROPY_KEY,
    KL_PENALTY_KEY,
    ClippedPGLossConfig,
    ClippedPGLossFn,
)
from compiled_loss.losses.preference import (
    DPOLossConfig,
    DPOLossFn,
    MPOLossConfig,
    MPOLossFn,
    PreferenceLossFn,
    check_pairs,
    update_reward_shift,
)
from compiled_loss.losses.value import MseValueLossConfig, MseValueLossFn

# names with the seed's signatures, exported here and defined in the edge room (`compiled_loss.edge`)
_EDGE = {
    "DraftCrossEntropyLossFn": "loss_functions",
}


def __getattr__(name: str) -> object:
    return edge_attribute(__name__, name, _EDGE)


__all__ = [
    "APPROX_ENTROPY_KEY",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "ConfigError",
    "CrossTokenizerDistillationLossConfig",
    "CrossTokenizerDistillationLossFn",
    "DEFAULT_DRAFT_TOKEN_CHUNK_SIZE",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "DraftCrossEntropyLossFn",
    "DraftLossStats",
    "KL_PENALTY_KEY",
    "MPOLossConfig",
    "MPOLossFn",
    "MseValueLossConfig",
    "MseValueLossFn",
    "NLLLossFn",
    "OPDFullConfig",
    "PreferenceLossFn",
    "TokenProjection",
    "calculate_kl",
    "check_pairs",
    "masked_mean",
    "update_reward_shift",
]
