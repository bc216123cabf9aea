"""`python tools/bench.py head`: the LM head + a loss from hidden states, side by side.

One run measures, per loss (`--loss`: GRPO's ClippedPG, the NLL / cross-entropy) and shape
(`[B, T]` rows of hidden states `[B, T, H]`, an LM head `[V, H]`, dtype), the median wall
time of `--repeat` forward+backward calls after warm-up and their peak extra memory (as
`tools/bench.py` measures it: CPU `VmHWM`, CUDA `max_memory_allocated`), for:

- `floor`    the machine's floor for any LM head + loss: its three matmuls alone (logits
             `h·Wᵀ`, `dH = G·W`, `dW = Gᵀ·h` for a preallocated logits-sized `G`);
- `eager`    NeMo-RL's eager path (ref §5.1, §8.10): the LM head, a full fp32
             `log_softmax` of the logits, the gather, the loss with every metric
             `.item()`-ed (ClippedPG, ref §4.1; NLL, the token mean);
- `unfused`  the LM head (eager) + compiled_loss's compiled loss on the logits
             (`wrap_loss_fn_with_input_preparation`; the logits are kept);
- `fused`    compiled_loss compiled from the hidden states: the same call on
             `LinearLogits(h, W)` (chunks of `--chunk` rows; no `[T, V]` logits);
- `cce`      (NLL) Apple's Cut Cross-Entropy, `linear_cross_entropy(..., shift=True)`:
             its `torch_compile` implementation on CPU (its package imports its Triton
             kernels on Linux; the bench loads the `torch_compile` module alone where Triton
             is missing), its Triton kernels (`impl="cce"`) on CUDA;
- `liger`    Liger-Kernel: GRPO `LigerFusedLinearGRPOLoss` (`loss_type="bnpo"`: the token
             mean ClippedPG takes; `compiled=True`, pure PyTorch), NLL
             `LigerFusedLinearCrossEntropyLoss` (a Triton kernel: CUDA only; on CPU its row
             says not available).

The peers install without their dependencies (`pip install --no-deps liger-kernel==0.8.5
cut-cross-entropy==25.1.1`); a peer that is not installed or cannot run on the device is a
row marked `n/a` with the reason. All variants of a loss compute it at its defaults
(ClippedPG: ε = 0.2, k3 KL with β = 0.01, token-level mean; NLL: the token mean over the
response) on the same data, so the losses must agree (the tool exits 1 if a variant
differs from `eager` by more than 1e-4 relative). Each (loss, variant, shape) runs in a
fresh subprocess; compiled variants (and the peers' kernels) report their first call,
compile included, as `compile_s`. Prints a table per loss and shape and the targets (fused
≤ 0.8× Liger's time and ≤ 0.9× CCE's, ≤ each peer's peak extra memory, ≤ 1.25× floor, ≤ 1.1×
unfused; fused peak extra memory ≤ dW + dH + 2 chunks of fp32 logits), and writes `bench_head.csv` to
`--out` (rewritten after every variant).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import BETA, CLIP_EPS, DTYPES, mark, nemo_rl_clipped_pg, peak, rel_diff, reset_peak, synchronize

from compiled_loss.loss_functions import ClippedPGLossFn, NLLLossFn
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.metrics import metrics_to_python
from compiled_loss.vocab import LinearLogits
from compiled_loss.vocab.fused import _chunk_rows
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

LOSSES = ("grpo", "nll")
VARIANTS = {
    "grpo": ("floor", "eager", "unfused", "fused", "liger"),
    "nll": ("floor", "eager", "unfused", "fused", "cce", "liger"),
}
ALL_VARIANTS = ("floor", "eager", "unfused", "fused", "cce", "liger")
COMPILED = ("unfused", "fused", "cce", "liger")
PEERS = ("cce", "liger")  # the fused loss's targets are against each peer that ran
PEER_TIME_TARGET = {"liger": 0.8, "cce": 0.9}  # fused time / the peer's, at most
INSTALL = {
    "liger": ("liger_kernel", "pip install --no-deps liger-kernel==0.8.5"),
    "cce": ("cut_cross_entropy", "pip install --no-deps cut-cross-entropy==25.1.1"),
}
IGNORE_INDEX = -100  # the peers' cross-entropy label for a position left out
DEFAULTS = {
    "batch": [4],
    "seq": [512],
    "hidden": [256, 1024],
    "vocab": [32000, 128256],
    "dtype": ["fp32"],
    "repeat": 3,
    "chunk": "default",
}
# Shapes off the grid's powers of two (--odd): GPT-2's vocabulary with H=384 and H=576 (SmolLM's),
# and T=1536 rows of one sequence
ODD_SHAPES = ((2, 768, 384, 50257), (3, 500, 576, 49152), (1, 1536, 1024, 32000))
LOSS_RTOL = 1e-4
SEED = 0
CSV_COLUMNS = (
    "loss",
    "device",
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
    "loss_value",
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


def make_inputs(shape: Shape, device: str = "cpu") -> Inputs:
    """Hidden states with unit-variance logits, responses after a prompt, one advantage per
    row, prev/generation/reference log-probs within a few % of the policy's; drawn on
    `device` (its generator: the same numbers on every run of one device)."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    dtype, rows, width = DTYPES[shape.dtype], shape.batch, shape.seq + 1

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device)

    hidden = randn(rows, width, shape.hidden).to(dtype)
    weight = (randn(shape.vocab, shape.hidden) / math.sqrt(shape.hidden)).to(dtype)
    input_ids = torch.randint(0, shape.vocab, (rows, width), generator=gen, device=device)
    with torch.no_grad():
        lp = torch.zeros(rows, width, device=device)
        for i in range(rows):
            logits = torch.nn.functional.linear(hidden[i, :-1], weight).float()
            lp[i, 1:] = logits.log_softmax(-1).gather(-1, input_ids[i, 1:, None])[:, 0]
    token_mask = torch.zeros(rows, width, device=device)
    token_mask[:, width // 4 :] = 1  # the response after a prompt

    def noise(std: float) -> torch.Tensor:
        return std * randn(rows, width)

    prev = lp + noise(0.05)
    data = {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows, device=device),
        "advantages": randn(rows, 1).expand(rows, width).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + noise(0.05),
        "reference_policy_logprobs": lp + noise(0.1),
    }
    return Inputs(hidden, weight, data, data["sample_mask"].sum(), token_mask[:, 1:].sum())


