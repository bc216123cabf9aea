"""Property test of the Liger-signature modules (`compiled_loss.integrations`) against
Liger-Kernel's own chunked losses (the dense cross-entropy for its Triton one): random shapes
(rows, odd token widths, H, V), masks with fully masked rows, dtypes (fp32, bf16, and bf16
hidden states under an fp32 head and bias), every loss type and option the modules compute
(GRPO's grpo / bnpo / dr_grpo / dapo with β zero or not, with or without old and reference
log-probs; DPO with or without a reference model, NLL and averaging; JSD's β, temperature
and weights; the cross-entropy's ignore_index and reductions), and sequences of calls
through ONE module instance whose widths cross shape buckets. Every call compares the loss,
every metric and the gradients of the hidden states, the head and its bias (NaN where the
peer's is NaN) within the tolerance of its dtype: rtol 1e-5 in fp32, bf16 arithmetic within
2 % of each tensor's largest entry.

The peer takes bf16 hidden states under an fp32 head inside `torch.autocast` (its DPO, JSD
and the dense cross-entropy multiply with `@`); ours takes them inside autocast or outside
(drawn). GRPO's old log-probs are the policy's own, shifted by log-ratios away from the
clip boundaries, so that bf16 rounding does not flip which tokens clip.

Fast tier: uncompiled modules, a bounded number of derandomized examples. Slow tier: the
modules compiled (aot_eager), one compile per distinct bucket of each instance.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from reliability.oracle import hyp
from tolerances import close

from compiled_loss.integrations import (
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
)

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer: pip install --no-deps liger-kernel==0.8.5")

TOLERANCE = {  # relative, and absolute in units of the compared values' scale
    "fp32": close(torch.float32, "reordered")["rtol"],
    "bf16": close(torch.bfloat16, "reordered")["rtol"],
    "mixed": close(torch.bfloat16, "reordered")["rtol"],
}
"""rtol, and atol as a fraction of each compared tensor's largest finite entry (at least 1)."""

LOG_RATIOS = torch.tensor([0.0, 0.05, -0.05, 0.5, -0.5])
"""GRPO's `lp - old` per token: inside the clip range (0.2 / 0.28) or well outside it."""

MODULES = {
    "grpo": (FusedLinearGRPOLoss, liger.LigerFusedLinearGRPOLoss),
    "ce": (FusedLinearCrossEntropyLoss, None),
    "dpo": (FusedLinearDPOLoss, liger.LigerFusedLinearDPOLoss),
    "jsd": (FusedLinearJSDLoss, liger.LigerFusedLinearJSDLoss),
}


@dataclasses.dataclass(frozen=True)
class Call:
    rows: int  # GRPO rows, DPO pairs, CE / JSD flat positions
    width: int  # tokens per row (1 for CE / JSD)
    seed: int
    options: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: dict[str, Any]  # constructor arguments, Liger's and ours alike
    ours: dict[str, Any]  # constructor arguments of ours only (chunk sizes in its own unit)
    dtype: str  # fp32 | bf16 | mixed (bf16 hidden states, fp32 head and bias)
    ours_autocast: bool  # ours called inside torch.autocast(bf16) (mixed and bf16 cases)
    hidden: int
    vocab: int
    bias: bool
    calls: tuple[Call, ...]


FAMILIES = ("grpo:grpo", "grpo:bnpo", "grpo:dr_grpo", "grpo:dapo", "ce", "dpo", "jsd")
"""A module (GRPO: with its loss type). Each family and dtype is a case of its own, so that a
small budget of examples covers all of them."""

DTYPES = ("fp32", "bf16", "mixed")


