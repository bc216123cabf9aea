"""`python tools/bench.py head`: the LM head + GRPO loss from hidden states, side by side.

One run measures, per shape (`[B, T]` rows of hidden states `[B, T, H]`, an LM head
`[V, H]`, dtype), the median wall time of `--repeat` forward+backward calls after warm-up
and their peak extra memory (as `tools/bench.py` measures it), for:

- `floor`    the machine's floor for any LM head + loss: its three matmuls alone (logits
             `h·Wᵀ`, `dH = G·W`, `dW = Gᵀ·h` for a preallocated logits-sized `G`);
- `eager`    NeMo-RL's eager path (ref §5.1, §8.10, §4.1): the LM head, a full fp32
             `log_softmax` of the logits, the gather, ClippedPG with every metric
             `.item()`-ed;
- `unfused`  the LM head (eager) + compiled_loss's compiled loss on the logits
             (`wrap_loss_fn_with_input_preparation`, ClippedPG; the logits are kept);
- `fused`    compiled_loss compiled from the hidden states: the same call on
             `LinearLogits(h, W)` (chunks of `--chunk` rows; no `[T, V]` logits);
- `liger`    Liger-Kernel's `LigerFusedLinearGRPOLoss` (`loss_type="bnpo"`: the token
             mean ClippedPG takes; `compiled=True`), when installed (`pip install -e
             '.[bench]'`).

All compute GRPO's ClippedPG at its defaults (ε = 0.2, k3 KL with β = 0.01, token-level
mean) on the same data, so the losses must agree (the tool exits 1 if `unfused`, `fused`
or `liger` differ from `eager` by more than 1e-4 relative). Each (variant, shape) runs in a
fresh subprocess; compiled variants report their first call (compile included) as
`compile_s`. Prints a table per shape and the targets (fused ≤ 0.9× liger, ≤ 1.4× floor,
≤ 1.1× unfused; fused peak extra memory ≤ dW + dH + 2 chunks of fp32 logits, and ≤
liger's), and writes `bench_head.csv` to `--out`.
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
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench import BETA, CLIP_EPS, DTYPES, _mark, _peak, _rel_diff, _reset_peak, _synchronize, nemo_rl_clipped_pg

from compiled_loss.loss_functions import ClippedPGLossFn
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.metrics import metrics_to_python
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

VARIANTS = ("floor", "eager", "unfused", "fused", "liger")
COMPILED = ("unfused", "fused", "liger")
DEFAULTS = {
    "batch": [4],
    "seq": [512],
    "hidden": [256, 1024],
    "vocab": [32000, 128256],
    "dtype": ["fp32"],
    "repeat": 3,
    "chunk": 1024,
}
LOSS_RTOL = 1e-4
SEED = 0
CSV_COLUMNS = (
    "batch",
    "seq",
    "hidden",
    "vocab",
    "dtype",
    "chunk",
    "variant",
    "repeat",
    "median_ms",
    "min_ms",
    "compile_s",
    "peak_extra_mib",
    "loss",
    "status",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    hidden: int
    vocab: int
    dtype: str
    chunk: int

    @property
    def label(self) -> str:
        return f"B={self.batch} T={self.seq} H={self.hidden} V={self.vocab} {self.dtype}"

    @property
    def fused_budget_bytes(self) -> int:
        """dW + dH + two chunks of fp32 logits: the fused path's allowance."""
        size = DTYPES[self.dtype].itemsize
        return (self.vocab + self.batch * self.seq) * self.hidden * size + 2 * self.chunk * self.vocab * 4


@dataclasses.dataclass
class Inputs:
    hidden: torch.Tensor  # [B, T + 1, H]: T predictions per row (the last position predicts nothing)
    weight: torch.Tensor  # [V, H]
    data: dict[str, torch.Tensor]  # [B, T + 1]
    g_seqs: torch.Tensor
    g_toks: torch.Tensor


def make_inputs(shape: Shape) -> Inputs:
    """Hidden states with unit-variance logits, responses after a prompt, one advantage per
    row, prev/generation/reference log-probs within a few % of the policy's."""
    gen = torch.Generator().manual_seed(SEED)
    dtype, rows, width = DTYPES[shape.dtype], shape.batch, shape.seq + 1
    hidden = torch.randn(rows, width, shape.hidden, generator=gen).to(dtype)
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen) / math.sqrt(shape.hidden)).to(dtype)
    input_ids = torch.randint(0, shape.vocab, (rows, width), generator=gen)
    with torch.no_grad():
        lp = torch.zeros(rows, width)
        for i in range(rows):
            logits = torch.nn.functional.linear(hidden[i, :-1], weight).float()
            lp[i, 1:] = logits.log_softmax(-1).gather(-1, input_ids[i, 1:, None])[:, 0]
    token_mask = torch.zeros(rows, width)
    token_mask[:, width // 4 :] = 1  # the response after a prompt

    def noise(std: float) -> torch.Tensor:
        return std * torch.randn(rows, width, generator=gen)

    prev = lp + noise(0.05)
    data = {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=gen).expand(rows, width).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + noise(0.05),
        "reference_policy_logprobs": lp + noise(0.1),
    }
    return Inputs(hidden, weight, data, data["sample_mask"].sum(), token_mask[:, 1:].sum())


