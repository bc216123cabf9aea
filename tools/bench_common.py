"""What the bench tools share: the dtypes they name, NeMo-RL's eager per-sequence
`ClippedPGLossFn` at GRPO defaults (written from the reference, the baseline every bench
measures against), the memory high-water mark of a worker process and how a ratio is
marked against its target."""

from __future__ import annotations

import ctypes
import math
import re

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# GRPO defaults of ClippedPGLossConfig (ref §4.1.1)
CLIP_EPS = 0.2
BETA = 0.01
KL_INPUT_CLAMP = 20.0
KL_OUTPUT_CLAMP = 10.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / (denominator + 1e-8)


def _k3(logr: torch.Tensor) -> torch.Tensor:
    return torch.exp(logr) - 1 - logr


def _nan_to_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _extremum(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> float:
    """Min / max over `values[valid]` (boolean indexing, a sync), ±inf when empty."""
    picked = values[valid]
    if picked.numel() == 0:
        return -math.inf if largest else math.inf
    return (picked.max() if largest else picked.min()).item()


def nemo_rl_clipped_pg(
    lp: torch.Tensor, seq: dict[str, torch.Tensor], g_seqs: torch.Tensor, g_toks: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """`ClippedPGLossFn.__call__` at GRPO defaults (ref §4.1.5) on one sequence `[1, L]`;
    every metric `.item()`-ed as the reference does."""
    tm, sm = seq["token_mask"][:, 1:], seq["sample_mask"]
    mask = tm * sm[:, None]
    adv = seq["advantages"][:, 1:]
    prev, gen, ref = (seq[k][:, 1:] for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"))
    metrics: dict[str, float] = {}
    with torch.no_grad():
        metrics["token_mult_prob_error"] = _masked_mean(torch.exp((gen - prev).abs() * mask), mask, g_toks).item()
        metrics["gen_kl_error"] = _masked_mean(_k3(prev - gen), mask, g_toks).item()
        metrics["policy_kl_error"] = _masked_mean(_k3(gen - prev), mask, g_toks).item()
        log_m = torch.logaddexp(prev, gen) - math.log(2.0)
        a, b = prev - log_m, gen - log_m
        js = 0.5 * (torch.exp(a) - a - 1) + 0.5 * (torch.exp(b) - b - 1)
        metrics["js_divergence_error"] = _masked_mean(js, mask, g_toks).item()
    w_kl = _nan_to_zero(torch.exp(lp - lp.detach()))
    logr = ref - lp
    clamped = logr.clamp(-KL_INPUT_CLAMP, KL_INPUT_CLAMP)
    w_kl = torch.where(logr != clamped, w_kl.detach(), w_kl)
    kl = _masked_mean(BETA * (w_kl * _k3(clamped)).clamp(-KL_OUTPUT_CLAMP, KL_OUTPUT_CLAMP), mask, g_toks)
    ratio = torch.exp(lp - prev)
    ratio_c = ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
    clip_loss = torch.maximum(-adv * ratio, -adv * ratio_c)
    loss = _masked_mean(clip_loss, mask, g_toks) + kl  # IS correction off: weights are ones
    with torch.no_grad():
        is_w = _nan_to_zero(torch.exp(prev - gen))
        r, rc, valid = ratio.detach(), ratio_c.detach(), mask.bool()
        kl_value = kl.item()
        metrics.update(
            {
                "loss": loss.item(),
                "probs_ratio": _masked_mean(r, mask, g_toks).item(),
                "probs_ratio_clamped": _masked_mean(rc, mask, g_toks).item(),
                "probs_ratio_min": _extremum(r, valid, largest=False),
                "probs_ratio_max": _extremum(r, valid, largest=True),
                "probs_ratio_clamped_min": _extremum(rc, valid, largest=False),
                "probs_ratio_clamped_max": _extremum(rc, valid, largest=True),
                "kl_penalty": kl_value / BETA if kl_value else 0.0,
                "sampling_importance_ratio": _masked_mean(is_w, mask, g_toks).item(),
                "num_valid_samples": sm.sum().item(),
                "approx_entropy": -_masked_mean(torch.exp(lp.detach() - gen) * lp.detach(), mask, g_toks).item(),
                "positive_nll_loss": 0.0,
            }
        )
    return loss, metrics


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> int:
    """Reset the memory high-water mark; returns the memory in use now."""
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    ctypes.CDLL(None).malloc_trim(0)  # glibc: hand freed heap pages back, so reuse counts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def peak(device: str) -> int:
    synchronize(device)
    return torch.cuda.max_memory_allocated() if device == "cuda" else _proc_status_bytes("VmHWM")


def rel_diff(x: float, y: float) -> float:
    return abs(x - y) / abs(y)


def mark(ok: bool) -> str:
    return "met" if ok else "MISSED"