LOSS_FNS = {"grpo": ClippedPGLossFn({"reference_policy_kl_penalty": BETA}), "nll": NLLLossFn()}


def _loss(logits: torch.Tensor | LinearLogits, data, g_seqs, g_toks, *, loss: str, chunk=None):
    return wrap_loss_fn_with_input_preparation(
        logits,
        data,
        g_seqs,
        g_toks,
        loss_fn=LOSS_FNS[loss],
        prepare_fn=functools.partial(prepare_loss_input, chunk_size=chunk),
    )


def _fused(hidden, weight, data, g_seqs, g_toks, *, loss: str, chunk: int):
    return _loss(LinearLogits(hidden, weight), data, g_seqs, g_toks, loss=loss, chunk=chunk)


def unavailable(variant: str, loss: str, device: str) -> str | None:
    """Why `variant` cannot run for `loss` on `device` here (None: it can)."""
    if variant not in VARIANTS[loss]:
        return f"not a {loss} variant"
    if variant in INSTALL:
        module, install = INSTALL[variant]
        if importlib.util.find_spec(module) is None:
            return f"not installed ({install})"
    if variant == "liger" and loss == "nll" and device != "cuda":
        return "Liger's fused-linear cross-entropy is a Triton kernel: CUDA only"
    if variant == "cce" and device == "cuda" and importlib.util.find_spec("triton") is None:
        return "CCE's kernels need Triton, which is not installed"
    return None


def cce_linear_cross_entropy(device: str) -> Callable[..., torch.Tensor]:
    """Cut Cross-Entropy's `linear_cross_entropy`: its Triton kernels on CUDA, its
    `torch_compile` implementation elsewhere. Its package `__init__` imports the Triton
    kernels on Linux; where Triton is missing the `torch_compile` module (torch alone) is
    loaded from the package's folder without running that `__init__`."""
    if device == "cuda":
        from cut_cross_entropy import linear_cross_entropy

        return functools.partial(linear_cross_entropy, impl="cce")
    if importlib.util.find_spec("triton") is not None:
        from cut_cross_entropy import linear_cross_entropy

        return functools.partial(linear_cross_entropy, impl="torch_compile")
    if "cut_cross_entropy" not in sys.modules:
        package = types.ModuleType("cut_cross_entropy")
        package.__path__ = list(importlib.util.find_spec("cut_cross_entropy").submodule_search_locations)
        sys.modules["cut_cross_entropy"] = package
    from cut_cross_entropy.torch_compile import torch_compile_linear_cross_entropy

    return torch_compile_linear_cross_entropy


