"""The independent per-sequence oracle and the random cases of the reliability suite.

`per_sequence_oracle` is NeMo-RL's `SequencePackingLossWrapper` loop (ref §7.2), written
here without the library's wrappers: for each sequence i it slices the unpacked data rows
to `[:, :L_i]` (tensors with ndim > 1 and shape[1] > 1; `L_i` may exceed S, slicing
clamps), narrows the packed logits to the padded segment `[cu_padded[i], cu_padded[i] + P_i)`
(LOGIT losses, whose logits are not re-aligned by input preparation: to its first
`min(L_i, S)` slots), calls `compiled_loss.loss_input.prepare_loss_input` and the loss on that
one sequence with the GLOBAL denominators, sums the losses and combines the metrics
(min / max through `compiled_loss.metrics.aggregation`, skipping ±inf sentinels; every
other key summed). DPO keeps its (chosen, rejected) rows together (docs/deviations.md): each
row is prepared on its own slice, the pair is zero-padded to a common width and evaluated
as one two-row batch.

Where the reference's shapes break down, the oracle states the semantics it checks:
- a zero-length sequence contributes no token (ref §7.2 "sequences with zero valid tokens
  contribute 0 loss"). Its slice has width 0 in the reference, which the library's losses
  refuse (a separate test pins that shape), and with S = 1 the reference would not slice
  its width-1 data at all (and its value-loss logits slice would be empty). The oracle
  evaluates every zero-length sequence as a width-1 row with `token_mask = 0` (its
  `sample_mask` and row-level keys kept);
- with S = 1 a sequence's padded segment is never narrower than its data, so no logits
  are invented; the zero-padding below only serves the zero-length rows above.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable
from typing import Any

import tolerances
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from compiled_loss.interfaces import LossInputType
from compiled_loss.loss_functions import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    MseValueLossFn,
    NLLLossFn,
)
from compiled_loss.loss_input import TrainingSamplingParams, prepare_loss_input, prepare_packed_loss_input
from compiled_loss.metrics import aggregation
from compiled_loss.packing import BucketGrid
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, SequencePackingLossWrapper

VOCAB = 11
TOPK = 3
FAMILIES = ("pg", "nll", "dpo", "distill", "mse")
WRAPPERS = (SequencePackingLossWrapper, SequencePackingFusionLossWrapper)

# packed vs per-sequence: a reduction reordered; a gradient entry is one token's term, not a sum
RTOL, ATOL = tolerances.close(torch.float32, "reordered").values()
GRAD_ATOL = tolerances.close(torch.float32, "same")["atol"]

# Hypothesis: reproducible (derandomized), no example database, no deadline.
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def hyp(max_examples: int):
    return settings(max_examples=max_examples, **SETTINGS)


# ---------------------------------------------------------------------------------------
# cases: a loss, how its inputs are prepared, and the data it reads
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    loss_fn: Any
    sampling: TrainingSamplingParams | None = None
    chunk_size: int | None = None
    label: str = ""

    @property
    def pairs(self) -> bool:
        return self.family == "dpo"

    @property
    def logit_width(self) -> int:
        return 1 if self.family == "mse" else VOCAB

    def prepare_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.sampling is not None:
            kw["sampling_params"] = self.sampling
        if self.chunk_size is not None:
            kw["chunk_size"] = self.chunk_size
        return kw

    def prepare(self, fused: bool) -> Callable[..., Any]:
        base = prepare_packed_loss_input if fused else prepare_loss_input
        kw = self.prepare_kwargs()
        return functools.partial(base, **kw) if kw else base

    def __repr__(self) -> str:  # shown by hypothesis on failure
        return f"Case({self.family}, {self.label or self.loss_fn!r}, sampling={self.sampling}, chunk={self.chunk_size})"


SAMPLINGS = [
    None,
    TrainingSamplingParams(top_k=3),
    TrainingSamplingParams(top_p=0.8),
    TrainingSamplingParams(top_k=5, top_p=0.9),
    TrainingSamplingParams(top_k=VOCAB + 2),  # at least the vocabulary: keeps every token
]


@st.composite
def pg_cases(draw) -> Case:
    """A random valid `ClippedPGLossFn` config (GRPO/PPO, dual clip, GSPO, CISPO,
    REINFORCE, on-policy ratio, in-loss sequence filter; TIS/icepop/seq-mask-tis; on-policy
    KL; KL in reward), a sampling filter and an eager chunk size. VAPO's NLL is left out: its
    local denominator is a documented packing deviation (docs/deviations.md)."""
    mode = draw(st.sampled_from(["ppo", "gspo", "cispo", "reinforce", "on_policy", "seq_filter"]))
    cfg: dict[str, Any] = {
        "ratio_clip_min": draw(st.sampled_from([0.0, 0.1, 0.2, 0.4])),
        "ratio_clip_max": draw(st.sampled_from([0.0, 0.2, 0.28, 0.5])),
        "reference_policy_kl_penalty": draw(st.sampled_from([0.0, 0.01, 0.1, 0.5])),
        "reference_policy_kl_type": draw(st.sampled_from(["k1", "k2", "k3"])),
        "kl_input_clamp_value": draw(st.sampled_from([None, 0.5, 20.0])),
        "kl_output_clamp_value": draw(st.sampled_from([None, 0.3, 10.0])),
        "use_on_policy_kl_approximation": draw(st.booleans()),
        "use_kl_in_reward": draw(st.sampled_from([False, False, False, True])),
    }
    kwargs: dict[str, Any] = {}
    token_level = draw(st.booleans())
    if mode == "gspo":
        cfg["sequence_level_importance_ratios"] = True
        token_level = False
    elif mode == "cispo":
        cfg["use_cispo"] = True
        token_level = True
    elif mode == "reinforce":
        cfg["disable_ppo_ratio"] = True
    elif mode == "on_policy":
        cfg["force_on_policy_ratio"] = True
    elif mode == "seq_filter":
        cfg["force_on_policy_ratio"] = True
        cfg["seq_logprob_error_in_loss"] = True
        kwargs["seq_logprob_error_threshold"] = draw(st.sampled_from([1.1, 1.5, 3.0]))
        token_level = True
    cfg["token_level_loss"] = token_level
    if mode != "cispo":
        cfg["ratio_clip_c"] = draw(st.sampled_from([None, 1.5, 3.0]))
    if draw(st.booleans()):
        cfg["use_importance_sampling_correction"] = True
        tis = draw(
            st.sampled_from([None, "tis", "icepop", "seq-mask-tis"] if mode != "gspo" else [None, "tis", "icepop"])
        )
        if tis is not None:
            cfg["truncated_importance_sampling_type"] = tis
            cfg["truncated_importance_sampling_ratio"] = draw(st.sampled_from([1.0, 1.2, 2.0]))
            if tis != "tis" or draw(st.booleans()):
                cfg["truncated_importance_sampling_ratio_min"] = draw(st.sampled_from([0.0, 0.5, 0.9]))
    sampling = draw(st.sampled_from(SAMPLINGS))
    chunk = draw(st.sampled_from([None, 1, 4]))
    label = f"{mode} {cfg} {kwargs}"
    return Case("pg", ClippedPGLossFn(cfg, **kwargs), sampling, chunk, label)


@st.composite
def nll_cases(draw) -> Case:
    return Case("nll", NLLLossFn(), draw(st.sampled_from(SAMPLINGS)), draw(st.sampled_from([None, 2])), "nll")


@st.composite
def dpo_cases(draw) -> Case:
    cfg = {
        "reference_policy_kl_penalty": draw(st.sampled_from([0.05, 0.5])),
        "preference_loss_weight": draw(st.sampled_from([0.0, 1.0])),
        "sft_loss_weight": draw(st.sampled_from([0.0, 0.5])),
        "preference_average_log_probs": draw(st.booleans()),
        "sft_average_log_probs": draw(st.booleans()),
    }
    return Case("dpo", DPOLossFn(cfg), None, draw(st.sampled_from([None, 3])), f"dpo {cfg}")


@st.composite
def distill_cases(draw) -> Case:
    cfg = {
        "kl_type": draw(st.sampled_from(["forward", "reverse", "mixed"])),
        "mixed_kl_weight": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "zero_outside_topk": draw(st.booleans()),
    }
    return Case("distill", DistillationLossFn(cfg), label=f"distill {cfg}")


@st.composite
def mse_cases(draw) -> Case:
    cfg = {"scale": draw(st.sampled_from([0.5, 1.0, 2.0])), "cliprange": draw(st.sampled_from([None, 0.0, 0.2]))}
    return Case("mse", MseValueLossFn(cfg), label=f"mse {cfg}")


CASE_STRATEGIES = {"pg": pg_cases, "nll": nll_cases, "dpo": dpo_cases, "distill": distill_cases, "mse": mse_cases}

# One fixed case per family (deterministic tests).
FIXED = {
    "pg": Case(
        "pg",
        ClippedPGLossFn(
            {
                "reference_policy_kl_penalty": 0.1,
                "ratio_clip_c": 3.0,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 1.5,
            }
        ),
        TrainingSamplingParams(top_k=5, top_p=0.9),
        label="grpo dual-clip tis top-k/p",
    ),
    "nll": Case("nll", NLLLossFn(), label="nll"),
    "dpo": Case("dpo", DPOLossFn({"sft_loss_weight": 0.5, "preference_average_log_probs": True}), label="dpo+sft"),
    "distill": Case(
        "distill",
        DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 0.3, "zero_outside_topk": True}),
        label="distill mixed zero-outside",
    ),
    "mse": Case("mse", MseValueLossFn({"cliprange": 0.2, "scale": 2.0}), label="mse clipped"),
}


# ---------------------------------------------------------------------------------------
# packings and batches
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packing:
    lengths: tuple[int, ...]
    pads: tuple[int, ...]
    width: int  # S
    bucket: BucketGrid
    pad_data: bool  # pass data already padded to the bucket (`wrapper.layout.pad_data`)
    seed: int

    @property
    def cu(self) -> tuple[int, ...]:
        return cumsum(self.lengths)

    @property
    def cu_padded(self) -> tuple[int, ...]:
        return cumsum([n + p for n, p in zip(self.lengths, self.pads)])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def real_len(self, i: int) -> int:
        return min(self.lengths[i], self.width)


def cumsum(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return tuple(out)


BUCKETS = [
    BucketGrid(),
    BucketGrid(tokens=8, rows=2, width=4),
    BucketGrid(tokens=16, rows=4, width=8),
    BucketGrid(tokens=4, rows=2, width=1, per_octave=2),
]


@st.composite
def packings(
    draw, pairs: bool = False, widths=(1, 2, 3, 5, 6, 8, 8), max_rows: int = 4, min_len: int = 0, buckets=BUCKETS
) -> Packing:
    """Random packings: 1–4 sequences (an even number for pairs), zero-length ones, per-sequence
    padding, Megatron's bin padding absorbed into the last sequence (`L > S`), and a bucket.
    The structure comes from a `Random` seeded by hypothesis, so examples spread evenly
    instead of clustering at the simplest packing (the failing `Packing` is printed whole)."""
    rnd = random.Random(draw(st.integers(0, 2**31 - 1)))
    rows = 2 * rnd.randint(1, max_rows // 2) if pairs else rnd.randint(1, max_rows)
    width = rnd.choice(widths)
    lengths = [
        rnd.randint(max(min_len, width // 2), width) if rnd.random() < 0.8 else rnd.randint(min_len, width)
        for _ in range(rows)
    ]
    pads = [rnd.choice([0, 0, 1, 2, 3]) for _ in range(rows)]
    if rnd.random() < 0.25:
        lengths[-1] += rnd.randint(1, 3)
    bucket = rnd.choice(buckets)
    pad_data = rnd.random() < 0.5
    return Packing(tuple(lengths), tuple(pads), width, bucket, pad_data, rnd.randint(0, 2**16))


def make_data(family: str, rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """A `[B, S]` batch with every key any loss here reads. token_mask: a prompt prefix of
    zeros then mostly ones; sample_mask: mostly ones. Values past each sequence's length are
    random garbage like any other (the wrappers must slice them away)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    prompt = torch.randint(0, width // 2 + 1, (rows, 1), generator=g)
    cols = torch.arange(width)[None, :]
    token_mask = ((cols >= prompt) & (rand(rows, width) < 0.85)).float()
    sample_mask = (rand(rows) < 0.8).float()
    prev = -rand(rows, width) * 2
    gen = prev + 0.3 * randn(rows, width)
    data = {
        "input_ids": torch.randint(0, VOCAB, (rows, width), generator=g),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": randn(rows, width),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": prev + 0.3 * randn(rows, width),
        "teacher_topk_logits": randn(rows, width, TOPK) * 2,
        "teacher_topk_indices": torch.randint(0, VOCAB, (rows, width, TOPK), generator=g),
        "returns": randn(rows, width),
        "values": randn(rows, width),
    }
    return data


def make_logits(tokens: int, logit_width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return (torch.randn(1, tokens, logit_width, generator=g) * 2).requires_grad_()


def slice_rows(data: dict[str, torch.Tensor], i: int, length: int) -> dict[str, torch.Tensor]:
    """`data.slice(i, i+1)` then `[:, :length]` on tensors with ndim > 1 and shape[1] > 1 (ref §7.2)."""
    out = {}
    for key, value in data.items():
        row = value[i : i + 1]
        if row.dim() > 1 and row.shape[1] > 1:
            row = row[:, :length]
        out[key] = row
    return out


def truncated_masks(data: dict[str, torch.Tensor], lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """token_mask zeroed past each length (what the per-sequence loop sees) and sample_mask."""
    tm = data["token_mask"].clone()
    if tm.shape[1] > 1:
        for i, n in enumerate(lengths):
            tm[i, n:] = 0
    return tm, data["sample_mask"]


def global_counts(family: str, data: dict[str, torch.Tensor], lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """(global_valid_seqs, global_valid_toks) as the trainer computes them (ref §1.3);
    the value loss counts per-position tokens (its token_mask is unsliced, ref §4.7)."""
    tm, sm = truncated_masks(data, lengths)
    toks = tm * sm[:, None] if family == "mse" else tm[:, 1:] * sm[:, None]
    return sm.sum(), toks.sum()


# ---------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------


def _sequence_inputs(case: Case, logits: torch.Tensor, data: dict, cu, cup, i: int):
    """Sequence i's (logits slice, data slice) as the per-sequence loop builds them."""
    width = data["input_ids"].shape[1] if "input_ids" in data else data["token_mask"].shape[1]
    length = cu[i + 1] - cu[i]
    seq = slice_rows(data, i, length)
    if length == 0:  # zero-length sequence: see the module docstring
        seq = {k: (v.new_zeros(v.shape[:1] + (1,) + v.shape[2:]) if v.dim() > 1 else v) for k, v in seq.items()}
    start = cup[i]
    if case.loss_fn.input_type == LossInputType.LOGIT:
        n = min(length, width)
    else:
        n = cup[i + 1] - cup[i]  # §7.2: narrow to the padded segment
    piece = logits[:, start : start + n]
    need = seq["token_mask"].shape[1]
    if piece.shape[1] < need:
        piece = torch.cat([piece, piece.new_zeros(1, need - piece.shape[1], piece.shape[2])], 1)
    return piece, seq


def _evaluate(case: Case, logits: torch.Tensor, data: dict, gs, gt):
    loss_input, data = prepare_loss_input(logits, data, case.loss_fn, **case.prepare_kwargs())
    return case.loss_fn(data=data, global_valid_seqs=gs, global_valid_toks=gt, **loss_input)


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    pad = t.new_zeros(t.shape[:1] + (width - t.shape[1],) + t.shape[2:])
    return torch.cat([t, pad], 1)


def _evaluate_pair(case: Case, pieces, seqs, gs, gt):
    """DPO: each row prepared on its own slice, then the pair as one 2-row batch."""
    prepared = [prepare_loss_input(p, s, case.loss_fn, **case.prepare_kwargs()) for p, s in zip(pieces, seqs)]
    width = max(s["token_mask"].shape[1] for _, s in prepared)
    lp = torch.cat([_pad_width(li["next_token_logprobs"], width - 1) for li, _ in prepared], 0)
    keys = prepared[0][1].keys()
    data = {k: torch.cat([_pad_width(s[k], width) for _, s in prepared], 0) for k in keys}
    return case.loss_fn(data=data, global_valid_seqs=gs, global_valid_toks=gt, next_token_logprobs=lp)


def combine(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """§7.2's metric accumulation, as NeMo-RL's loop writes it: min keys start at +inf, max
    keys at -inf, others at 0; a min/max value is skipped when `math.isinf(value)` and
    otherwise folded in with Python's `min` / `max` (which keep the accumulator when the
    value is NaN); every other key is summed."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            how = aggregation(key)
            if key not in out:
                out[key] = (
                    math.inf if how == "min" else -math.inf if how == "max" else torch.zeros((), dtype=torch.float64)
                )
            if how == "sum":
                out[key] = out[key] + torch.as_tensor(value).detach().double()
                continue
            val = float(value)
            if math.isinf(val):
                continue
            out[key] = min(out[key], val) if how == "min" else max(out[key], val)
    return {k: torch.as_tensor(v, dtype=torch.float32) for k, v in out.items()}


def per_sequence_oracle(case: Case, logits: torch.Tensor, data: dict, cu, cup, gs, gt):
    """(loss, metrics) of the per-sequence loop over packed `[1, T, W]` logits (module docstring)."""
    rows = len(cu) - 1
    losses, parts = [], []
    groups = [(i, i + 1) for i in range(0, rows, 2)] if case.pairs else [(i,) for i in range(rows)]
    for group in groups:
        inputs = [_sequence_inputs(case, logits, data, cu, cup, i) for i in group]
        if case.pairs:
            loss, metrics = _evaluate_pair(case, [p for p, _ in inputs], [s for _, s in inputs], gs, gt)
        else:
            loss, metrics = _evaluate(case, inputs[0][0], inputs[0][1], gs, gt)
        losses.append(loss)
        parts.append(metrics)
    total = torch.stack(losses).sum() if losses else logits.new_zeros(())
    return total, combine(parts)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not loss.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


# ---------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------


def assert_metrics_equal(got: dict, want: dict, equal_nan: bool = False, what: str = "") -> None:
    assert sorted(got) == sorted(want), f"{what} metric keys: got {sorted(got)}, want {sorted(want)}"
    for key in want:
        torch.testing.assert_close(
            torch.as_tensor(got[key]).float(),
            torch.as_tensor(want[key]).float(),
            rtol=RTOL,
            atol=ATOL,
            equal_nan=equal_nan,
            msg=lambda m, k=key: f"{what} metric {k!r}: {m}",
        )


def real_slots(packing: Packing, tokens: int) -> torch.Tensor:
    """bool `[tokens]`: slot holds a real token (the first min(L_i, S) slots of segment i)."""
    keep = torch.zeros(tokens, dtype=torch.bool)
    cup = packing.cu_padded
    for i in range(packing.rows):
        keep[cup[i] : cup[i] + packing.real_len(i)] = True
    return keep


def run_wrapper(case: Case, wrapper_cls, packing: Packing, logits: torch.Tensor, data: dict, gs, gt, call=None):
    """(loss, metrics, grad w.r.t. the packed logits) of one packing wrapper."""
    fused = wrapper_cls is SequencePackingFusionLossWrapper
    wrapper = wrapper_cls(case.loss_fn, case.prepare(fused), packing.cu, packing.cu_padded, bucket=packing.bucket)
    batch = wrapper.layout.pad_data(data) if packing.pad_data else data
    loss, metrics = (call or (lambda w, *a: w(*a)))(wrapper, logits, batch, gs, gt)
    return loss, metrics, grad_of(loss, logits)


def layout_tokens(case: Case, packing: Packing) -> int:
    wrapper = SequencePackingLossWrapper(
        case.loss_fn, prepare_loss_input, packing.cu, packing.cu_padded, bucket=packing.bucket
    )
    return wrapper.layout.tokens


def check_against_oracle(
    case: Case,
    packing: Packing,
    logits: torch.Tensor,
    data: dict,
    gs,
    gt,
    *,
    equal_nan: bool = False,
    call=None,
    wrappers=WRAPPERS,
    parts=("values", "extrema"),
) -> None:
    """Both packing wrappers == the per-sequence oracle: loss, every metric, the gradient at
    real positions; exactly zero gradient at every slot holding no real token. `parts`
    picks what is compared: "values" (loss, gradients, summed metrics, the key set) and/or
    "extrema" (min/max metrics). Every mismatch is collected and reported together."""
    want, want_metrics = per_sequence_oracle(case, logits, data, packing.cu, packing.cu_padded, gs, gt)
    want_grad = grad_of(want, logits)
    real = real_slots(packing, logits.shape[1])
    problems: list[str] = []

    def close(got, expected, what, atol=ATOL):
        try:
            torch.testing.assert_close(
                torch.as_tensor(got).float(),
                torch.as_tensor(expected).float(),
                rtol=RTOL,
                atol=atol,
                equal_nan=equal_nan,
            )
        except AssertionError as e:
            if torch.as_tensor(got).numel() == 1:
                problems.append(f"{what}: library {float(got)!r} vs oracle {float(expected)!r}")
            else:
                problems.append(f"{what}: {str(e).splitlines()[1:4]}")

    for wrapper_cls in wrappers:
        name = wrapper_cls.__name__
        got, got_metrics, got_grad = run_wrapper(case, wrapper_cls, packing, logits, data, gs, gt, call)
        for key in sorted(set(got_metrics) & set(want_metrics)):
            if ("extrema" if aggregation(key) != "sum" else "values") in parts:
                close(got_metrics[key], want_metrics[key], f"{name} metric {key!r}")
        if "values" not in parts:
            continue
        close(got.detach(), want.detach(), f"{name} loss")
        if sorted(got_metrics) != sorted(want_metrics):
            problems.append(f"{name} metric keys: {sorted(got_metrics)} vs oracle {sorted(want_metrics)}")
        close(got_grad[0, real], want_grad[0, real], f"{name} grad at real slots", atol=GRAD_ATOL)
        pad_grad = got_grad[0, ~real]
        if not torch.equal(pad_grad, torch.zeros_like(pad_grad)):
            problems.append(f"{name}: slots holding no real token got gradient {pad_grad[pad_grad != 0][:6].tolist()}")
    assert not problems, "\n".join(problems)
