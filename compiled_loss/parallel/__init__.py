"""Process groups and collectives: the single-process checks every entry point runs."""

from compiled_loss.parallel.groups import group_size, require_single_process

__all__ = ["group_size", "require_single_process"]