@st.composite
def cases(draw, family: str, dtype: str, crossing: bool = False) -> Case:
    """A random case of `family` in `dtype`: 1-3 calls of random widths; `crossing`: 2-3
    calls in distinct buckets of the default grid (multiples of 16 up to 64), then one more
    in the first call's bucket."""
    name, _, loss_type = family.partition(":")
    ours: dict[str, Any] = {}
    if name == "grpo":
        beta = draw(st.sampled_from([0.0, 0.04, 0.3]))
        config = dict(beta=beta, use_ref_model=draw(st.booleans()), loss_type=loss_type)
        config |= dict(max_completion_length=draw(st.sampled_from([8, 64])) if loss_type == "dr_grpo" else None)
        config |= dict(epsilon_high=draw(st.sampled_from([0.2, 0.28])), temperature=draw(st.sampled_from([1.0, 0.7])))
        config |= dict(use_bias_correction_kl=draw(st.booleans()))
        ours["chunk_size"] = draw(st.sampled_from([None, 5]))
    elif name == "dpo":
        config = dict(beta=draw(st.sampled_from([0.1, 0.5])), alpha=draw(st.sampled_from([1.0, 0.5])))
        config |= dict(compute_nll_loss=draw(st.booleans()), use_ref_model=draw(st.booleans()))
        config |= dict(average_log_prob=draw(st.booleans()), ignore_index=draw(st.sampled_from([-100, 1])))
        ours["chunk_size"] = draw(st.sampled_from([None, 5]))
    elif name == "jsd":
        config = dict(beta=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])), temperature=draw(st.sampled_from([1.0, 2.0])))
        config |= dict(
            weight_hard_loss=draw(st.sampled_from([0.5, 0.0, 1.0])), weight_soft_loss=draw(st.sampled_from([0.5, 1.0]))
        )
        config |= dict(chunk_size=draw(st.sampled_from([1, 7, 1024])), ignore_index=draw(st.sampled_from([-100, 2])))
        config |= dict(return_soft_hard_loss=draw(st.booleans()))
    else:
        config = dict(
            ignore_index=draw(st.sampled_from([-100, 3])), reduction=draw(st.sampled_from(["mean", "sum", "none"]))
        )
        ours["chunk_size"] = draw(st.sampled_from([None, 4]))
    flat = name in ("ce", "jsd")
    calls = []
    count = draw(st.integers(2, 3)) if crossing else draw(st.integers(1, 3))
    for k in [*range(count), 0] if crossing else range(count):
        tokens = draw(st.integers(1, 16)) + 16 * k if crossing else draw(st.integers(1, 90 if flat else 70))
        rows = tokens if flat else draw(st.integers(1, 3 if name == "dpo" else 4))
        width = 1 if flat else tokens
        options: dict[str, Any] = {}
        if name == "grpo":
            options = dict(
                old=draw(st.booleans()), ref=draw(st.booleans()), items=draw(st.sampled_from([None, "int", "tensor"]))
            )
        seed = draw(st.integers(0, 2**16)) + 100_003 * DTYPES.index(dtype)  # other data in each dtype
        calls.append(Call(rows, width, seed, options))
    return Case(
        name,
        config,
        ours,
        dtype,
        dtype != "fp32" and draw(st.booleans()),
        draw(st.sampled_from([4, 8, 16])),
        draw(st.sampled_from([3, 17, 64])),
        draw(st.booleans()),
        tuple(calls),
    )


def _dtypes(case: Case) -> tuple[torch.dtype, torch.dtype]:
    """(hidden states, head and bias)."""
    low = torch.bfloat16
    return {"fp32": (torch.float32, torch.float32), "bf16": (low, low), "mixed": (low, torch.float32)}[case.dtype]


