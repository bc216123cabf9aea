"""Compile hygiene recording: graphs, graph breaks, in-graph host syncs, recompiles and
frames that silently fell back to eager (DESIGN "torch 2.13 facts").

`fullgraph=True` and `counters["graph_break"]` hide three things on torch 2.13: `.item()`,
`nonzero`, boolean-mask indexing and unsized `repeat_interleave` are captured as in-graph
device→host syncs; a graph break inside a loop skips the whole frame (it runs eager and no
break is counted); a break in an inlined callee is reported once per enclosing frame. A
`CompileRecorder` wraps a real backend and reads Dynamo's compilation metrics so that all
of them show up, each as a problem.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import get_compilation_metrics
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

# Ops whose output size or value is data dependent: a device->host sync inside a graph.
SYNC_OPS = frozenset(
    {
        "item",
        "_local_scalar_dense",
        "nonzero",
        "unique",
        "masked_select",
        "tolist",
        "repeat_interleave",
        "unique_consecutive",
        "argwhere",
    }
)


@dataclasses.dataclass
class GraphRecord:
    compile_id: str
    ops: int
    break_reason: str | None
    break_location: str | None
    sync_ops: list[str]


@dataclasses.dataclass
class FrameRecord:
    compile_id: str
    frame: str
    recompile_reason: str | None
    fail_type: str | None
    fail_reason: str | None
    fail_location: str | None
    compile_seconds: float


# one frame of a formatted stack (`traceback.format_list`): its file, line and source line
_STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<source>[^\n]*)')


def _where(filename: str | None, lineno: int | None, line: str | None = None) -> str:
    """`path:line `source``: the whole path and the source line (read from the file when not
    given); Dynamo leaves the line out of some metrics (a frame it refused to compile)."""
    if lineno is None:
        return str(filename)
    source = (linecache.getline(filename or "", lineno) if line is None else line).strip()
    return f"{filename}:{lineno}" + (f" `{source}`" if source else "")


def _innermost(stack: str | None) -> str | None:
    """The innermost frame of a formatted stack (a node's `stack_trace`, a guard's user stack) as `_where`."""
    frames = list(_STACK_FRAME.finditer(stack or ""))
    return _where(frames[-1]["file"], int(frames[-1]["line"]), frames[-1]["source"]) if frames else None


def _first_line(text: str | None) -> str | None:
    return text.strip().splitlines()[0] if text and text.strip() else None


def _failed_guards(reason: str | None, frame: str) -> str | None:
    """Dynamo's `recompile_reason` as `guard at path:line `source`` per failed guard (`; `
    between them): the guard whole, at the user line that installed it (else at `frame`)."""
    if not reason or not reason.strip():
        return None
    guards = re.split(r"\n(?=\d+/\d+: )", reason.strip())  # one block per cache entry's failed guard
    return "; ".join(f"{g.splitlines()[0].split('  # ')[0]} at {_innermost(g) or frame}" for g in guards)


def _node_name(node: torch.fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[-1] if "." in name and not name.startswith("<") else name


def graph_sync_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes (in `gm` and its subgraphs) that introduce data-dependent sizes or scalars, each
    as `op at path:line `source`` (the user line that called it)."""
    found: list[str] = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        seen: set = set()
        for node in module.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            value = node.meta.get("example_value")
            fresh = set()
            if value is not None:
                try:
                    fresh = free_unbacked_symbols(value) - seen
                except Exception:  # non-tensor example values (tuples of mixed types)
                    fresh = set()
            seen |= fresh
            name = _node_name(node)
            base = name.split(".")[0]
            if fresh or (base in SYNC_OPS and "output_size" not in node.kwargs):
                location = _innermost(node.meta.get("stack_trace"))
                found.append(name if location is None else f"{name} at {location}")
    return found


@dataclasses.dataclass
class CompileReport:
    """What compiling one callable produced, over all its calls."""

    name: str
    calls: int = 0
    seconds: float = 0.0
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)
    frames: list[FrameRecord] = dataclasses.field(default_factory=list)

    @property
    def graph_breaks(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.break_reason]

    @property
    def recompiles(self) -> list[FrameRecord]:
        return [f for f in self.frames if f.recompile_reason]

    @property
    def eager_fallbacks(self) -> list[FrameRecord]:
        return [f for f in self.frames if f.fail_type]

    @property
    def compiles(self) -> int:
        return sum(1 for f in self.frames if not f.fail_type)

    @property
    def compile_seconds(self) -> float:
        return sum(f.compile_seconds for f in self.frames)

    def problems(self) -> list[str]:
        """Graph breaks (deduplicated by site), in-graph syncs and eager fallbacks."""
        out: list[str] = []
        breaks = {(g.break_location, g.break_reason) for g in self.graph_breaks}
        out += [f"graph break at {loc}: {why}" for loc, why in sorted(breaks, key=str)]
        out += [f"host sync in graph {g.compile_id}: {'; '.join(g.sync_ops)}" for g in self.graphs if g.sync_ops]
        out += [
            f"frame {f.frame} fell back to eager ({f.fail_type}) at {f.fail_location}: {f.fail_reason}"
            for f in self.eager_fallbacks
        ]
        return out


