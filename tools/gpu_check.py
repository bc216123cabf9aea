"""`python tools/gpu_check.py`: compiled_loss on one GPU, checked in one command (≤ 10 minutes).

Four sections, each in its own processes under its own time limit; a section that fails,
crashes or runs out of time is reported failed with the reason and the others still run:

1. `audit`   the compile audit (`compiled_loss.audit.cli`'s drive and counters) of the
             library's compiled micro-batch loss on the device under Inductor, for every
             loss × packing mode on the logits and every loss the fused LM head
             (`LinearLogits`) serves under fused packing: no graph break, no in-graph host
             sync, no eager fallback, no more compiles than buckets. The audit's synthetic
             micro-batches are drawn as `compiled-loss-audit` draws them and moved to the
             device. The runner's training step is not audited here: the runner builds its
             models on the CPU.
2. `head`    `tools/bench.py head` (the LM head + loss from hidden states) for GRPO's
             ClippedPG and the NLL at B=16, T=1024, H=4096, V=128256, bf16: floor, eager,
             unfused, fused, Liger-Kernel and Cut Cross-Entropy (their Triton kernels),
             with time, peak memory (`max_memory_allocated`) and loss agreement.
3. `logprob` `tools/bench.py` (the compiled log-prob and the compiled log-softmax proxy)
             on bf16 `[1, 16384, 128256]` logits, against the device's
             bandwidth limit: the logits' bytes over a measured device-to-device copy rate
             (forward: one read; forward+backward: two reads and a gradient write).
4. `nccl`    a process group on NCCL at world size 1: raw collectives, the library's
             wrappers with that group as their tensor- and context-parallel group against no
             group (eager and compiled), and DistributedDataParallel around a model whose
             loss is the fused LM head against the plain model — loss, every metric and
             every gradient equal.

`--tiny` (automatic without CUDA) runs the same sections on the CPU at tiny sizes, on gloo,
with the audit on a reduced set under aot_eager — the check of the check, in about a
minute. Writes `report.md` and `report.json` to `--out` and exits 1 unless every section
passed. The peers install without their dependencies (`pip install --no-deps
liger-kernel==0.8.5 cut-cross-entropy==25.1.1`); a peer that is missing is an `n/a` row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import functools
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
SECTIONS = ("audit", "head", "logprob", "nccl")
RUN_ORDER = ("nccl", "head", "logprob", "audit")  # the audit takes the time the others leave
TITLES = {
    "audit": "Compile audit of the compiled loss on the device: every loss x packing mode",
    "head": "LM head + loss from hidden states, against Liger-Kernel and Cut Cross-Entropy",
    "logprob": "Compiled log-prob against the device's bandwidth limit",
    "nccl": "Process group at world size 1: parity with no group",
}
PACKAGES = ("torch", "triton", "hydra-core", "omegaconf", "liger-kernel", "cut-cross-entropy")
PARITY_RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes and limits of one run: the GPU's, or `--tiny`'s on the CPU."""

    device: str
    dist_backend: str
    compile_backend: str
    audit_dtype: str
    audit_batches: int
    audit_workers: int
    audit_tiny: bool  # a reduced set of configurations
    head_losses: tuple[str, ...]
    head_variants: tuple[str, ...]  # in the order they run
    head: tuple[str, ...]  # tools/bench.py head's other arguments
    head_variant_timeout: float
    logprob: tuple[str, ...]  # tools/bench.py's arguments
    bandwidth_mib: int
    budget: float  # seconds for the whole run
    limits: dict[str, float]  # seconds per section (the audit: what is left, at most its own)