def _mask(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A random keep-mask with some fully masked rows (bool)."""
    drop = float(torch.tensor([0.0, 0.3, 0.7])[torch.randint(0, 3, (), generator=g)])
    keep = torch.rand(shape, generator=g) >= drop
    if len(shape) == 2:
        keep &= (torch.rand(shape[0], 1, generator=g) >= 0.25).expand(shape)
    return keep


def _head(case: Case, g: torch.Generator, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, head = _dtypes(case)
    weight = (torch.randn(case.vocab, hidden, generator=g) * 0.4).to(head)
    bias = (torch.randn(case.vocab, generator=g) * 0.2).to(head) if case.bias else None
    return weight, bias


def _policy_logprobs(case: Case, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ids: torch.Tensor):
    """The policy's own log-probs of `ids` (fp32, the projection in the hidden states' dtype)."""
    logits = F.linear(h, w.to(h.dtype)).float() + (0.0 if b is None else b.float())
    logits = logits / case.config["temperature"]
    return logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]


def _call_data(case: Case, call: Call, weight, bias):
    """`(tensors, call(module, tensors), peer_autocast, chosen_kept)`: a call's data (the
    differentiated tensors by name), how a module (ours or the peer) is called on them,
    whether the peer needs autocast, and for DPO the kept chosen targets."""
    g = torch.Generator().manual_seed(call.seed)
    low, head = _dtypes(case)
    rows, width, v = call.rows, call.width, case.vocab
    if case.name == "grpo":
        h = torch.randn(rows, width, case.hidden, generator=g).to(low)
        ids = torch.randint(0, v, (rows, width), generator=g)
        mask = _mask(g, (rows, width)).long()
        lp = _policy_logprobs(case, h, weight, bias, ids)
        old = lp - LOG_RATIOS[torch.randint(0, len(LOG_RATIOS), (rows, width), generator=g)]
        ref = lp + 0.3 * torch.randn(rows, width, generator=g)
        kept = int(mask.sum())
        items = {None: None, "int": kept + 3, "tensor": torch.tensor(kept + 3)}[call.options["items"]]
        extra = dict(advantages=torch.randn(rows, generator=g), num_items_in_batch=items)
        needs_ref = case.config["use_ref_model"]  # Liger asks for a reference whenever use_ref_model
        extra |= dict(
            ref_per_token_logps=ref if needs_ref or call.options["ref"] else None,
            old_per_token_logps=old if call.options["old"] else None,
        )
        tensors = dict(_input=h, lin_weight=weight, bias=bias)

        def run(module, t):
            return module(t["_input"], t["lin_weight"], ids, mask, bias=t["bias"], **extra)

        return tensors, run, False, None
    ignore = case.config["ignore_index"]
    if case.name == "dpo":
        h = torch.randn(2 * rows, width, case.hidden, generator=g).to(low)
        target = torch.randint(0, v, (2 * rows, width), generator=g).masked_fill(~_mask(g, (2 * rows, width)), ignore)
        ref = {}
        if case.config["use_ref_model"]:
            ref_h = torch.randn(2 * rows, width, case.hidden, generator=g).to(low)
            ref_w, ref_b = _head(case, g, case.hidden)
            ref = dict(ref_input=ref_h, ref_weight=ref_w, ref_bias=ref_b)
        tensors = dict(_input=h, lin_weight=weight, bias=bias)

        def run(module, t):
            return module(t["lin_weight"], t["_input"], target, t["bias"], **ref)

        return tensors, run, case.dtype == "mixed", int((target[:rows] != ignore).sum())
    target = torch.randint(0, v, (rows,), generator=g).masked_fill(~_mask(g, (rows,)), ignore)
    h = torch.randn(rows, case.hidden, generator=g).to(low)
    if case.name == "jsd":
        teacher_h = torch.randn(rows, case.hidden + 4, generator=g).to(low)
        teacher_w, teacher_b = _head(case, g, case.hidden + 4)
        tensors = dict(student_input=h, student_weight=weight, student_bias=bias)

        def run(module, t):
            return module(
                t["student_input"], t["student_weight"], teacher_h, teacher_w, target, t["student_bias"], teacher_b
            )

        return tensors, run, case.dtype == "mixed", None
    tensors = dict(_input=h, lin_weight=weight, bias=bias)

    def run(module, t):
        return module(t["lin_weight"], t["_input"], target, t["bias"])

    return tensors, run, case.dtype != "fp32", None


def _dense_cross_entropy(case: Case):
    """The peer of `FusedLinearCrossEntropyLoss`: Liger's fused-linear cross-entropy (a
    Triton kernel) computed densely — the logits in the projection's dtype (autocast's
    inside it), the cross-entropy in fp32, and, as Liger's kernel does (ignored rows add 0,
    the others are divided by the kept count), a mean of 0 when no target is kept where
    torch's is NaN."""
    ignore, reduction = case.config["ignore_index"], case.config["reduction"]

    def ce(lin_weight, _input, target, bias=None):
        logits = F.linear(_input, lin_weight, bias).float()
        losses = F.cross_entropy(logits, target, ignore_index=ignore, reduction="none")
        if reduction == "none":
            return losses
        return losses.sum() / ((target != ignore).sum().clamp(min=1) if reduction == "mean" else 1)

    return ce


