"""`CompiledModule`: a module called through `compile_loss` (`compiled_loss.compile`, re-exported here)."""

from __future__ import annotations

from typing import Any

import torch

from compiled_loss.compile import compile_loss

__all__ = ["CompiledModule", "compile_loss"]


class CompiledModule(torch.nn.Module):
    """`module` called through `compile_loss`, as a module: for wrappers whose own forward
    does not trace — `DistributedDataParallel(CompiledModule(model))` runs DDP's bookkeeping
    eagerly around one compiled graph of the model."""

    def __init__(self, module: torch.nn.Module, **compile_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self._run = compile_loss(module, **compile_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)
