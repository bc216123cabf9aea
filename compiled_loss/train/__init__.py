"""The train room: the compiled training step users import, `compile_loss`, and the
compile recorder the step and the audit report with.

- `step`: `build_train_step`, `TrainStep`, `StepOptions`, `StepResult`;
- `compile_loss` (defined in `compiled_loss.compile`);
- `recorder`: `CompileRecorder` (graphs, graph breaks, in-graph host syncs, recompiles,
  frames that fell back to eager).
"""

from compiled_loss.compile import compile_loss
from compiled_loss.train.recorder import CompileRecorder, CompileReport
from compiled_loss.train.step import StepOptions, StepResult, TrainStep, build_train_step

__all__ = [
    "CompileRecorder",
    "CompileReport",
    "StepOptions",
    "StepResult",
    "TrainStep",
    "build_train_step",
    "compile_loss",
]