def _nemo_rl_nll(
    lp: torch.Tensor, data: dict[str, torch.Tensor], g_toks: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """NeMo-RL's `NLLLossFn` (ref §4.2) on `[B, T]` log-probs: the masked token mean with the
    global normaliser, its metrics `.item()`-ed as the reference does."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    loss = -(lp * mask).sum() / g_toks
    metrics = {
        "loss": loss.item(),
        "num_unmasked_tokens": mask.sum().item(),
        "num_valid_samples": data["sample_mask"].sum().item(),
    }
    return loss, metrics


def make_runner(
    variant: str, loss: str, inp: Inputs, shape: Shape, device: str = "cpu", backend: str = "inductor"
) -> Callable[[], float]:
    """One forward+backward call of `variant` on `loss`; returns the loss (NaN for the floor)."""
    h, w, data = inp.hidden, inp.weight, inp.data
    if variant == "floor":
        rows = h[:, :-1].reshape(-1, shape.hidden).detach()
        grad = torch.randn(rows.shape[0], shape.vocab, device=device).to(w.dtype)

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
            if loss == "grpo":
                value, _ = nemo_rl_clipped_pg(lp, data, inp.g_seqs, inp.g_toks)
            else:
                value, _ = _nemo_rl_nll(lp, data, inp.g_toks)
            value.backward()
            return value.item()

        return eager
    # the peers' cross-entropy labels: the next token where the response is, IGNORE_INDEX elsewhere
    labels = torch.where(data["token_mask"].bool(), data["input_ids"], IGNORE_INDEX)
    if variant == "cce":
        cce = cce_linear_cross_entropy(device)

        def run_cce() -> float:
            value = cce(h, w, labels, ignore_index=IGNORE_INDEX, reduction="mean", shift=True)
            value.backward()
            return value.item()

        return run_cce
    if variant == "liger" and loss == "nll":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        ce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean")
        targets = labels[:, 1:].reshape(-1)

        def run_liger_ce() -> float:
            value = ce(w, h[:, :-1].reshape(-1, shape.hidden), targets)
            value.backward()
            return value.item()

        return run_liger_ce
    if variant == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=BETA,
            epsilon_low=CLIP_EPS,
            epsilon_high=CLIP_EPS,
            loss_type="bnpo",
            compiled=backend == "inductor",
            use_ref_model=True,
            chunk_size=1,
        )
        mask = data["token_mask"][:, 1:]
        kwargs = dict(
            ref_per_token_logps=data["reference_policy_logprobs"][:, 1:],
            old_per_token_logps=data["prev_logprobs"][:, 1:],
        )

        def run_liger() -> float:
            value, *_ = liger(h[:, :-1], w, data["input_ids"][:, 1:], mask, data["advantages"][:, 0], **kwargs)
            value.backward()
            return value.item()

        return run_liger
    if variant == "unfused":
        loss_fn = torch.compile(functools.partial(_loss, loss=loss), fullgraph=True, backend=backend)

        def unfused() -> float:
            value, metrics = loss_fn(torch.nn.functional.linear(h, w), data, inp.g_seqs, inp.g_toks)
            value.backward()
            metrics_to_python(metrics)
            return value.item()

        return unfused
    fused_fn = torch.compile(functools.partial(_fused, loss=loss, chunk=shape.chunk), fullgraph=True, backend=backend)

    def fused() -> float:
        value, metrics = fused_fn(h, w, data, inp.g_seqs, inp.g_toks)
        value.backward()
        metrics_to_python(metrics)
        return value.item()

    return fused


def measure(
    variant: str, loss: str, shape: Shape, repeat: int, device: str = "cpu", backend: str = "inductor"
) -> dict[str, Any]:
    """Warm-up (compile), then `repeat` timed forward+backward calls."""
    if device == "cuda":
        torch.cuda.set_device(0)
    inp = make_inputs(shape, device)
    inp.hidden.requires_grad_(variant != "floor")
    inp.weight.requires_grad_(variant != "floor")
    run = make_runner(variant, loss, inp, shape, device, backend)
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    first_s = time.perf_counter() - start
    run()
    inp.hidden.grad = inp.weight.grad = None
    gc.collect()
    before = reset_peak(device)
    times, value = [], math.nan
    for _ in range(repeat):
        inp.hidden.grad = inp.weight.grad = None
        synchronize(device)
        start = time.perf_counter()
        value = run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak_extra = peak(device) - before
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "compile_s": first_s if variant in COMPILED else math.nan,
        "peak_extra_bytes": peak_extra,
        "value": value,
    }


NOT_RUN = {"median_ms": math.nan, "min_ms": math.nan, "compile_s": math.nan, "peak_extra_bytes": math.nan}


def run_worker(
    variant: str, loss: str, shape: Shape, repeat: int, device: str, backend: str, timeout: float | None
) -> tuple[dict[str, Any], str]:
    """`measure` in a fresh subprocess (killed after `timeout` seconds); its result and a
    status ('ok', 'n/a: why' or 'failed: why')."""
    reason = unavailable(variant, loss, device)
    if reason is not None:
        return {**NOT_RUN, "value": math.nan}, f"n/a: {reason}"
    spec = json.dumps(
        {
            "variant": variant,
            "loss": loss,
            "shape": dataclasses.asdict(shape),
            "repeat": repeat,
            "device": device,
            "backend": backend,
        }
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", spec],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {**NOT_RUN, "value": math.nan}, f"failed: timed out after {timeout:g} s"
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1]), "ok"
    lines = proc.stderr.strip().splitlines()
    reason = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        reason = f"killed by signal {-proc.returncode} (out of memory?)"
    return {**NOT_RUN, "value": math.nan}, f"failed: {reason}"


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def print_shape(loss: str, shape: Shape, rows: dict[str, dict[str, Any]], device: str) -> bool:
    """The table and targets of one loss and shape; False if a loss disagrees with `eager`."""
    print(
        f"\n{loss} {shape.label} on {device}, fused chunk {shape.chunk} rows: forward+backward, median of repeats (min)"
    )
    print(f"  {'variant':<8} {'ms':>18} {'x floor':>8} {'compile s':>10} {'peak extra MiB':>15}  loss")
    floor = rows.get("floor", {}).get("median_ms", math.nan)
    for variant, r in rows.items():
        if r["status"].startswith("n/a"):
            print(f"  {variant:<8} {r['status']}")
            continue
        compile_s = _fmt(r["compile_s"], ".1f") if variant in COMPILED else "-"
        print(
            f"  {variant:<8} {_fmt(r['median_ms'], '9.1f'):>9} ({_fmt(r['min_ms'], '6.1f'):>6}) "
            f"{_fmt(r['median_ms'] / floor, '8.2f'):>8} {compile_s:>10} "
            f"{_fmt(r['peak_extra_bytes'] / 2**20, '15.0f'):>15}  {_fmt(r['value'], '.6f')}"
            f"{'' if r['status'] == 'ok' else '  ' + r['status']}"
        )
    agree = True
    if "eager" in rows and not math.isnan(rows["eager"]["value"]):
        for variant in ("unfused", "fused", *PEERS):
            if variant in rows and not math.isnan(rows[variant]["value"]):
                diff = rel_diff(rows[variant]["value"], rows["eager"]["value"])
                agree = agree and diff <= LOSS_RTOL
                print(f"  loss {variant} vs eager: {diff:.1e} relative ({'ok' if diff <= LOSS_RTOL else 'MISMATCH'})")
    fused = rows.get("fused")
    if fused is None or fused["status"] != "ok":
        return agree
    checks = []
    for peer in PEERS:
        r = rows.get(peer)
        if r is None or r["status"] != "ok":
            continue
        target = PEER_TIME_TARGET[peer]
        checks.append(
            (
                fused["median_ms"] <= target * r["median_ms"],
                f"fused time <= {target}x {peer}: {fused['median_ms'] / r['median_ms']:.2f}x",
            )
        )
        checks.append(
            (
                fused["peak_extra_bytes"] <= r["peak_extra_bytes"],
                f"fused peak memory <= {peer}'s: {fused['peak_extra_bytes'] / 2**20:.0f} vs "
                f"{r['peak_extra_bytes'] / 2**20:.0f} MiB",
            )
        )
    if rows.get("floor", {}).get("status") == "ok":
        ratio = fused["median_ms"] / floor
        checks.append((ratio <= 1.25, f"fused time <= 1.25x floor: {ratio:.2f}x"))
    if rows.get("unfused", {}).get("status") == "ok":
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
        print(f"  [{mark(ok)}] {what}")
    return agree


def write_csv(table: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in table:
            writer.writerow({k: "" if isinstance(r[k], float) and math.isnan(r[k]) else r[k] for k in CSV_COLUMNS})


def _chunk_spec(text: str) -> str | int:
    if text in ("default", "liger"):
        return text
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise argparse.ArgumentTypeError(f"--chunk must be a number of rows >= 1, 'default' or 'liger', got {text!r}")
    return rows


def chunk_rows(spec: str | int, batch: int, seq: int, vocab: int) -> int:
    """The fused loss's rows per chunk for `--chunk spec` (the library raises any to N / 16)."""
    rows = {"default": None, "liger": seq}.get(spec, spec)
    return _chunk_rows(batch * seq, vocab, None if rows is None else int(rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/bench.py head", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--loss", choices=LOSSES, nargs="+", default=list(LOSSES), help="losses (default: both)")
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
    p.add_argument(
        "--odd",
        action="store_true",
        help="the shapes off the grid instead, (B, T, H, V) in " + ", ".join(map(str, ODD_SHAPES)),
    )
    p.add_argument(
        "--chunk",
        type=_chunk_spec,
        default=DEFAULTS["chunk"],
        help="fused rows per chunk: a number, 'default' (the library's: ~16 MiB of fp32 logits, at most 16 chunks) "
        "or 'liger' (T: one row of the batch, the chunk of Liger's chunked losses) (default %(default)s)",
    )
    p.add_argument("--repeat", type=int, default=DEFAULTS["repeat"], help="timed calls (default %(default)s)")
    p.add_argument(
        "--variants",
        choices=ALL_VARIANTS,
        nargs="+",
        default=list(ALL_VARIANTS),
        help="variants to run, in this order, each where its loss has it (default: all)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of compiled_loss's variants (default %(default)s; Liger's GRPO compiles only "
        "under inductor)",
    )
    p.add_argument("--timeout", type=float, help="seconds per variant before it is killed (default: none)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory (default bench_out/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = measure(
            spec["variant"], spec["loss"], Shape(**spec["shape"]), spec["repeat"], spec["device"], spec["backend"]
        )
        print(json.dumps(result))
        return
    grid = ODD_SHAPES if args.odd else tuple(itertools.product(args.batch, args.seq, args.hidden, args.vocab))
    shapes = [Shape(b, t, h, v, d, chunk_rows(args.chunk, b, t, v)) for d in args.dtype for b, t, h, v in grid]
    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {name}, {len(args.loss)} loss(es) x {len(shapes)} shape(s), one subprocess "
        f"per variant; load average {os.getloadavg()[0]:.2f}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    table, mismatches = [], []
    for loss in args.loss:
        for shape in shapes:
            rows = {}
            for variant in (v for v in args.variants if v in VARIANTS[loss]):  # in the order asked
                result, status = run_worker(variant, loss, shape, args.repeat, device, args.backend, args.timeout)
                rows[variant] = {**result, "status": status}
                table.append(
                    {
                        "loss": loss,
                        "device": device,
                        **dataclasses.asdict(shape),
                        "variant": variant,
                        "repeat": args.repeat,
                        "peak_extra_mib": result["peak_extra_bytes"] / 2**20,
                        "status": status,
                        **{k: result[k] for k in ("median_ms", "min_ms", "compile_s")},
                        "loss_value": result["value"],
                    }
                )
                write_csv(table, args.out / "bench_head.csv")  # what ran so far, should the run be stopped
            rows = {v: rows[v] for v in VARIANTS[loss] if v in rows}
            if not print_shape(loss, shape, rows, device):
                mismatches.append(f"{loss} {shape.label}")
    print(f"\nwrote {args.out / 'bench_head.csv'}")
    if mismatches:
        sys.exit(f"losses differ from eager by more than {LOSS_RTOL:g} relative at: {mismatches}")


if __name__ == "__main__":
    main()