LOSS_FN = ClippedPGLossFn({"reference_policy_kl_penalty": BETA})


def _clipped_pg(logits: torch.Tensor | LinearLogits, data: dict[str, torch.Tensor], g_seqs, g_toks, chunk=None):
    return wrap_loss_fn_with_input_preparation(
        logits,
        data,
        g_seqs,
        g_toks,
        loss_fn=LOSS_FN,
        prepare_fn=functools.partial(prepare_loss_input, chunk_size=chunk),
    )


def _fused(hidden, weight, data, g_seqs, g_toks, *, chunk: int):
    return _clipped_pg(LinearLogits(hidden, weight), data, g_seqs, g_toks, chunk)


def make_runner(variant: str, inp: Inputs, shape: Shape) -> Callable[[], float]:
    """One forward+backward call of `variant`; returns the loss (NaN for the floor)."""
    h, w, data = inp.hidden, inp.weight, inp.data
    if variant == "floor":
        rows = h[:, :-1].reshape(-1, shape.hidden).detach()
        grad = torch.randn(rows.shape[0], shape.vocab).to(w.dtype)

        @torch.no_grad()
        def floor() -> float:
            torch.nn.functional.linear(rows, w)
            grad @ w  # noqa: B018 - timed for its cost
            grad.t() @ rows  # noqa: B018
            return math.nan

        return floor
    if variant == "eager":

        def eager() -> float:
            logits = torch.nn.functional.linear(h, w)
            lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
            loss, _ = nemo_rl_clipped_pg(lp, data, inp.g_seqs, inp.g_toks)
            loss.backward()
            return loss.item()

        return eager
    if variant == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=BETA,
            epsilon_low=CLIP_EPS,
            epsilon_high=CLIP_EPS,
            loss_type="bnpo",
            compiled=True,
            use_ref_model=True,
            chunk_size=1,
        )
        mask = data["token_mask"][:, 1:]
        kwargs = dict(
            ref_per_token_logps=data["reference_policy_logprobs"][:, 1:],
            old_per_token_logps=data["prev_logprobs"][:, 1:],
        )

        def run_liger() -> float:
            loss, *_ = liger(h[:, :-1], w, data["input_ids"][:, 1:], mask, data["advantages"][:, 0], **kwargs)
            loss.backward()
            return loss.item()

        return run_liger
    if variant == "unfused":
        loss_fn = torch.compile(_clipped_pg, fullgraph=True)

        def unfused() -> float:
            loss, metrics = loss_fn(torch.nn.functional.linear(h, w), data, inp.g_seqs, inp.g_toks)
            loss.backward()
            metrics_to_python(metrics)
            return loss.item()

        return unfused
    fused_fn = torch.compile(functools.partial(_fused, chunk=shape.chunk), fullgraph=True)

    def fused() -> float:
        loss, metrics = fused_fn(h, w, data, inp.g_seqs, inp.g_toks)
        loss.backward()
        metrics_to_python(metrics)
        return loss.item()

    return fused


def measure(variant: str, shape: Shape, repeat: int) -> dict[str, Any]:
    """Warm-up (compile), then `repeat` timed forward+backward calls."""
    inp = make_inputs(shape)
    inp.hidden.requires_grad_(variant != "floor")
    inp.weight.requires_grad_(variant != "floor")
    run = make_runner(variant, inp, shape)
    start = time.perf_counter()
    run()
    first_s = time.perf_counter() - start
    run()
    inp.hidden.grad = inp.weight.grad = None
    gc.collect()
    before = _reset_peak("cpu")
    times, loss = [], math.nan
    for _ in range(repeat):
        inp.hidden.grad = inp.weight.grad = None
        start = time.perf_counter()
        loss = run()
        _synchronize("cpu")
        times.append(time.perf_counter() - start)
    peak_extra = _peak("cpu") - before
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "compile_s": first_s if variant in COMPILED else math.nan,
        "peak_extra_bytes": peak_extra,
        "loss": loss,
    }


def run_worker(variant: str, shape: Shape, repeat: int) -> tuple[dict[str, Any], str]:
    spec = json.dumps({"variant": variant, "shape": dataclasses.asdict(shape), "repeat": repeat})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", spec], capture_output=True, text=True
    )
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1]), "ok"
    lines = proc.stderr.strip().splitlines()
    reason = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        reason = f"killed by signal {-proc.returncode} (out of memory?)"
    return {
        "median_ms": math.nan,
        "min_ms": math.nan,
        "compile_s": math.nan,
        "peak_extra_bytes": math.nan,
        "loss": math.nan,
    }, f"failed: {reason}"


