"""Hydra configs; installed as the `compiled_loss.conf` package (see pyproject.toml)."""
