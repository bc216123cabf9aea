"""The app room: Hydra. Schemas in the ConfigStore, `load_config` / `compose_config`, and
the `python -m compiled_loss.run` entry point."""

from compiled_loss.app.store import compose_config, load_config

__all__ = ["compose_config", "load_config"]
