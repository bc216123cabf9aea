"""`python tools/bench.py`: speed and peak memory of a packed GRPO loss, side by side
(`python tools/bench.py head --help`: the LM head + loss from hidden states, beside Liger and CCE;
`python tools/bench.py speculative --help`: speculative sampling against plain decoding;
`python tools/bench.py parallel --help`: the runner's training at parallel layouts).

One run measures, per shape (packed logits `[1, T, V]`, `seqs` sequences, dtype) and per
direction (`fwd`: the forward half of a training step, logits requiring grad, autograd
state kept until the loss is dropped; `fwd+bwd`: the same plus `loss.backward()`), the
median wall time of `--repeat` calls after warm-up and the peak extra memory of those
calls, for:

- `a_loop`      NeMo-RL's eager algorithm, written here from the reference (ref §7.2, §8.10,
                §4.1): a Python loop over sequences that slices the packed logits, casts
                the slice to fp32, takes a full `log_softmax`, gathers the next-token
                targets, computes that sequence's ClippedPG loss with global normalisers,
                `.item()`s every metric and sums the losses;
- `b_eager`     compiled_loss `SequencePackingFusionLossWrapper(ClippedPGLossFn(...))`, eager;
- `c_compiled`  the same call under `torch.compile(fullgraph=True)` (inductor);
- `d_proxy`     the machine's limit for any log-softmax, compiled, under `no_grad`: `fwd`
                = one pass that reads every logit and takes its exponential
                (`exp(logits).sum(-1)`; on a CPU the exponentials, not the memory reads,
                bound it); `fwd+bwd` = that pass plus a second one that writes a
                logits-sized gradient (`exp(logits - s)`, in the logits dtype);
- `lp_compiled` compiled `compiled_loss.vocab.token_logprobs` alone (`fwd+bwd`: backward
                of its sum), against the proxy;
- `c_topp`      `c_compiled` with the generation-time filter `top_p=0.9` (nucleus
                thresholds, filtered log-probs and the unfiltered copy the KL term reads).

Compiled variants report their first call per direction (compile included; for `fwd+bwd`
that is the backward graph) as `compile_s` and are timed under the `fail_on_recompile`
stance. The tool exits with status 1 if the losses of a and b differ by more than 1e-4
relative.

The loss is GRPO's ClippedPG at its defaults (ε = 0.2, k3 KL with β = 0.01, token-level),
and every variant returns its metrics as Python floats (b/c: one `metrics_to_python`).
Each (variant, shape) runs in a fresh subprocess. Memory is the peak over the timed calls
minus what was live before them (inputs and warm-up excluded): on CPU `VmHWM − VmRSS`
after `malloc_trim` and a reset of the high-water mark through `/proc/self/clear_refs`; on CUDA
`max_memory_allocated − memory_allocated`. Writes `bench.csv` (one row per shape ×
variant × direction) and `bench.png` (needs the `bench` extra: matplotlib) to `--out`,
and prints a table with the three targets marked met / missed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    BETA,
    DTYPES,
    mark,
    nemo_rl_clipped_pg,
    peak,
    rel_diff,
    reset_peak,
    synchronize,
)

from compiled_loss.loss_functions import ClippedPGLossFn
from compiled_loss.loss_input import TrainingSamplingParams, prepare_packed_loss_input
from compiled_loss.metrics import metrics_to_python
from compiled_loss.vocab import token_logprobs
from compiled_loss.wrapper import SequencePackingFusionLossWrapper

VARIANTS = ("a_loop", "b_eager", "c_compiled", "d_proxy", "lp_compiled", "c_topp")
COMPILED = ("c_compiled", "d_proxy", "lp_compiled", "c_topp")
TOP_P = 0.9
DIRECTIONS = ("fwd", "fwd+bwd")
CSV_COLUMNS = (
    "tokens",
    "vocab",
    "seqs",
    "dtype",
    "device",
    "variant",
    "direction",
    "repeat",
    "median_ms",
    "min_ms",
    "compile_s",
    "peak_extra_mib",
    "peak_extra_rel",
    "logits_mib",
    "loss",
    "ratio_to_a",
    "ratio_to_d",
    "status",
)
DEFAULTS = {
    "tokens": [2048, 4096, 8192, 16384],
    "vocab": [32000, 128000],
    "seqs": [8, 32],
    "dtype": ["bf16", "fp32"],
    "repeat": 5,
}
QUICK = {"tokens": [512], "vocab": [2048], "seqs": [4], "dtype": ["bf16"], "repeat": 3}
TARGET_SHAPE = {"tokens": 8192, "vocab": 32000, "seqs": 32}
LOSS_RTOL = 1e-4
SEED = 0


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int
    vocab: int
    seqs: int
    dtype: str

    @property
    def label(self) -> str:
        return f"T={self.tokens} V={self.vocab} seqs={self.seqs} {self.dtype}"

    @property
    def logits_bytes(self) -> int:
        return self.tokens * self.vocab * DTYPES[self.dtype].itemsize


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # [1, T, V]
    data: dict[str, torch.Tensor]  # unpacked [B, S] (sample_mask [B])
    cu: tuple[int, ...]
    cu_padded: tuple[int, ...]
    g_seqs: torch.Tensor
    g_toks: torch.Tensor
    targets: torch.Tensor  # [T] token ids for lp_compiled


# ---- synthetic packed micro-batch --------------------------------------------------------


def make_packing(tokens: int, seqs: int, rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Random boundaries: padded lengths (multiples of 8, ≥ 16) summing to `tokens`, true
    lengths 0–7 tokens shorter."""
    if tokens % 8 or tokens < 16 * seqs:
        raise ValueError(f"tokens must be a multiple of 8 and >= 16 * seqs, got {tokens} for {seqs} seqs")
    units = tokens // 8
    weights = [rng.uniform(0.25, 1.0) for _ in range(seqs)]
    parts = [2 + int((units - 2 * seqs) * w / sum(weights)) for w in weights]
    for i in rng.sample(range(seqs), units - sum(parts)):
        parts[i] += 1
    cu, cu_padded = [0], [0]
    for p in parts:
        cu.append(cu[-1] + 8 * p - rng.randint(0, 7))
        cu_padded.append(cu_padded[-1] + 8 * p)
    return tuple(cu), tuple(cu_padded)