def print_shape(shape: Shape, rows: dict[str, dict[str, Any]]) -> bool:
    """The shape's table and targets; False if a loss disagrees with `eager`."""
    print(f"\n{shape.label}, fused chunk {shape.chunk} rows: forward+backward, median of repeats (min)")
    print(f"  {'variant':<8} {'ms':>18} {'x floor':>8} {'compile s':>10} {'peak extra MiB':>15}  loss")
    floor = rows.get("floor", {}).get("median_ms", math.nan)
    for variant, r in rows.items():
        compile_s = f"{r['compile_s']:.1f}" if variant in COMPILED else "-"
        print(
            f"  {variant:<8} {r['median_ms']:>9.1f} ({r['min_ms']:>6.1f}) {r['median_ms'] / floor:>8.2f} "
            f"{compile_s:>10} {r['peak_extra_bytes'] / 2**20:>15.0f}  {r['loss']:.6f}"
            f"{'' if r['status'] == 'ok' else '  ' + r['status']}"
        )
    agree = True
    if "eager" in rows:
        for variant in ("unfused", "fused", "liger"):
            if variant in rows and not math.isnan(rows[variant]["loss"]):
                diff = _rel_diff(rows[variant]["loss"], rows["eager"]["loss"])
                agree = agree and diff <= LOSS_RTOL
                print(f"  loss {variant} vs eager: {diff:.1e} relative ({'ok' if diff <= LOSS_RTOL else 'MISMATCH'})")
    if "fused" not in rows:
        return agree
    fused = rows["fused"]
    checks = []
    if "liger" in rows:
        liger = rows["liger"]
        checks.append(
            (
                fused["median_ms"] <= 0.9 * liger["median_ms"],
                f"fused time <= 0.9x liger: {fused['median_ms'] / liger['median_ms']:.2f}x",
            )
        )
        checks.append(
            (
                fused["peak_extra_bytes"] <= liger["peak_extra_bytes"],
                f"fused peak memory <= liger's: {fused['peak_extra_bytes'] / 2**20:.0f} vs "
                f"{liger['peak_extra_bytes'] / 2**20:.0f} MiB",
            )
        )
    if "floor" in rows:
        ratio = fused["median_ms"] / floor
        checks.append((ratio <= 1.4, f"fused time <= 1.4x floor: {ratio:.2f}x"))
    if "unfused" in rows:
        ratio = fused["median_ms"] / rows["unfused"]["median_ms"]
        checks.append((ratio <= 1.1, f"fused time <= 1.1x unfused: {ratio:.2f}x"))
    checks.append(
        (
            fused["peak_extra_bytes"] <= shape.fused_budget_bytes,
            f"fused peak extra <= dW + dH + 2 fp32 chunks ({shape.fused_budget_bytes / 2**20:.0f} MiB): "
            f"{fused['peak_extra_bytes'] / 2**20:.0f} MiB",
        )
    )
    for ok, what in checks:
        print(f"  [{_mark(ok)}] {what}")
    return agree


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/bench.py head", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for key, help_text in (
        ("batch", "rows B"),
        ("seq", "predicted positions per row T"),
        ("hidden", "hidden size H"),
        ("vocab", "vocabulary V"),
    ):
        p.add_argument(
            f"--{key}", type=int, nargs="+", default=DEFAULTS[key], help=f"{help_text} (default %(default)s)"
        )
    p.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=DEFAULTS["dtype"])
    p.add_argument("--chunk", type=int, default=DEFAULTS["chunk"], help="fused rows per chunk (default %(default)s)")
    p.add_argument("--repeat", type=int, default=DEFAULTS["repeat"], help="timed calls (default %(default)s)")
    p.add_argument("--variants", choices=VARIANTS, nargs="+", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory (default bench_out/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(spec["variant"], Shape(**spec["shape"]), spec["repeat"])))
        return
    shapes = [
        Shape(b, t, h, v, d, args.chunk)
        for d in args.dtype
        for v in args.vocab
        for h in args.hidden
        for t in args.seq
        for b in args.batch
    ]
    print(
        f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, {len(shapes)} shape(s) x "
        f"{len(args.variants)} variants, one subprocess each; load average {os.getloadavg()[0]:.2f}"
    )
    table, mismatches = [], []
    for shape in shapes:
        rows = {}
        for variant in args.variants:
            result, status = run_worker(variant, shape, args.repeat)
            rows[variant] = {**result, "status": status}
            table.append(
                {
                    **dataclasses.asdict(shape),
                    "variant": variant,
                    "repeat": args.repeat,
                    "peak_extra_mib": result["peak_extra_bytes"] / 2**20,
                    "status": status,
                    **{k: result[k] for k in ("median_ms", "min_ms", "compile_s", "loss")},
                }
            )
        if not print_shape(shape, rows):
            mismatches.append(shape.label)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "bench_head.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in table:
            writer.writerow({k: "" if isinstance(r[k], float) and math.isnan(r[k]) else r[k] for k in CSV_COLUMNS})
    print(f"\nwrote {args.out / 'bench_head.csv'}")
    if mismatches:
        sys.exit(f"losses differ from eager by more than {LOSS_RTOL:g} relative at: {mismatches}")


if __name__ == "__main__":
    main()