def gpu_plan(cpus: int) -> Plan:
    return Plan(
        device="cuda",
        dist_backend="nccl",
        compile_backend="inductor",
        audit_dtype="bf16",
        audit_batches=2,
        audit_workers=max(1, min(8, cpus // 2)),
        audit_tiny=False,
        head_losses=("grpo", "nll"),
        # the fused path and the peers first: what matters most is measured before a time limit
        head_variants=("floor", "eager", "fused", "cce", "liger", "unfused"),
        head=(
            *("--batch", "16", "--seq", "1024", "--hidden", "4096", "--vocab", "128256", "--dtype", "bf16"),
            *("--chunk", "2048", "--repeat", "5"),
        ),
        head_variant_timeout=150,
        logprob=(
            *("--tokens", "16384", "--vocab", "128256", "--seqs", "32", "--dtype", "bf16"),
            *("--variants", "d_proxy", "lp_compiled", "--repeat", "10"),
        ),
        bandwidth_mib=4096,
        budget=570,
        limits={"nccl": 60, "head": 270, "logprob": 90, "audit": 570},
    )


def tiny_plan() -> Plan:
    return Plan(
        device="cpu",
        dist_backend="gloo",
        compile_backend="aot_eager",
        audit_dtype="fp32",
        audit_batches=2,
        audit_workers=1,
        audit_tiny=True,
        head_losses=("grpo", "nll"),
        head_variants=("eager", "fused", "cce", "liger"),
        head=(
            *("--batch", "2", "--seq", "16", "--hidden", "32", "--vocab", "256", "--dtype", "fp32"),
            *("--chunk", "16", "--repeat", "1", "--backend", "eager"),  # Dynamo's capture, no AOT compile
        ),
        head_variant_timeout=60,
        logprob=(
            *("--tokens", "256", "--vocab", "256", "--seqs", "2", "--dtype", "fp32"),
            *("--variants", "lp_compiled", "--repeat", "1"),
        ),
        bandwidth_mib=16,
        budget=300,
        limits={"nccl": 60, "head": 120, "logprob": 90, "audit": 120},
    )


@dataclasses.dataclass
class Section:
    name: str
    status: str = "failed"  # passed / failed
    reason: str = ""
    seconds: float = 0.0
    summary: str = ""
    text: str = ""  # markdown body
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---- processes ---------------------------------------------------------------------------


def source_imports() -> None:
    """Make `compiled_loss` importable from this checkout when it is not installed, with its
    Hydra configs (`compiled_loss.conf`: the top-level `conf/`, mapped there by an install)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(1, str(ROOT))
    if importlib.util.find_spec("compiled_loss.conf") is None:
        spec = importlib.util.spec_from_file_location(
            "compiled_loss.conf", ROOT / "conf" / "__init__.py", submodule_search_locations=[str(ROOT / "conf")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["compiled_loss.conf"] = module
        spec.loader.exec_module(module)


def child_env(plan: Plan) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if plan.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclasses.dataclass
class Finished:
    returncode: int | None  # None: killed at its time limit
    output: str  # stdout and stderr together


def run_limited(cmd: list[str], limit: float, env: dict[str, str]) -> Finished:
    """`cmd` in a new process session, killed with every process it started once `limit`
    seconds have passed."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=max(limit, 1))
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        returncode = None
    return Finished(returncode, out or "")


def _tail(text: str, lines: int = 1) -> str:
    found = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(found[-lines:]) if found else "(no output)"


def _worker(part: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--part", part, "--spec", json.dumps(spec)]


def _read_json(path: Path) -> Any:
    """What a worker wrote to `path` (None if it wrote nothing)."""
    return json.loads(path.read_text()) if path.exists() else None


# ---- 1. the compile audit ----------------------------------------------------------------


def audit_configurations(plan: Plan) -> list[tuple[str, str, str]]:
    """(loss, packing, head): every loss × packing mode on the logits, then every loss the
    fused LM head serves under fused packing (`--tiny`: three of them)."""
    if plan.audit_tiny:
        return [("clipped_pg", "fused", "logits"), ("nll", "none", "logits"), ("nll", "fused", "linear")]
    from compiled_loss.audit import cli as audit

    found = [(loss, packing, "logits") for loss in audit.LOSSES for packing in audit.PACKINGS]
    found += [(loss, "fused", "linear") for loss in audit.LOSSES]
    return [
        (loss, packing, head)
        for loss, packing, head in found
        if audit._configuration(loss, packing, "none", plan.audit_dtype, plan.compile_backend, head, "full")
    ]


def audit_label(plan: Plan, loss: str, packing: str, head: str) -> str:
    """The configuration's label, as the audit writes it."""
    from compiled_loss.audit import cli as audit

    return audit.Configuration(loss, packing, "none", plan.audit_dtype, plan.compile_backend, head).label


def to_device(x: Any, device: str) -> Any:
    """`x` with every tensor inside it (dicts, lists, tuples, dataclasses such as
    `LinearLogits`, `PackedLayout`, a loss object) on `device`; a leaf that requires grad
    stays a leaf that requires grad. Unchanged objects are returned as they are."""
    import torch

    if isinstance(x, torch.Tensor):
        moved = x.detach().to(device)
        return moved.requires_grad_() if x.requires_grad else moved
    if isinstance(x, dict):
        out = {k: to_device(v, device) for k, v in x.items()}
        return x if all(out[k] is x[k] for k in x) else out
    if isinstance(x, (list, tuple)):
        items = [to_device(v, device) for v in x]
        return x if all(a is b for a, b in zip(items, x)) else type(x)(items)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
        moved = {k: to_device(v, device) for k, v in fields.items()}
        return x if all(moved[k] is fields[k] for k in fields) else dataclasses.replace(x, **moved)
    return x


def audit_worker(spec: dict[str, Any]) -> None:
    """Drive the compiled micro-batch loss of each configuration on the device; one JSON row
    per configuration appended to `spec["out"]` as soon as it is done."""
    source_imports()
    import torch

    from compiled_loss.audit import cli as audit

    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
    for loss, packing, head in spec["configurations"]:
        c = audit.Configuration(loss, packing, "none", spec["dtype"], spec["backend"], head)
        start = time.perf_counter()
        try:
            cfg = audit._config(c, 1)
            samples = (
                (bucket, to_device(args, device), kwargs)
                for bucket, args, kwargs in audit._wrapper_samples(
                    cfg, audit._TORCH_DTYPES[c.dtype], spec["batches"], seed=spec["seed"]
                )
            )
            row = audit.drive(
                f"{c.label} wrapper",
                audit._wrapper_call,
                samples,
                c.backend,
                dynamic=cfg.compile.dynamic,
                after=lambda out: out[0].backward(),
                configuration=c.label,
            ).row()
        except Exception as e:  # a configuration that cannot run is a failed row; the others go on
            row = {"name": f"{c.label} wrapper", "configuration": c.label, "failures": [f"{type(e).__name__}: {e}"]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        with open(spec["out"], "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{c.label}: {'ok' if not row['failures'] else 'FAIL'} ({row['seconds']} s)", flush=True)


AUDIT_COLUMNS = ("calls", "graphs", "breaks", "syncs", "eager", "compiles", "recompiles", "buckets", "compile_s")


def _audit_cells(row: dict[str, Any]) -> list[str]:
    if "calls" not in row:  # the configuration raised before its drive ended
        return ["-"] * len(AUDIT_COLUMNS)
    return [
        str(row["calls"]),
        str(row["graphs"]),
        str(len(row["graph_breaks"])),
        str(len(row["syncs"])),
        str(len(row["eager_fallbacks"])),
        str(row["compiles"]),
        str(len(row["recompiles"])),
        str(row["buckets"]),
        str(row["compile_s"]),
    ]


def section_audit(plan: Plan, work: Path, limit: float, env: dict[str, str]) -> Section:
    section = Section("audit")
    configurations = audit_configurations(plan)
    workers = max(1, min(plan.audit_workers, len(configurations)))
    if plan.device == "cuda":  # Inductor's compile workers, shared out between the audit's processes
        env = dict(env, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 1) // workers)))
    procs = []
    for i in range(workers):
        spec = {
            "configurations": configurations[i::workers],
            "device": plan.device,
            "dtype": plan.audit_dtype,
            "backend": plan.compile_backend,
            "batches": plan.audit_batches,
            "seed": i,
            "out": str(work / f"audit_{i}.jsonl"),
        }
        log = open(work / f"audit_{i}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    _worker("audit", spec),
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                ),
                log,
            )
        )
    deadline = time.monotonic() + limit
    notes = []
    for i, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            notes.append(f"worker {i} stopped at the section's time limit ({limit:.0f} s)")
        log.close()
        if proc.returncode not in (0, -signal.SIGKILL):
            notes.append(f"worker {i} exited {proc.returncode}: {_tail((work / f'audit_{i}.log').read_text())}")
    rows = []
    for i in range(workers):
        path = work / f"audit_{i}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = {r["configuration"] for r in rows}
    labels = [audit_label(plan, *c) for c in configurations]
    missing = [label for label in labels if label not in done]
    failing = [r for r in rows if r["failures"]]
    order = {label: i for i, label in enumerate(labels)}
    rows.sort(key=lambda r: order.get(r["configuration"], len(order)))
    lines = [
        f"{len(rows) - len(failing)}/{len(labels)} configurations clean on {plan.device} "
        f"({plan.compile_backend}, {plan.audit_dtype}, {plan.audit_batches} micro-batches each)"
        + (f"; not run: {len(missing)}" if missing else ""),
        "",
        "| configuration | " + " | ".join(AUDIT_COLUMNS) + " | s | status |",
        "|---|" + "---|" * (len(AUDIT_COLUMNS) + 2),
    ]
    for r in rows:
        status = "ok" if not r["failures"] else "FAIL"
        lines.append(f"| {r['name']} | " + " | ".join(_audit_cells(r)) + f" | {r['seconds']} | {status} |")
    for label in missing:
        lines.append(f"| {label} wrapper | " + " | ".join("-" * len(AUDIT_COLUMNS)) + " | - | not run |")
    if failing:
        lines += ["", "Failures:", ""]
        for r in failing:
            lines += [f"- {r['name']}: " + "; ".join(r["failures"])]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    section.text = "\n".join(lines)
    section.details = {"configurations": labels, "rows": rows, "missing": missing, "notes": notes}
    section.summary = lines[0]
    if failing:
        section.reason = f"{len(failing)} configuration(s) failed: " + ", ".join(r["configuration"] for r in failing)
    elif missing:
        section.reason = f"{len(missing)} configuration(s) not run: " + "; ".join(notes or ["worker ended early"])
    else:
        section.status = "passed"
    return section


# ---- 2. the LM head bench ----------------------------------------------------------------


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


def _cell(x: float, spec: str = ".1f") -> str:
    return "-" if math.isnan(x) else format(x, spec)


def section_head(plan: Plan, work: Path, limit: float, env: dict[str, str]) -> Section:
    section = Section("head")
    out = work / "head"
    cmd = [
        sys.executable,
        str(TOOLS / "bench.py"),
        "head",
        "--device",
        plan.device,
        "--loss",
        *plan.head_losses,
        "--variants",
        *plan.head_variants,
        *plan.head,
        "--timeout",
        str(plan.head_variant_timeout),
        "--out",
        str(out),
    ]
    finished = run_limited(cmd, limit, env)
    rows = _read_csv(out / "bench_head.csv")
    import bench_head

    expected = [(loss, v) for loss in plan.head_losses for v in bench_head.VARIANTS[loss] if v in plan.head_variants]
    got = {(r["loss"], r["variant"]): r for r in rows}
    floor = {r["loss"]: _num(r["median_ms"]) for r in rows if r["variant"] == "floor"}
    lines = [
        "| loss | variant | ms (median) | x floor | compile s | peak extra MiB | loss value | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for loss, variant in expected:
        r = got.get((loss, variant))
        if r is None:
            lines.append(f"| {loss} | {variant} | - | - | - | - | - | not run |")
            continue
        ms = _num(r["median_ms"])
        lines.append(
            f"| {loss} | {variant} | {_cell(ms)} | {_cell(ms / floor.get(loss, math.nan), '.2f')} | "
            f"{_cell(_num(r['compile_s']))} | {_cell(_num(r['peak_extra_mib']), '.0f')} | "
            f"{_cell(_num(r['loss_value']), '.6f')} | {r['status']} |"
        )
    printed = finished.output.strip()
    section.text = "\n".join(lines) + f"\n\n```\n{printed}\n```"
    bad = [f"{k[0]}/{k[1]}: {got[k]['status']}" for k in expected if k in got and got[k]["status"].startswith("failed")]
    not_run = [f"{k[0]}/{k[1]}" for k in expected if k not in got]
    unavailable = [f"{k[0]}/{k[1]}" for k in expected if k in got and got[k]["status"].startswith("n/a")]
    section.details = {"rows": rows, "returncode": finished.returncode, "output": printed}
    ran = len(expected) - len(not_run) - len(unavailable) - len(bad)
    section.summary = f"{ran}/{len(expected)} variants measured" + (
        f"; n/a: {', '.join(unavailable)}" if unavailable else ""
    )
    if finished.returncode is None:
        section.reason = f"time limit ({limit:.0f} s): not run: {', '.join(not_run) or 'none'}"
    elif bad or not_run:
        section.reason = "; ".join(bad + [f"{k}: not run" for k in not_run])
    elif finished.returncode != 0:
        section.reason = _tail(printed)
    else:
        section.status = "passed"
    return section


# ---- 3. the log-prob against the bandwidth limit -----------------------------------------


def bandwidth_worker(spec: dict[str, Any]) -> None:
    """Device-to-device copy rate, bytes read + written per second (the best of 10 copies)."""
    import torch

    device, size = spec["device"], spec["mib"] * 2**20
    x = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    Path(spec["result"]).write_text(json.dumps({"bytes_per_s": 2 * size / best, "mib": spec["mib"]}))


def section_logprob(plan: Plan, work: Path, limit: float, env: dict[str, str]) -> Section:
    section = Section("logprob")
    start = time.monotonic()
    result = work / "bandwidth.json"
    spec = {"device": plan.device, "mib": plan.bandwidth_mib, "result": str(result)}
    measured = run_limited(_worker("bandwidth", spec), limit, env)
    if measured.returncode != 0:
        section.reason = f"bandwidth: {'time limit' if measured.returncode is None else _tail(measured.output)}"
        return section
    rate = _read_json(result)["bytes_per_s"]
    out = work / "logprob"
    cmd = [sys.executable, str(TOOLS / "bench.py"), "--device", plan.device, *plan.logprob, "--out", str(out)]
    finished = run_limited(cmd, limit - (time.monotonic() - start), env)
    rows = _read_csv(out / "bench.csv")
    lines = [
        f"Device-to-device copy: {rate / 1e9:.0f} GB/s (read + written, best of 10 {plan.bandwidth_mib} MiB "
        "copies). Limit: the logits' bytes at that rate, forward one read, forward+backward two reads and "
        "one gradient write.",
        "",
        "| shape | variant | direction | ms (median) | x limit | compile s | peak extra x logits | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    limits = []
    for shape in dict.fromkeys((r["tokens"], r["vocab"], r["seqs"], r["dtype"]) for r in rows):
        logits_bytes = (
            _num(next(r for r in rows if (r["tokens"], r["vocab"], r["seqs"], r["dtype"]) == shape)["logits_mib"])
            * 2**20
        )
        label = f"T={shape[0]} V={shape[1]} {shape[3]}"
        for direction, passes in (("fwd", 1), ("fwd+bwd", 3)):
            limit_ms = 1e3 * passes * logits_bytes / rate
            limits.append({"shape": label, "direction": direction, "limit_ms": limit_ms})
            lines.append(f"| {label} | bandwidth limit | {direction} | {limit_ms:.2f} | 1.00 | - | - | |")
            for r in rows:
                if (r["tokens"], r["vocab"], r["seqs"], r["dtype"]) == shape and r["direction"] == direction:
                    ms = _num(r["median_ms"])
                    lines.append(
                        f"| {label} | {r['variant']} | {direction} | {_cell(ms, '.2f')} | "
                        f"{_cell(ms / limit_ms, '.2f')} | {_cell(_num(r['compile_s']))} | "
                        f"{_cell(_num(r['peak_extra_rel']), '.2f')} | {r['status']} |"
                    )
    printed = finished.output.strip()
    section.text = "\n".join(lines) + f"\n\n```\n{printed}\n```"
    section.details = {"bytes_per_s": rate, "limits": limits, "rows": rows, "output": printed}
    lp = [r for r in rows if r["variant"] == "lp_compiled"]
    worst = {
        d: max(
            (
                _num(r["median_ms"]) / next(x["limit_ms"] for x in limits if x["direction"] == d)
                for r in lp
                if r["direction"] == d
            ),
            default=math.nan,
        )
        for d in ("fwd", "fwd+bwd")
    }
    section.summary = (
        f"copy {rate / 1e9:.0f} GB/s; lp_compiled {_cell(worst['fwd'], '.2f')}x the limit (fwd), "
        f"{_cell(worst['fwd+bwd'], '.2f')}x (fwd+bwd)"
    )
    failed = [f"{r['variant']} {r['direction']}: {r['status']}" for r in rows if r["status"] != "ok"]
    if finished.returncode is None:
        section.reason = "time limit"
    elif finished.returncode != 0:
        section.reason = _tail(printed)
    elif failed or not rows:
        section.reason = "; ".join(failed) or "no rows"
    else:
        section.status = "passed"
    return section


# ---- 4. the process group at world size 1 ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_diff(a: Any, b: Any) -> float:
    """Largest relative difference between two results (tensors, dicts, lists, floats);
    inf when their structure differs."""
    import torch

    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return math.inf
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return math.inf
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return math.inf
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if a.numel() == 0:
            return 0.0
        return ((a - b).abs() / b.abs().clamp(min=1e-12)).nan_to_num(nan=0.0).max().item()
    a, b = float(a), float(b)
    return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else abs(a - b) / max(abs(b), 1e-12)


def nccl_worker(spec: dict[str, Any]) -> None:
    """Every check on a world-size-1 group of `spec["backend"]`; prints them as JSON."""
    source_imports()
    sys.path.insert(0, str(TOOLS))
    import torch
    import torch.distributed as dist
    from bench_head import Shape, make_inputs

    from compiled_loss.loss_functions import ClippedPGLossFn, NLLLossFn
    from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
    from compiled_loss.metrics import metrics_to_python
    from compiled_loss.vocab import LinearLogits
    from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

    device, backend = spec["device"], spec["backend"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, rank=0, world_size=1, device_id=torch.device("cuda", 0) if device == "cuda" else None
    )
    world = dist.group.WORLD
    checks: list[dict[str, Any]] = []

    def check(name: str, got: Any, want: Any) -> None:
        diff = _max_diff(got, want)
        checks.append({"name": name, "ok": diff <= PARITY_RTOL, "max_rel_diff": diff})

    def attempt(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # one failing check is reported; the others still run
            checks.append({"name": name, "ok": False, "max_rel_diff": math.inf, "error": f"{type(e).__name__}: {e}"})

    gen = torch.Generator(device=device).manual_seed(0)

    def collectives() -> None:
        x = torch.randn(4096, generator=gen, device=device)
        y = x.clone()
        dist.all_reduce(y, group=world)
        check(f"all_reduce (sum) on {backend}", y, x)
        gathered = torch.empty(4096, device=device)  # world size x the input, flat
        dist.all_gather_into_tensor(gathered, x, group=world)
        check(f"all_gather_into_tensor on {backend}", gathered, x)
        z = x.clone()
        dist.broadcast(z, src=0, group=world)
        check(f"broadcast on {backend}", z, x)
        objects: list[Any] = [None]
        dist.all_gather_object(objects, {"loss": 1.25}, group=world)
        check(f"all_gather_object on {backend}", objects[0]["loss"], 1.25)

    attempt("collectives", collectives)

    shape = Shape(batch=3, seq=32, hidden=64, vocab=512, dtype="fp32", chunk=32)
    losses = {"grpo": ClippedPGLossFn({"reference_policy_kl_penalty": 0.01}), "nll": NLLLossFn()}

    def unpacked(loss: str, head: str, group: Any, compiled: bool) -> dict[str, Any]:
        inp = make_inputs(shape, device)
        h, w = inp.hidden.requires_grad_(), inp.weight.requires_grad_()
        call = functools.partial(
            wrap_loss_fn_with_input_preparation,
            loss_fn=losses[loss],
            prepare_fn=functools.partial(prepare_loss_input, chunk_size=shape.chunk),
            vocab_parallel_group=group,
            context_parallel_group=group,
        )
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(call, fullgraph=True, backend=spec["compile_backend"])
        logits = LinearLogits(h, w) if head == "linear" else torch.nn.functional.linear(h, w)
        value, metrics = call(logits, inp.data, inp.g_seqs, inp.g_toks)
        value.backward()
        return {"loss": value, "metrics": metrics_to_python(metrics), "grads": [h.grad, w.grad]}

    for loss in losses:
        for head in ("logits", "linear"):
            name = f"{loss} unpacked {head}: tp = cp = the {backend} group vs none"
            attempt(name, lambda: check(name, unpacked(loss, head, world, False), unpacked(loss, head, None, False)))
    name = f"grpo unpacked linear, compiled ({spec['compile_backend']}): the {backend} group vs none, eager"
    attempt(name, lambda: check(name, unpacked("grpo", "linear", world, True), unpacked("grpo", "linear", None, False)))

    def packed(group: Any) -> dict[str, Any]:
        from bench import Shape as PackedShape
        from bench import make_inputs as packed_inputs

        inp = packed_inputs(PackedShape(tokens=256, vocab=512, seqs=4, dtype="fp32"), device)
        logits = inp.logits.requires_grad_()
        wrapper = SequencePackingFusionLossWrapper(
            losses["grpo"],
            prepare_packed_loss_input,
            inp.cu,
            inp.cu_padded,
            vocab_parallel_group=group,
            context_parallel_group=group,
            device=device,
        )
        value, metrics = wrapper(logits, wrapper.layout.pad_data(inp.data), inp.g_seqs, inp.g_toks)
        value.backward()
        return {"loss": value, "metrics": metrics_to_python(metrics), "grads": [logits.grad]}

    name = f"grpo fused packing: tp = cp = the {backend} group vs none"
    attempt(name, lambda: check(name, packed(world), packed(None)))

    def ddp() -> None:
        torch.manual_seed(0)
        inp = make_inputs(shape, device)

        class Policy(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = torch.nn.Linear(shape.hidden, shape.hidden, device=device)
                self.head = torch.nn.Parameter(inp.weight.clone())

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.tanh(self.body(x))

        def step(model: torch.nn.Module, head: torch.Tensor) -> dict[str, Any]:
            value, metrics = wrap_loss_fn_with_input_preparation(
                LinearLogits(model(inp.hidden), head),
                inp.data,
                inp.g_seqs,
                inp.g_toks,
                loss_fn=losses["grpo"],
                prepare_fn=functools.partial(prepare_loss_input, chunk_size=shape.chunk),
            )
            value.backward()
            return {"loss": value, "metrics": metrics_to_python(metrics)}

        plain = Policy()
        replica = Policy()
        replica.load_state_dict(plain.state_dict())
        wrapped = torch.nn.parallel.DistributedDataParallel(
            replica, device_ids=[0] if device == "cuda" else None, process_group=world
        )
        want, got = step(plain, plain.head), step(wrapped, replica.head)
        want["grads"] = [p.grad for p in plain.parameters()]
        got["grads"] = [p.grad for p in replica.parameters()]
        check(f"DistributedDataParallel on {backend}, fused-head GRPO: vs the plain model", got, want)

    attempt(f"DistributedDataParallel on {backend}", ddp)
    dist.destroy_process_group()
    Path(spec["result"]).write_text(json.dumps({"checks": checks}))


def section_nccl(plan: Plan, work: Path, limit: float, env: dict[str, str]) -> Section:
    section = Section("nccl")
    # the compiled case checks that the group traces; aot_eager spares it Inductor's compile time
    result = work / "nccl.json"
    spec = {"device": plan.device, "backend": plan.dist_backend, "compile_backend": "aot_eager", "result": str(result)}
    finished = run_limited(_worker("nccl", spec), limit, env)
    if finished.returncode != 0 or not result.exists():
        section.reason = "time limit" if finished.returncode is None else _tail(finished.output)
        section.text = f"```\n{finished.output.strip()[-4000:]}\n```"
        return section
    checks = _read_json(result)["checks"]
    lines = ["| check | max relative difference | status |", "|---|---|---|"]
    for c in checks:
        status = "ok" if c["ok"] else f"FAIL {c.get('error', '')}".strip()
        lines.append(f"| {c['name']} | {c['max_rel_diff']:.1e} | {status} |")
    section.text = "\n".join(lines)
    section.details = {"checks": checks}
    failed = [c["name"] for c in checks if not c["ok"]]
    section.summary = f"{len(checks) - len(failed)}/{len(checks)} checks equal on {plan.dist_backend} (world size 1)"
    if failed:
        section.reason = "differ or failed: " + "; ".join(failed)
    else:
        section.status = "passed"
    return section


RUNNERS: dict[str, Callable[[Plan, Path, float, dict[str, str]], Section]] = {
    "audit": section_audit,
    "head": section_head,
    "logprob": section_logprob,
    "nccl": section_nccl,
}


# ---- the report --------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """Versions of what the sections need, and the device."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "packages": found,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpus": os.cpu_count(),
    }


def markdown(report: dict[str, Any], sections: list[Section]) -> str:
    env = report["environment"]
    packages = ", ".join(f"{k} {v or 'not installed'}" for k, v in env["packages"].items())
    lines = [
        "# compiled_loss GPU check",
        "",
        f"{'`--tiny` on the CPU' if report['tiny'] else 'On ' + env['device']} ({env['cpus']} CPUs), Python "
        f"{env['python']}; {packages}. {report['seconds']:.0f} s in all.",
        "",
        "| section | status | seconds | summary |",
        "|---|---|---|---|",
    ]
    for s in sections:
        status = s.status if s.status == "passed" else f"FAILED: {s.reason}"
        lines.append(f"| {s.name} | {status} | {s.seconds:.0f} | {s.summary} |")
    for i, s in enumerate(sections, 1):
        lines += ["", f"## {i}. {TITLES[s.name]} (`{s.name}`)", "", s.text or f"(failed: {s.reason})"]
    return "\n".join(lines) + "\n"


def run_sections(plan: Plan, names: list[str], work: Path, jobs: int) -> list[Section]:
    """The sections in `RUN_ORDER`, `jobs` at a time (1 where timings need the machine alone),
    each under its limit and what is left of the budget when it starts."""
    env = child_env(plan)
    start = time.monotonic()
    lock = threading.Lock()

    def run(name: str) -> Section:
        limit = min(plan.limits[name], plan.budget - (time.monotonic() - start))
        with lock:
            print(f"== {name}: started, time limit {limit:.0f} s", flush=True)
        began = time.monotonic()
        if limit < 1:
            section = Section(name, reason=f"no time left of the {plan.budget:.0f} s budget")
        else:
            try:
                section = RUNNERS[name](plan, work, limit, env)
            except Exception as e:  # a section that breaks is reported; the others still run
                section = Section(name, reason=f"{type(e).__name__}: {e}")
        section.seconds = time.monotonic() - began
        with lock:
            print(f"\n== {name}: {TITLES[name]}\n{section.text or section.reason}", flush=True)
            print(f"-- {name}: {section.status.upper()}{': ' + section.reason if section.reason else ''}\n", flush=True)
        return section

    order = [n for n in RUN_ORDER if n in names]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(order, pool.map(run, order)))
    return [done[n] for n in SECTIONS if n in done]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    p.add_argument(
        "--out", type=Path, default=Path("gpu_check_out"), help="report.md and report.json (default %(default)s/)"
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="default: all")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default: 570 on a GPU, 300 with --tiny)")
    p.add_argument(
        "--limit", action="append", default=[], metavar="SECTION=SECONDS", help="one section's time limit (repeatable)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="sections run at once (default: 1 on a GPU, where the timings need the machine alone; 2 with --tiny)",
    )
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part:
        {"audit": audit_worker, "nccl": nccl_worker, "bandwidth": bandwidth_worker}[args.part](json.loads(args.spec))
        return 0
    import torch

    source_imports()
    tiny = args.tiny or not torch.cuda.is_available()
    plan = tiny_plan() if tiny else gpu_plan(os.cpu_count() or 1)
    limits = dict(plan.limits)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item}: expected SECTION=SECONDS with SECTION in {list(SECTIONS)}")
        limits[name] = float(seconds)
    plan = dataclasses.replace(plan, limits=limits, budget=args.budget or plan.budget)
    if tiny and not args.tiny:
        print("no CUDA device: running --tiny on the CPU")
    start = time.monotonic()
    report: dict[str, Any] = {"tiny": tiny, "environment": environment(), "plan": dataclasses.asdict(plan)}
    print(f"compiled_loss GPU check on {report['environment']['device']}; {report['environment']['packages']}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        sections = run_sections(plan, args.sections, Path(tmp), args.jobs or (2 if tiny else 1))
    report["seconds"] = time.monotonic() - start
    report["sections"] = [dataclasses.asdict(s) for s in sections]
    report["passed"] = all(s.status == "passed" for s in sections)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(report, sections)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    summary = io.StringIO()
    for s in sections:
        summary.write(
            f"  {s.name:<8} {s.status if s.status == 'passed' else 'FAILED: ' + s.reason}  ({s.seconds:.0f} s)\n"
        )
    print(
        f"\n{summary.getvalue()}{'all passed' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s; "
        f"report in {args.out / 'report.md'}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