def _evaluate(module, run, tensors, autocast: bool):
    """`(outputs, gradients of the tensors that are given)`: the loss (summed, for a
    per-position loss) is back-propagated."""
    leaves = {k: None if t is None else t.detach().clone().requires_grad_(True) for k, t in tensors.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out = run(module, leaves)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()
    return out, [t.grad for t in leaves.values() if t is not None]


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [x for item in out for x in _flatten(item)]


def _assert_close(case: Case, ours, theirs, where: str) -> None:
    tol = TOLERANCE[case.dtype]
    (out_a, grads_a), (out_b, grads_b) = ours, theirs
    values_a, values_b = _flatten(out_a), _flatten(out_b)
    assert len(values_a) == len(values_b), where
    assert [g.dtype for g in grads_a] == [g.dtype for g in grads_b], where
    for i, (a, b) in enumerate(zip(values_a + grads_a, values_b + grads_b)):
        a, b = a.detach().float(), b.detach().float()
        finite = b[b.isfinite()]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, equal_nan=True, msg=lambda m: f"{where} #{i}: {m}")


def _without_unused_nll(expected):
    """Liger's DPO outputs as ours gives them when no chosen target is kept and
    `compute_nll_loss` is off: Liger divides its unused NLL of 0 by the zero count, so its
    loss and `nll_loss` are NaN (the gradients are not touched); ours are the preference
    loss, `-mean log σ(chosen_rewards - rejected_rewards)`, and 0."""
    (loss, metrics), grads = expected
    preference = -F.logsigmoid(metrics[5] - metrics[6]).mean()
    return (preference, (*metrics[:4], torch.zeros_like(metrics[4]), *metrics[5:])), grads


def check(case: Case, compiled: Any = False) -> Any:
    """Every call of `case` through ONE instance of ours against the peer; returns ours."""
    ours_cls, theirs_cls = MODULES[case.name]
    ours = ours_cls(compiled=compiled, **case.config, **case.ours)
    theirs = _dense_cross_entropy(case) if theirs_cls is None else theirs_cls(compiled=False, **case.config)
    weight, bias = _head(case, torch.Generator().manual_seed(case.calls[0].seed + 1), case.hidden)
    for k, call in enumerate(case.calls):
        tensors, run, peer_autocast, chosen_kept = _call_data(case, call, weight, bias)
        expected = _evaluate(theirs, run, tensors, peer_autocast)
        if chosen_kept == 0 and not case.config["compute_nll_loss"]:
            expected = _without_unused_nll(expected)
        got = _evaluate(ours, run, tensors, case.ours_autocast)
        _assert_close(case, got, expected, f"{case.name} call {k} ({call.rows} x {call.width})")
    return ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
@hyp(max_examples=8)
def test_liger_modules_match_liger(family, dtype, data):
    check(data.draw(cases(family, dtype)))


@pytest.mark.slow  # a larger budget of the same
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
@hyp(max_examples=40)
def test_liger_modules_match_liger_at_length(family, dtype, data):
    check(data.draw(cases(family, dtype)))


class _CountingAotEager:
    def __init__(self) -> None:
        self.graphs, self.backend = 0, torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


@pytest.mark.slow  # aot_eager: one compile per bucket of each example
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
@hyp(max_examples=1)
def test_compiled_liger_modules_match_liger(family, dtype, data):
    """The same property with the modules compiled, through each instance 2 or 3 calls in
    distinct buckets and one more in the first one's: one compile per distinct bucket (the
    repeated bucket reuses its graph)."""
    backend = _CountingAotEager()
    case = data.draw(cases(family, dtype, crossing=True))
    ours = check(case, compiled=backend)
    assert backend.graphs == len(ours._objective.buckets) == len(case.calls) - 1
