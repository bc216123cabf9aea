"""Front-ends in the signatures other ecosystems call.

- `compiled_loss.integrations.liger`: Liger-Kernel's chunked-loss modules
  (`FusedLinearGRPOLoss`, `FusedLinearCrossEntropyLoss`, `FusedLinearDPOLoss`,
  `FusedLinearJSDLoss`), from hidden states and the LM head, compiled.
- `compiled_loss.integrations.trl`: TRL's `GRPOTrainer` computing its loss with
  `FusedLinearGRPOLoss` (imports `trl`: the `[hf]` extra).

Neither needs Hydra; only `compiled_loss.integrations.trl` imports `transformers` / `trl`.
"""

from compiled_loss.integrations.liger import (
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
)

__all__ = ["FusedLinearCrossEntropyLoss", "FusedLinearDPOLoss", "FusedLinearGRPOLoss", "FusedLinearJSDLoss"]
