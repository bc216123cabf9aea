"""`compile_loss`: torch.compile for loss code, with the loss configs' floats kept constant
(layer 0: the losses compile themselves with it when their config asks)."""

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
