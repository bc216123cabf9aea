"""The app room: the application. The run loop (`loop`: `build_run`, `train`), each step's
batch (`rollouts`, `sampler`, `batches`: GRPO advantages, DPO pairs, model annotations),
checkpoints, the metric files and curves (`curves`), and Hydra: schemas in the ConfigStore,
`load_config` / `compose_config` (`store`) and the `python -m compiled_loss.run` entry
point (`run`)."""

from compiled_loss.app.store import compose_config, load_config

__all__ = ["compose_config", "load_config"]