@torch.no_grad()
def policy_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu: tuple[int, ...],
    cu_padded: tuple[int, ...],
    rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """`[B, S]` fp32 token-indexed log-probs of `input_ids` under `logits` (column 0 and
    past-length entries 0), as a trainer stores prev/generation log-probs."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    for i in range(len(cu) - 1):
        length, start = cu[i + 1] - cu[i], cu_padded[i]
        for s in range(0, length - 1, rows_per_chunk):
            e = min(s + rows_per_chunk, length - 1)
            x = logits[0, start + s : start + e].float()
            picked = x.gather(-1, input_ids[i, s + 1 : e + 1, None]).squeeze(-1)
            out[i, s + 1 : e + 1] = picked - x.logsumexp(-1)
    return out


def make_inputs(shape: Shape, device: str) -> Inputs:
    """Deterministic packed micro-batch: N(0, 1) logits, prompts masked, one advantage per
    sequence, prev/generation/reference log-probs within a few % of the policy's."""
    rng = random.Random(SEED)
    gen = torch.Generator(device=device).manual_seed(SEED)
    cu, cu_padded = make_packing(shape.tokens, shape.seqs, rng)
    lengths = [cu[i + 1] - cu[i] for i in range(shape.seqs)]
    rows, width = shape.seqs, max(lengths)
    logits = torch.empty(1, shape.tokens, shape.vocab, dtype=DTYPES[shape.dtype], device=device)
    for s in range(0, shape.tokens, 1024):
        e = min(s + 1024, shape.tokens)
        logits[0, s:e] = torch.randn(e - s, shape.vocab, generator=gen, device=device)
    token_mask = torch.zeros(rows, width, device=device)
    for i, n in enumerate(lengths):
        token_mask[i, rng.randint(max(1, n // 8), n // 2) : n] = 1  # response after a prompt
    input_ids = torch.randint(0, shape.vocab, (rows, width), generator=gen, device=device)
    valid = (torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).float()
    valid[:, 0] = 0
    lp = policy_logprobs(logits, input_ids, cu, cu_padded)

    def noise(std: float) -> torch.Tensor:
        return std * torch.randn(rows, width, generator=gen, device=device) * valid

    prev = lp + noise(0.05)
    data = {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows, device=device),
        "advantages": torch.randn(rows, 1, generator=gen, device=device).expand(rows, width).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + noise(0.05),
        "reference_policy_logprobs": lp + noise(0.1),
    }
    return Inputs(
        logits=logits,
        data=data,
        cu=cu,
        cu_padded=cu_padded,
        g_seqs=data["sample_mask"].sum(),
        g_toks=(token_mask[:, 1:] * data["sample_mask"][:, None]).sum(),
        targets=torch.randint(0, shape.vocab, (shape.tokens,), generator=gen, device=device),
    )


def nemo_rl_packed_loss(
    logits: torch.Tensor,
    data: dict[str, torch.Tensor],
    cu: tuple[int, ...],
    cu_padded: tuple[int, ...],
    g_seqs: torch.Tensor,
    g_toks: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`SequencePackingLossWrapper.__call__` (ref §7.2) with the plain-path
    `get_next_token_logprobs_from_logits` (ref §8.10): one iteration per sequence."""
    total = logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        seq = {k: v[i : i + 1, :length] if v.dim() > 1 and v.shape[1] > 1 else v[i : i + 1] for k, v in data.items()}
        seq_logits = logits.narrow(1, cu_padded[i], cu_padded[i + 1] - cu_padded[i]).to(torch.float32)
        lp = torch.log_softmax(seq_logits[:, :-1], dim=-1)
        lp = lp.gather(-1, seq["input_ids"][:, 1:, None]).squeeze(-1)
        loss, seq_metrics = nemo_rl_clipped_pg(lp, seq, g_seqs, g_toks)
        total = total + loss
        for key, value in seq_metrics.items():
            if key.endswith("_min"):
                metrics[key] = min(metrics.get(key, math.inf), value)
            elif key.endswith("_max"):
                metrics[key] = max(metrics.get(key, -math.inf), value)
            else:
                metrics[key] = metrics.get(key, 0.0) + value
    return total, metrics


# ---- variants ------------------------------------------------------------------------------


def _apply(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _packed_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_logprobs(logits[0], targets)  # [1, T, V] -> [T], as the fused wrapper slices


def _exp_pass(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.float()).sum(-1)


def _exp_pass_and_write(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.float() - torch.exp(x.float()).sum(-1, keepdim=True).log()).to(x.dtype)


def make_runners(variant: str, inp: Inputs) -> dict[str, Callable[[], float]]:
    """One call of `variant` per direction (`fwd+bwd` adds the backward); each returns the
    loss (NaN for the proxy and the log-prob kernel). Both directions of a compiled
    variant share one compiled callable."""
    logits = inp.logits
    if variant == "d_proxy":
        proxies = {
            "fwd": torch.compile(_exp_pass, fullgraph=True),
            "fwd+bwd": torch.compile(_exp_pass_and_write, fullgraph=True),
        }

        @torch.no_grad()
        def run_proxy(direction: str) -> float:
            proxies[direction](logits)
            return math.nan

        return {d: functools.partial(run_proxy, d) for d in DIRECTIONS}
    if variant == "lp_compiled":
        logprob = torch.compile(_packed_logprobs, fullgraph=True)

        def run_logprob(backward: bool) -> float:
            lp = logprob(logits, inp.targets)
            if backward:
                lp.sum().backward()
            return math.nan

        return {d: functools.partial(run_logprob, d == "fwd+bwd") for d in DIRECTIONS}
    if variant == "a_loop":

        def run_loss(backward: bool) -> float:
            loss, _ = nemo_rl_packed_loss(logits, inp.data, inp.cu, inp.cu_padded, inp.g_seqs, inp.g_toks)
            if backward:
                loss.backward()
            return loss.item()

        return {d: functools.partial(run_loss, d == "fwd+bwd") for d in DIRECTIONS}
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": BETA})
    prepare = prepare_packed_loss_input
    if variant == "c_topp":
        prepare = functools.partial(prepare, sampling_params=TrainingSamplingParams(top_p=TOP_P))
    wrapper = SequencePackingFusionLossWrapper(loss_fn, prepare, inp.cu, inp.cu_padded)
    data = wrapper.layout.pad_data(inp.data)
    step = _apply if variant == "b_eager" else torch.compile(_apply, fullgraph=True)

    def run_wrapper(backward: bool) -> float:
        loss, metrics = step(wrapper, logits, data, inp.g_seqs, inp.g_toks)
        if backward:
            loss.backward()
        metrics_to_python(metrics)
        return loss.item()

    return {d: functools.partial(run_wrapper, d == "fwd+bwd") for d in DIRECTIONS}


# ---- measurement (worker side) --------------------------------------------------------------


def measure(variant: str, shape: Shape, device: str, repeat: int) -> list[dict[str, Any]]:
    """Both directions of one variant on one shape: warm-up, then `repeat` timed calls."""
    inp = make_inputs(shape, device)
    inp.logits.requires_grad_(True)
    runners = make_runners(variant, inp)
    rows = []
    for direction in DIRECTIONS:
        run = runners[direction]
        start = time.perf_counter()
        run()
        synchronize(device)
        first_s = time.perf_counter() - start
        run()
        inp.logits.grad = None
        gc.collect()
        before = reset_peak(device)
        times, loss = [], math.nan
        with torch.compiler.set_stance("fail_on_recompile" if variant in COMPILED else "default"):
            for _ in range(repeat):
                inp.logits.grad = None
                start = time.perf_counter()
                loss = run()
                synchronize(device)
                times.append(time.perf_counter() - start)
        peak_extra = peak(device) - before
        inp.logits.grad = None
        rows.append(
            {
                "direction": direction,
                "median_ms": 1e3 * statistics.median(times),
                "min_ms": 1e3 * min(times),
                "compile_s": first_s if variant in COMPILED else math.nan,
                "peak_extra_bytes": peak_extra,
                "loss": loss,
            }
        )
    return rows


# ---- orchestration (parent side) -------------------------------------------------------------


def run_worker(variant: str, shape: Shape, device: str, repeat: int) -> tuple[list[dict[str, Any]], str]:
    """`measure` in a fresh subprocess; returns its rows and a status ('ok' or the error)."""
    spec = json.dumps({"variant": variant, "shape": dataclasses.asdict(shape), "device": device, "repeat": repeat})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", spec], capture_output=True, text=True
    )
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1]), "ok"
    lines = proc.stderr.strip().splitlines()
    reason = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        reason = f"killed by signal {-proc.returncode} (out of memory?)"
    failed = {
        "median_ms": math.nan,
        "min_ms": math.nan,
        "compile_s": math.nan,
        "peak_extra_bytes": math.nan,
        "loss": math.nan,
    }
    return [{"direction": d, **failed} for d in DIRECTIONS], f"failed: {reason}"


def shape_rows(shape: Shape, device: str, repeat: int, variants: list[str]) -> list[dict[str, Any]]:
    """`variants` × directions of one shape, with ratios to `a_loop` and `d_proxy` (NaN when
    not run)."""
    rows = []
    for variant in variants:
        start = time.perf_counter()
        results, status = run_worker(variant, shape, device, repeat)
        print(f"  {shape.label} {variant}: {status} ({time.perf_counter() - start:.0f} s)", flush=True)
        for r in results:
            rows.append(
                {
                    "tokens": shape.tokens,
                    "vocab": shape.vocab,
                    "seqs": shape.seqs,
                    "dtype": shape.dtype,
                    "device": device,
                    "variant": variant,
                    "direction": r["direction"],
                    "repeat": repeat,
                    "median_ms": r["median_ms"],
                    "min_ms": r["min_ms"],
                    "compile_s": r["compile_s"],
                    "peak_extra_mib": r["peak_extra_bytes"] / 2**20,
                    "peak_extra_rel": r["peak_extra_bytes"] / shape.logits_bytes,
                    "logits_mib": shape.logits_bytes / 2**20,
                    "loss": r["loss"],
                    "status": status,
                }
            )
    for r in rows:
        ref = {v["variant"]: v["median_ms"] for v in rows if v["direction"] == r["direction"]}
        r["ratio_to_a"] = r["median_ms"] / ref.get("a_loop", math.nan)
        r["ratio_to_d"] = r["median_ms"] / ref.get("d_proxy", math.nan)
    return rows


def _pick(rows: list[dict[str, Any]], variant: str, direction: str) -> dict[str, Any]:
    return next(r for r in rows if r["variant"] == variant and r["direction"] == direction)


def _variants(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in rows))


def print_shape_table(shape: Shape, rows: list[dict[str, Any]]) -> bool:
    """The shape's table, ratios and loss check; False if the a/b losses disagree."""
    first, variants = rows[0], _variants(rows)
    print(
        f"\n{shape.label}: logits {first['logits_mib']:.0f} MiB on {first['device']}, "
        f"median of {first['repeat']} (min in brackets)"
    )
    print(
        f"  {'variant':<12} {'fwd ms':>17} {'fwd+bwd ms':>19} {'compile s fwd / +bwd':>21} "
        f"{'peak extra fwd':>16} {'peak extra fwd+bwd':>19}"
    )
    for variant in variants:
        f, fb = _pick(rows, variant, "fwd"), _pick(rows, variant, "fwd+bwd")
        compile_s = f"{f['compile_s']:.1f} / {fb['compile_s']:.1f}" if variant in COMPILED else "-"
        status = "" if f["status"] == "ok" else f["status"]
        print(
            f"  {variant:<12} {f['median_ms']:>8.1f} ({f['min_ms']:>6.1f}) "
            f"{fb['median_ms']:>9.1f} ({fb['min_ms']:>7.1f}) {compile_s:>21} "
            f"{f['peak_extra_rel']:>6.2f}x {f['peak_extra_mib']:>6.0f} MiB"
            f"{fb['peak_extra_rel']:>7.2f}x {fb['peak_extra_mib']:>7.0f} MiB  {status}"
        )
    if not {"a_loop", "b_eager", "c_compiled", "d_proxy", "lp_compiled"} <= set(variants):
        return True
    for direction in DIRECTIONS:
        r = {v: _pick(rows, v, direction)["median_ms"] for v in variants}
        print(
            f"  time ratios {direction:<8} b/a {r['b_eager'] / r['a_loop']:.3f}  "
            f"c/a {r['c_compiled'] / r['a_loop']:.3f}  c/d {r['c_compiled'] / r['d_proxy']:.2f}  "
            f"lp/d {r['lp_compiled'] / r['d_proxy']:.2f}   (speed-up a/c {r['a_loop'] / r['c_compiled']:.1f}x)"
        )
    agree = True
    for direction in DIRECTIONS:
        a, b, c = (_pick(rows, v, direction)["loss"] for v in ("a_loop", "b_eager", "c_compiled"))
        ok = math.isnan(a) or math.isnan(b) or rel_diff(a, b) <= LOSS_RTOL  # NaN: a worker failed
        agree = agree and ok
        print(
            f"  loss {direction:<8} a {a:.8f}  b {b:.8f}  c {c:.8f}  |a-b|/|b| {rel_diff(a, b):.1e} "
            f"({'ok' if ok else 'MISMATCH'} at {LOSS_RTOL:g})  |c-b|/|b| {rel_diff(c, b):.1e}"
        )
    return agree


def print_targets(rows: list[dict[str, Any]]) -> None:
    """The targets over every shape run (worst case; the speed-up only at its shape)."""
    print("\ntargets:")
    speedups = [
        (r["ratio_to_a"], r)
        for r in rows
        if r["variant"] == "c_compiled"
        and r["direction"] == "fwd+bwd"
        and all(r[k] == v for k, v in TARGET_SHAPE.items())
        and not math.isnan(r["ratio_to_a"])
    ]
    if speedups:
        ratio, r = max(speedups, key=lambda x: x[0])
        print(
            f"  [{mark(1 / ratio >= 5)}] compiled fused ClippedPG fwd+bwd >= 5x faster than a_loop "
            f"(32 seqs, T=8192, V=32000): {1 / ratio:.2f}x ({r['dtype']}, worst of {len(speedups)})"
        )
    else:
        print(
            "  [n/a] compiled fused ClippedPG fwd+bwd >= 5x faster than a_loop: shape "
            "T=8192 V=32000 seqs=32 (with a_loop) not in this run"
        )
    lp = [
        r for r in rows if r["variant"] == "lp_compiled" and r["direction"] == "fwd" and not math.isnan(r["ratio_to_d"])
    ]
    if lp:
        worst = max(lp, key=lambda r: r["ratio_to_d"])
        print(
            f"  [{mark(1 / worst['ratio_to_d'] >= 0.9)}] compiled logprob >= 0.9x the speed of the "
            f"machine's limit (fwd): {1 / worst['ratio_to_d']:.2f}x (worst: T={worst['tokens']} "
            f"V={worst['vocab']} seqs={worst['seqs']} {worst['dtype']})"
        )
    for variant, what in (("c_compiled", "compiled loss"), ("c_topp", f"compiled loss with top_p={TOP_P}")):
        mem = [r for r in rows if r["variant"] == variant]
        if mem:
            worst = max(mem, key=lambda r: r["peak_extra_rel"])
            print(
                f"  [{mark(worst['peak_extra_rel'] <= 1.25)}] {what} peak extra memory <= 1.25x one "
                f"logits copy: {worst['peak_extra_rel']:.2f}x (worst: {worst['direction']}, T={worst['tokens']} "
                f"V={worst['vocab']} seqs={worst['seqs']} {worst['dtype']})"
            )


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if isinstance(r[k], float) and math.isnan(r[k]) else r[k] for k in CSV_COLUMNS})


def write_plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Median time per direction and fwd+bwd peak extra memory, grouped by shape; False
    (and a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'); no plot written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["tokens"], r["vocab"], r["seqs"], r["dtype"]) for r in rows))
    labels = [f"T={t}\nV={v}\n{s} seqs\n{d}" for t, v, s, d in shapes]
    panels = [
        ("fwd", "median_ms", "fwd time (ms)"),
        ("fwd+bwd", "median_ms", "fwd+bwd time (ms)"),
        ("fwd+bwd", "peak_extra_rel", "fwd+bwd peak extra (x logits)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(6 + 2.5 * len(shapes), 4.5))
    variants = _variants(rows)
    width = 0.8 / len(variants)
    for ax, (direction, key, title) in zip(axes, panels):
        for j, variant in enumerate(variants):
            values = [
                next(
                    r[key]
                    for r in rows
                    if (r["tokens"], r["vocab"], r["seqs"], r["dtype"]) == s
                    and r["variant"] == variant
                    and r["direction"] == direction
                )
                for s in shapes
            ]
            ax.bar([i + j * width for i in range(len(shapes))], values, width, label=variant)
        ax.set_title(title)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels, fontsize=7)
        if key == "median_ms":
            ax.set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(variants), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", help=f"packed tokens T (default {DEFAULTS['tokens']})")
    p.add_argument("--vocab", type=int, nargs="+", help=f"vocabulary V (default {DEFAULTS['vocab']})")
    p.add_argument("--seqs", type=int, nargs="+", help=f"sequences per pack (default {DEFAULTS['seqs']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", help=f"logits dtype (default {DEFAULTS['dtype']})")
    p.add_argument("--repeat", type=int, help=f"timed calls per measurement (default {DEFAULTS['repeat']})")
    p.add_argument(
        "--variants", choices=VARIANTS, nargs="+", default=list(VARIANTS), help="variants to run (default: all)"
    )
    p.add_argument("--quick", action="store_true", help=f"CI-sized preset {QUICK} (explicit flags win)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory (default bench_out/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for tokens in args.tokens:
        for seqs in args.seqs:
            try:
                make_packing(tokens, seqs, random.Random(SEED))
            except ValueError as e:
                p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["head"]:  # the LM head + loss from hidden states (tools/bench_head.py)
        import bench_head

        bench_head.main(argv[1:])
        return
    if argv[:1] == ["parallel"]:  # the runner's training at parallel layouts (tools/bench_parallel.py)
        import bench_parallel

        bench_parallel.main(argv[1:])
        return
    if argv[:1] == ["speculative"]:  # speculative sampling against plain decoding (tools/bench_speculative.py)
        import bench_speculative

        bench_speculative.main(argv[1:])
        return
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(spec["variant"], Shape(**spec["shape"]), spec["device"], spec["repeat"])))
        return
    shapes = [Shape(t, v, s, d) for d in args.dtype for v in args.vocab for t in args.tokens for s in args.seqs]
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
        f"{len(shapes)} shape(s) x {len(args.variants)} variants, one subprocess each; "
        f"load average {os.getloadavg()[0]:.2f} (timings assume an otherwise idle machine)"
    )
    rows, mismatches = [], []
    for shape in shapes:
        rows_of_shape = shape_rows(shape, args.device, args.repeat, args.variants)
        rows.extend(rows_of_shape)
        if not print_shape_table(shape, rows_of_shape):
            mismatches.append(shape.label)
    print_targets(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench.csv")
    print(f"\nwrote {args.out / 'bench.csv'}")
    if write_plot(rows, args.out / "bench.png"):
        print(f"wrote {args.out / 'bench.png'}")
    if mismatches:
        sys.exit(f"loss of a_loop and b_eager differ by more than {LOSS_RTOL:g} relative at: {mismatches}")


if __name__ == "__main__":
    main()