class CompileRecorder:
    """`torch.compile` with a recording backend wrapped around a real one.

    >>> rec = CompileRecorder("aot_eager")
    >>> fn = rec.compile(my_fn, fullgraph=True)
    >>> fn(...); rec.report.problems(), rec.report.compiles

    `mode` is Inductor's compile mode (as in `torch.compile(mode=...)`).
    """

    def __init__(self, backend: str = "inductor", name: str = "fn", mode: str | None = None) -> None:
        self._backend_name, self._mode = backend, mode
        self._inner: Callable[..., Any] | None = None
        self.report = CompileReport(name)
        self._seen_metrics = {id(m) for m in get_compilation_metrics()}

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        compile_id = str(torch._guards.CompileContext.current_compile_id())
        reason = getattr(gm, "compile_subgraph_reason", None)
        location = None
        if reason is not None and reason.graph_break and reason.user_stack:
            frame = reason.user_stack[-1]
            location = _where(frame.filename, frame.lineno, frame.line)
        self.report.graphs.append(
            GraphRecord(
                compile_id=compile_id,
                ops=sum(1 for n in gm.graph.nodes if n.op.startswith("call")),
                break_reason=_first_line(reason.reason) if reason is not None and reason.graph_break else None,
                break_location=location,
                sync_ops=graph_sync_ops(gm),
            )
        )
        return self._inner(gm, example_inputs)

    def _collect_frames(self, during_call: bool) -> None:
        """Record the compilations Dynamo reported since the last look: frames compiled during
        this recorder's own call (`during_call`), and the lazily compiled backward of frames
        it already knows; anything else belongs to another compiled callable."""
        for m in get_compilation_metrics():
            if id(m) in self._seen_metrics:
                continue
            self._seen_metrics.add(id(m))
            known = [f for f in self.report.frames if f.compile_id == str(m.compile_id)]
            if known and not m.fail_type:  # the lazily compiled backward of a known frame
                known[0].compile_seconds += m.entire_frame_compile_time_s or 0.0
                continue
            if not during_call:
                continue
            fail_location = None
            if m.fail_type and m.fail_user_frame_filename:
                fail_location = _where(m.fail_user_frame_filename, m.fail_user_frame_lineno)
            frame = f"{m.co_name} at {_where(m.co_filename, m.co_firstlineno)}"
            if m.co_name is None:  # a compile Dynamo refused (its recompile limit) names no code: its frame's
                same = [f for f in self.report.frames if f.compile_id.split("/")[0] == str(m.compile_id).split("/")[0]]
                frame = same[0].frame if same else "an unnamed frame"
            self.report.frames.append(
                FrameRecord(
                    compile_id=str(m.compile_id),
                    frame=frame,
                    recompile_reason=_failed_guards(m.recompile_reason, frame),
                    fail_type=m.fail_type,
                    fail_reason=_first_line(m.fail_reason),
                    fail_location=fail_location,
                    compile_seconds=m.entire_frame_compile_time_s or 0.0,
                )
            )

    def _record_call(self, start: float) -> None:
        self.report.calls += 1
        self.report.seconds += time.perf_counter() - start
        self._collect_frames(during_call=True)

    def compile(self, fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
        if self._backend_name == "inductor":  # what torch.compile(backend="inductor", mode=...) uses
            self._inner = torch._TorchCompileInductorWrapper(self._mode, None, compile_kwargs.get("dynamic"))
        else:
            if self._mode is not None:
                raise ValueError(f"compile mode {self._mode!r} needs the inductor backend, got {self._backend_name!r}")
            self._inner = lookup_backend(self._backend_name)
        compiled = torch.compile(fn, backend=self._backend, **compile_kwargs)

        def run(*args: Any, **kwargs: Any) -> Any:
            self._collect_frames(during_call=False)
            start = time.perf_counter()
            try:
                result = compiled(*args, **kwargs)
            except BaseException as error:  # the call's own error propagates, never one of the recording's
                try:
                    self._record_call(start)
                except Exception as recording:
                    error.add_note(f"(the compile recorder failed too: {recording!r})")
                raise
            self._record_call(start)
            return result

        return run
