"""`compile_loss`: torch.compile for loss code, with the loss configs' floats kept constant,
and `CompiledModule`, a module called through it (layer 0: the losses compile themselves
with `compile_loss` when their config asks; `compiled_loss.train` re-exports both)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def compile_loss(fn: Callable[..., Any], *, recorder: Any = None, **compile_kwargs: Any) -> Callable[..., Any]:
    """`torch.compile(fn, **compile_kwargs)` (through `recorder.compile` when a
    `compiled_loss.train.CompileRecorder` is given), called with `specialize_float=True`:
    the Python floats of loss configs (clip ranges, β, …) stay constants of the graph.
    Without it, `dynamic=True` turns each into a graph input that the graph reads back
    with `.item()`."""
    compiled = recorder.compile(fn, **compile_kwargs) if recorder is not None else torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return run


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
