"""The Liger-signature modules against Liger-Kernel's own chunked losses (pure PyTorch on
CPU: `pip install --no-deps liger-kernel==0.8.5`) and the dense cross-entropy: the loss,
every returned metric and the gradients of the hidden states, the head and its bias."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import typing
from pathlib import Path

import pytest
import torch
from expecttest import TestCase
from tolerances import close

from compiled_loss.integrations import (
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
)
from compiled_loss.integrations.liger import REFUSED_OPTIONS, RefusedOption

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer: pip install --no-deps liger-kernel==0.8.5")

B, T, H, V = 4, 7, 16, 50
RTOL, ATOL = close(torch.float32, "reordered").values()  # Liger's sums against ours


def _inputs():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    mask[:, 0] = 1
    return {
        "h": torch.randn(B, T, H, generator=g),
        "w": torch.randn(V, H, generator=g) * 0.3,
        "b": torch.randn(V, generator=g) * 0.1,
        "ids": torch.randint(0, V, (B, T), generator=g),
        "mask": mask,
        "adv": torch.randn(B, generator=g),
        "old": -torch.rand(B, T, generator=g) * 3,
        "ref": -torch.rand(B, T, generator=g) * 3,
    }


def _run(fn, *tensors):
    """`fn`'s outputs and the gradients of `tensors` (the first output is the loss)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    (out[0] if isinstance(out, tuple) else out).backward()
    return out, [t.grad for t in leaves]


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [x for item in out for x in _flatten(item)]


def _assert_same(ours, theirs, tol=None):
    """Outputs and gradients equal within rtol 1e-5 — or, with `tol` (bf16 arithmetic), within
    `tol` of each tensor's largest entry — and each gradient in the peer's dtype."""
    (out_a, grads_a), (out_b, grads_b) = ours, theirs
    values_a, values_b = _flatten(out_a), _flatten(out_b)
    assert len(values_a) == len(values_b)
    assert [g.dtype for g in grads_a] == [g.dtype for g in grads_b]
    for a, b in zip(values_a + grads_a, values_b + grads_b):
        a, b = a.detach().float(), b.detach().float()
        rtol, atol = (RTOL, ATOL) if tol is None else (tol, tol * float(b.nan_to_num().abs().max().clamp(min=1.0)))
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta, use_ref_model", [(0.0, False), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("off_policy", [False, True])
def test_grpo_matches_liger(loss_type, beta, use_ref_model, off_policy):
    """β ≠ 0 without a reference model: Liger's KL against the detached policy, 0, still
    leads the metrics."""
    x = _inputs()
    kw = dict(beta=beta, use_ref_model=use_ref_model, loss_type=loss_type, max_completion_length=10, temperature=0.7)
    kw |= dict(epsilon_high=0.28, use_bias_correction_kl=off_policy)
    theirs = liger.LigerFusedLinearGRPOLoss(compiled=False, **kw)
    ours = FusedLinearGRPOLoss(compiled=False, **kw)
    call = dict(selected_token_ids=x["ids"], attention_mask=x["mask"], advantages=x["adv"])
    call |= dict(ref_per_token_logps=x["ref"] if use_ref_model else None, num_items_in_batch=torch.tensor(20))
    call |= dict(old_per_token_logps=x["old"] if off_policy else None)
    _assert_same(
        _run(lambda h, w, b: ours(h, w, bias=b, **call), x["h"], x["w"], x["b"]),
        _run(lambda h, w, b: theirs(h, w, bias=b, **call), x["h"], x["w"], x["b"]),
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_dense(reduction):
    """Liger's fused-linear cross-entropy is a Triton kernel: the reference is the dense one."""
    x = _inputs()
    target = torch.where(x["mask"].bool(), x["ids"], -100).view(-1)
    ours = FusedLinearCrossEntropyLoss(reduction=reduction, compiled=False)

    def dense(w, h, b):
        return torch.nn.functional.cross_entropy(h @ w.T + b, target, reduction=reduction)

    def total(loss):
        return loss.sum() if reduction == "none" else loss

    _assert_same(
        _run(lambda w, h, b: total(ours(w, h, target, b)), x["w"], x["h"].view(-1, H), x["b"]),
        _run(lambda w, h, b: total(dense(w, h, b)), x["w"], x["h"].view(-1, H), x["b"]),
    )


@pytest.mark.parametrize("average_log_prob", [False, True])
@pytest.mark.parametrize("compute_nll_loss", [False, True])
def test_dpo_matches_liger(average_log_prob, compute_nll_loss):
    x = _inputs()
    target = torch.where(x["mask"].bool(), x["ids"], -100)
    g = torch.Generator().manual_seed(1)
    ref_h, ref_w = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    kw = dict(beta=0.2, compute_nll_loss=compute_nll_loss, average_log_prob=average_log_prob, alpha=0.5)
    theirs = liger.LigerFusedLinearDPOLoss(compiled=False, **kw)
    ours = FusedLinearDPOLoss(compiled=False, **kw)
    _assert_same(
        _run(lambda w, h, b: ours(w, h, target, b, ref_h, ref_w), x["w"], x["h"], x["b"]),
        _run(lambda w, h, b: theirs(w, h, target, b, ref_h, ref_w), x["w"], x["h"], x["b"]),
    )


@pytest.mark.parametrize("return_soft_hard_loss", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_matches_liger(beta, return_soft_hard_loss):
    x = _inputs()
    labels = torch.where(x["mask"].bool(), x["ids"], -100).view(-1)
    g = torch.Generator().manual_seed(2)
    teacher_h, teacher_w = torch.randn(B * T, 12, generator=g), torch.randn(V, 12, generator=g) * 0.3
    kw = dict(beta=beta, temperature=2.0, weight_hard_loss=0.3, weight_soft_loss=0.7, chunk_size=4)
    kw |= dict(return_soft_hard_loss=return_soft_hard_loss)
    theirs = liger.LigerFusedLinearJSDLoss(compiled=False, **kw)
    ours = FusedLinearJSDLoss(compiled=False, **kw)
    _assert_same(
        _run(lambda h, w: ours(h, w, teacher_h, teacher_w, labels), x["h"].view(-1, H), x["w"]),
        _run(lambda h, w: theirs(h, w, teacher_h, teacher_w, labels), x["h"].view(-1, H), x["w"]),
    )


@pytest.mark.parametrize("compiled", [False, "eager"])
@pytest.mark.parametrize("ignored", ["every target", "every chosen target"])
def test_dpo_nll_with_no_kept_chosen_target_matches_liger(ignored, compiled):
    """`compute_nll_loss` with no chosen target kept: Liger's NLL is 0 / 0, so the loss and
    `nll_loss` are NaN, and the NLL adds nothing to the gradients (zero with every target
    ignored; the preference term's alone when the rejected rows keep theirs)."""
    x = _inputs()
    target = torch.where(x["mask"].bool(), x["ids"], -100)
    target[: B // 2] = -100
    if ignored == "every target":
        target[:] = -100
    g = torch.Generator().manual_seed(1)
    ref_h, ref_w = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    kw = dict(beta=0.2, compute_nll_loss=True)
    theirs = liger.LigerFusedLinearDPOLoss(compiled=False, **kw)
    ours = FusedLinearDPOLoss(compiled=compiled, **kw)
    got = _run(lambda w, h, b: ours(w, h, target, b, ref_h, ref_w), x["w"], x["h"], x["b"])
    _assert_same(got, _run(lambda w, h, b: theirs(w, h, target, b, ref_h, ref_w), x["w"], x["h"], x["b"]))
    (loss, metrics), grads = got
    assert loss.isnan() and metrics[4].isnan()
    assert all(g.isfinite().all() for g in grads)
    assert all((g == 0).all() for g in grads) == (ignored == "every target")


BF16_TOL = 2e-2
"""bf16 arithmetic against the peer's: within 2 % of each tensor's largest entry."""


def _mixed_inputs():
    """bf16 hidden states (policy, reference, teacher) and fp32 heads and bias."""
    x = _inputs()
    g = torch.Generator().manual_seed(3)
    x["h"] = x["h"].bfloat16()
    x["ref_h"], x["ref_w"] = torch.randn(B, T, H, generator=g).bfloat16(), torch.randn(V, H, generator=g) * 0.3
    x["teacher_h"], x["teacher_w"] = torch.randn(B * T, 12, generator=g).bfloat16(), torch.randn(V, 12, generator=g)
    x["target"] = torch.where(x["mask"].bool(), x["ids"], -100)
    return x


def _mixed_case(name, compiled):
    """`(ours, theirs, autocast)`: our module's call and the peer's on bf16 hidden states and
    an fp32 head, and whether the peer needs `torch.autocast(bfloat16)` to take them. Liger's
    GRPO casts the head to the hidden states' dtype itself; its DPO and JSD (and the dense
    cross-entropy) multiply with `@`, which takes mixed dtypes only under autocast."""
    x = _mixed_inputs()
    if name == "grpo":
        kw = dict(beta=0.04, loss_type="bnpo", temperature=0.7, use_bias_correction_kl=True)
        call = dict(ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])
        ours, theirs = (
            FusedLinearGRPOLoss(compiled=compiled, **kw),
            liger.LigerFusedLinearGRPOLoss(compiled=False, **kw),
        )

        def run(module):
            return _run(
                lambda h, w, b: module(h, w, x["ids"], x["mask"], x["adv"], bias=b, **call), x["h"], x["w"], x["b"]
            )

        return lambda: run(ours), lambda: run(theirs), False
    if name == "dpo":
        kw = dict(beta=0.2, compute_nll_loss=True, alpha=0.5)
        ours, theirs = FusedLinearDPOLoss(compiled=compiled, **kw), liger.LigerFusedLinearDPOLoss(compiled=False, **kw)

        def run(module):
            return _run(lambda w, h, b: module(w, h, x["target"], b, x["ref_h"], x["ref_w"]), x["w"], x["h"], x["b"])

        return lambda: run(ours), lambda: run(theirs), True
    if name == "jsd":
        kw = dict(beta=0.5, temperature=2.0, weight_hard_loss=0.3, weight_soft_loss=0.7, chunk_size=8)
        ours, theirs = FusedLinearJSDLoss(compiled=compiled, **kw), liger.LigerFusedLinearJSDLoss(compiled=False, **kw)
        labels, h = x["target"].view(-1), x["h"].view(-1, H)

        def run(module):
            return _run(lambda h, w, b: module(h, w, x["teacher_h"], x["teacher_w"], labels, b), h, x["w"], x["b"])

        return lambda: run(ours), lambda: run(theirs), True
    ours, labels, h = FusedLinearCrossEntropyLoss(compiled=compiled), x["target"].view(-1), x["h"].view(-1, H)

    def dense(w, h, b):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), labels)

    return (
        lambda: _run(lambda w, h, b: ours(w, h, labels, b), x["w"], h, x["b"]),
        lambda: _run(dense, x["w"], h, x["b"]),
        True,
    )


@pytest.mark.parametrize("compiled", [False, "eager"])  # eager: Dynamo traces the objective (fullgraph)
@pytest.mark.parametrize("name", ["grpo", "ce", "dpo", "jsd"])
def test_mixed_dtypes_match_liger(name, compiled):
    """bf16 hidden states with an fp32 head (and bias): the projection runs in bf16 (the
    head cast to it, as Liger's GRPO does and `torch.autocast` does for the others), the
    log-softmax in fp32, each gradient in its tensor's dtype. Ours takes them inside
    autocast and outside it alike; the peer is called where it takes them."""
    ours, theirs, autocast = _mixed_case(name, compiled)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = theirs()
        _assert_same(ours(), expected, tol=BF16_TOL)
    _assert_same(ours(), expected, tol=BF16_TOL)


@pytest.mark.slow  # Inductor
def test_mixed_dtypes_compile_with_inductor():
    """The default compile (Inductor) of the TRL case: bf16 hidden states, an fp32 head."""
    ours, theirs, _ = _mixed_case("grpo", True)
    _assert_same(ours(), theirs(), tol=BF16_TOL)


GRPO_OPTIONS = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.5),
    "cispo, beta 0": dict(loss_type="cispo", epsilon_high=2.0, beta=0.0, use_ref_model=False),
    "gspo grpo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "gspo dapo": dict(loss_type="dapo", importance_sampling_level="sequence", use_bias_correction_kl=True),
    "gspo bnpo": dict(loss_type="bnpo", importance_sampling_level="sequence", beta=0.0, use_ref_model=False),
    "delta": dict(loss_type="dapo", delta=1.5),
    "delta grpo": dict(loss_type="grpo", delta=1.28),
    "vllm_is_ratio [B, T]": dict(loss_type="bnpo", vllm_is_ratio=(B, T)),
    "vllm_is_ratio [B, 1]": dict(loss_type="dr_grpo", vllm_is_ratio=(B, 1)),
    "vllm_is_ratio cispo": dict(loss_type="cispo", epsilon_high=1.2, vllm_is_ratio=(B, T)),
    "ref_input": dict(loss_type="dapo", ref_input=True),
    "ref_input gspo": dict(loss_type="grpo", ref_input=True, importance_sampling_level="sequence"),
}
"""Liger options the library maps onto its objectives (CISPO, GSPO, the dual clip, truncated
importance sampling, a reference head), off-policy so the ratios clip."""


@pytest.mark.parametrize("case", GRPO_OPTIONS)
def test_grpo_options_match_liger(case):
    x = _inputs()
    kw = dict(beta=0.04, max_completion_length=10, temperature=0.7, epsilon_high=0.28) | GRPO_OPTIONS[case]
    call = dict(selected_token_ids=x["ids"], attention_mask=x["mask"], advantages=x["adv"])
    call |= dict(old_per_token_logps=x["old"] - 1.0, num_items_in_batch=torch.tensor(20))
    g = torch.Generator().manual_seed(7)
    if shape := kw.pop("vllm_is_ratio", None):
        call["vllm_is_ratio"] = torch.rand(*shape, generator=g) + 0.5
    if kw.pop("ref_input", None):
        call |= dict(ref_input=torch.randn(B, T, 12, generator=g), ref_weight=torch.randn(V, 12, generator=g) * 0.3)
        call["ref_bias"] = torch.randn(V, generator=g) * 0.1
    elif kw.get("use_ref_model", True):
        call["ref_per_token_logps"] = x["ref"]
    theirs = liger.LigerFusedLinearGRPOLoss(compiled=False, **kw)
    ours = FusedLinearGRPOLoss(compiled=False, **kw)
    _assert_same(
        _run(lambda h, w, b: ours(h, w, bias=b, **call), x["h"], x["w"], x["b"]),
        _run(lambda h, w, b: theirs(h, w, bias=b, **call), x["h"], x["w"], x["b"]),
    )


@pytest.mark.parametrize(
    "build, option, message",
    [
        (lambda: FusedLinearGRPOLoss(loss_type="sapo"), "loss_type", "loss_type must be one of"),
        (lambda: FusedLinearGRPOLoss(loss_type="cispo"), "epsilon_high", "epsilon_high must be >= 1, got 0.2"),
        (lambda: FusedLinearGRPOLoss(delta=1.1), "delta", r"delta must be > 1 and >= 1 \+ epsilon_high = 1.2"),
        (lambda: FusedLinearCrossEntropyLoss(label_smoothing=0.1), "label_smoothing", "label_smoothing is not"),
        (lambda: FusedLinearDPOLoss(loss_type="hinge"), "loss_type", "loss_type must be one of"),
        (lambda: FusedLinearDPOLoss(discopop_tau=0.1), "discopop_tau", "leave it at 0.05, got 0.1"),
    ],
)
def test_options_are_refused_by_name(build, option, message):
    """A `RefusedOption` naming an option listed in `REFUSED_OPTIONS` for its module."""
    with pytest.raises(RefusedOption, match=message) as refused:
        build()
    assert refused.value.option == option and option in REFUSED_OPTIONS[refused.value.who]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FusedLinearGRPOLoss(loss_type="dr_grpo"), "needs max_completion_length > 0"),
        (lambda: FusedLinearGRPOLoss(importance_sampling_level="seq"), "'token' or 'sequence'"),
        (lambda: FusedLinearGRPOLoss(softcap=0.0), "softcap must be a finite number > 0 or None, got 0.0"),
        (lambda: FusedLinearCrossEntropyLoss(reduction="batchmean"), "reduction must be"),
        (lambda: FusedLinearJSDLoss(beta=1.5), r"beta must be in \[0, 1\]"),
    ],
)
def test_bad_options_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_calls_are_refused_before_compiled_code():
    x = _inputs()
    loss = FusedLinearGRPOLoss(beta=0.04)
    with pytest.raises(ValueError, match=r"needs ref_per_token_logps \[B, T\]"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"])
    with pytest.raises(ValueError, match=r"advantages must have shape \(4,\), got \(4, 7\)"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"][:, None].expand(B, T), ref_per_token_logps=x["ref"])
    with pytest.raises(ValueError, match=r"ref_input must have shape \(4, 7, 16\), got \(4, 6, 16\)"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"], ref_input=x["h"][:, :6], ref_weight=x["w"])
    with pytest.raises(ValueError, match=r"vllm_is_ratio must have shape \(4,\), \(4, 1\) or \(4, 7\), got \(7,\)"):
        loss(
            x["h"],
            x["w"],
            x["ids"],
            x["mask"],
            x["adv"],
            ref_per_token_logps=x["ref"],
            vllm_is_ratio=x["adv"][:0].new_ones(7),
        )
    with pytest.raises(ValueError, match=r"_input must be \[2B, T, H\]"):
        FusedLinearDPOLoss()(x["w"], x["h"][:3], x["ids"][:3])


@pytest.mark.slow
def test_compiled_equals_eager_and_compiles_once_per_bucket():
    """fullgraph (a graph break raises); widths 7 and 9 share the 16-token bucket: one graph."""
    torch._dynamo.reset()
    x = _inputs()
    kw = dict(beta=0.04, loss_type="dapo", use_bias_correction_kl=True)
    compiled, eager = FusedLinearGRPOLoss(**kw), FusedLinearGRPOLoss(compiled=False, **kw)
    torch._dynamo.utils.counters.clear()
    for width in (7, 9):
        h = torch.randn(B, width, H)
        ids, mask = torch.randint(0, V, (B, width)), torch.ones(B, width)
        call = dict(
            selected_token_ids=ids, attention_mask=mask, advantages=x["adv"], ref_per_token_logps=-torch.rand(B, width)
        )
        _assert_same(
            _run(lambda h, w: compiled(h, w, **call), h, x["w"]), _run(lambda h, w: eager(h, w, **call), h, x["w"])
        )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    labels = torch.where(x["mask"].bool(), x["ids"], -100).view(-1)
    teacher_h, teacher_w = torch.randn(B * T, 12), torch.randn(V, 12)
    jsd = dict(beta=0.5, chunk_size=4)
    _assert_same(
        _run(lambda h, w: FusedLinearJSDLoss(**jsd)(h, w, teacher_h, teacher_w, labels), x["h"].view(-1, H), x["w"]),
        _run(
            lambda h, w: FusedLinearJSDLoss(compiled=False, **jsd)(h, w, teacher_h, teacher_w, labels),
            x["h"].view(-1, H),
            x["w"],
        ),
    )


# ---------------------------------------------------------------------------------------
# shape buckets: one compile each, up to max_buckets, then a refusal before compiling
# ---------------------------------------------------------------------------------------

WIDTHS = (16, 31, 40, 64, 65, 90, 100, 128, 150, 180, 200, 250)
"""One width in each of the default grid's 12 buckets up to 256 (16, 32, 48, …, 224, 256):
TRL's `max_completion_length=256`."""


class _Counting:
    """A `torch.compile` backend that runs each graph eagerly (Dynamo's tracing is what the
    limit counts) and counts the graphs it is handed."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _bucket_case(name, width):
    """`(module class, config, call)`: `call(module)` runs one batch of `width` tokens
    (2 rows for GRPO and DPO, `width` flat rows for CE and JSD) and returns the outputs
    and the gradients of the hidden states and the head."""
    g = torch.Generator().manual_seed(width)
    h, v = 8, 16
    w = torch.randn(v, h, generator=g) * 0.5
    if name == "grpo":
        x = torch.randn(2, width, h, generator=g)
        ids, adv = torch.randint(0, v, (2, width), generator=g), torch.randn(2, generator=g)
        mask, ref = (torch.rand(2, width, generator=g) > 0.2).float(), -torch.rand(2, width, generator=g)
        return (
            FusedLinearGRPOLoss,
            dict(beta=0.04, loss_type="bnpo"),
            lambda m: _run(lambda x, w: m(x, w, ids, mask, adv, ref_per_token_logps=ref), x, w),
        )
    if name == "dpo":
        x = torch.randn(4, width, h, generator=g)
        target = torch.randint(0, v, (4, width), generator=g).masked_fill(torch.rand(4, width, generator=g) < 0.2, -100)
        return (
            FusedLinearDPOLoss,
            dict(use_ref_model=False, compute_nll_loss=True),
            lambda m: _run(lambda w, x: m(w, x, target), w, x),
        )
    x = torch.randn(width, h, generator=g)
    target = torch.randint(0, v, (width,), generator=g).masked_fill(torch.rand(width, generator=g) < 0.2, -100)
    if name == "ce":
        return FusedLinearCrossEntropyLoss, {}, lambda m: _run(lambda w, x: m(w, x, target), w, x)
    teacher_x, teacher_w = torch.randn(width, 6, generator=g), torch.randn(v, 6, generator=g)
    return (
        FusedLinearJSDLoss,
        dict(chunk_size=64),
        lambda m: _run(lambda x, w: m(x, w, teacher_x, teacher_w, target), x, w),
    )


@pytest.mark.slow  # 12 Dynamo compiles per module (the eager backend: about 0.5-1 s each)
class TestBuckets(TestCase):
    """Each module compiles once per shape bucket, past Dynamo's default limit of 8 graphs
    (`FailOnRecompileLimitHit` at the ninth bucket otherwise) up to `max_buckets`, equal to
    the uncompiled module at every bucket; bucket `max_buckets + 1` is refused on the host
    before it compiles, and the module keeps working on the buckets it has."""

    def _refusal(self, name):
        backend = _Counting()
        cls, config, _ = _bucket_case(name, 1)
        compiled, eager = cls(compiled=backend, max_buckets=12, **config), cls(compiled=False, **config)
        for width in WIDTHS:
            _, _, call = _bucket_case(name, width)
            _assert_same(call(compiled), call(eager))
        assert backend.graphs == len(compiled._objective.buckets) == len(WIDTHS) == 12
        with pytest.raises(ValueError) as refused:
            _bucket_case(name, 257)[2](compiled)
        _, _, call = _bucket_case(name, 7)  # the 16-token bucket again: no compile
        _assert_same(call(compiled), call(eager))
        assert backend.graphs == 12
        return str(refused.value)

    def test_grpo(self):
        self.assertExpectedInline(
            self._refusal("grpo"),
            """FusedLinearGRPOLoss: shape bucket (float32[2, 320, 8] grad, float32[16, 8] grad, None, int64[2, 320], float32[2, 320], float32[2], None, float32[2, 320], None, None, None, None, float32[], float32[], float32, None; grad on) would be distinct bucket 13, and max_buckets=12 compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)""",
        )

    def test_cross_entropy(self):
        self.assertExpectedInline(
            self._refusal("ce"),
            """FusedLinearCrossEntropyLoss: shape bucket (float32[1, 320, 8] grad, float32[16, 8] grad, None, int64[1, 320], float32[1, 320], float32[], float32; grad on) would be distinct bucket 13, and max_buckets=12 compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)""",
        )

    def test_dpo(self):
        self.assertExpectedInline(
            self._refusal("dpo"),
            """FusedLinearDPOLoss: shape bucket (float32[4, 320, 8] grad, float32[16, 8] grad, None, int64[4, 320], float32[4, 320], None, None, None, float32[], float32, None; grad on) would be distinct bucket 13, and max_buckets=12 compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)""",
        )

    def test_jsd(self):
        self.assertExpectedInline(
            self._refusal("jsd"),
            """FusedLinearJSDLoss: shape bucket (float32[320, 8] grad, float32[16, 8] grad, None, float32[320, 6], float32[16, 6], None, int64[320], float32[320], float32[], float32, float32; grad on) would be distinct bucket 13, and max_buckets=12 compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)""",
        )


@pytest.mark.slow  # 4 Dynamo compiles
def test_each_instance_has_a_budget_of_its_own():
    """Two modules with different configs compile 2 buckets each under `max_buckets=2`: the
    graphs of one do not count against the other's limit."""
    backend = _Counting()
    modules = [FusedLinearCrossEntropyLoss(compiled=backend, max_buckets=2, reduction=r) for r in ("mean", "sum")]
    for module in modules:
        for width in (16, 32):
            _bucket_case("ce", width)[2](module)
    assert backend.graphs == 4


def test_max_buckets_refusals():
    x = _inputs()
    with pytest.raises(ValueError, match="FusedLinearGRPOLoss: max_buckets must be an int >= 1, got 0"):
        FusedLinearGRPOLoss(max_buckets=0)
    with pytest.raises(ValueError, match="FusedLinearJSDLoss: compiled must be a bool or a torch.compile backend"):
        FusedLinearJSDLoss(compiled=None)
    ce = FusedLinearCrossEntropyLoss(compiled=_Counting(), max_buckets=1)
    target = x["ids"].view(-1)
    ce(x["w"], x["h"].view(-1, H), target)  # 28 rows: the 32-row bucket
    with pytest.raises(ValueError) as refused:
        ce(x["w"], x["h"].view(-1, H)[:5], target[:5])
    assert str(refused.value) == (
        "FusedLinearCrossEntropyLoss: shape bucket (float32[1, 16, 16], float32[50, 16], None, int64[1, 16], "
        "float32[1, 16], float32[], float32; grad on) would be distinct bucket 2, and max_buckets=1 compiles at "
        "most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)"
    )


# ---------------------------------------------------------------------------------------
# every argument of Liger's modules, from their signatures
# ---------------------------------------------------------------------------------------


def _liger_cross_entropy():
    """Liger's `LigerFusedLinearCrossEntropyLoss` (`liger_kernel.transformers`), for its
    signatures and defaults: imported where Triton is installed, else its class statement
    executed on its own (it reaches its Triton kernel only when called)."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:  # no Triton (this CPU machine)
        root = Path(importlib.util.find_spec("liger_kernel").submodule_search_locations[0])
        path = root / "transformers" / "fused_linear_cross_entropy.py"
        tree = ast.parse(path.read_text())
        node = next(
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LigerFusedLinearCrossEntropyLoss"
        )
        namespace = {"torch": torch, "Optional": typing.Optional}
        exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
        return namespace["LigerFusedLinearCrossEntropyLoss"]
    return LigerFusedLinearCrossEntropyLoss


PEERS = {
    "grpo": (FusedLinearGRPOLoss, liger.LigerFusedLinearGRPOLoss),
    "ce": (FusedLinearCrossEntropyLoss, _liger_cross_entropy()),
    "dpo": (FusedLinearDPOLoss, liger.LigerFusedLinearDPOLoss),
    "jsd": (FusedLinearJSDLoss, liger.LigerFusedLinearJSDLoss),
}


def _parameters(cls, method):
    return {name: p.default for name, p in inspect.signature(getattr(cls, method)).parameters.items() if name != "self"}


@pytest.mark.parametrize("name", PEERS)
def test_every_liger_argument_is_taken_in_liger_order(name):
    """Liger's constructor and forward arguments are a prefix of ours, by name and order
    (positional calls mean the same); our own (`compiled` where Liger has none,
    `chunk_size`'s unit, `bucket`, `max_buckets`) come after them."""
    ours, theirs = PEERS[name]
    for method in ("__init__", "forward"):
        expected = list(_parameters(theirs, method))
        assert list(_parameters(ours, method))[: len(expected)] == expected, method


def _default_call(name):
    """`(constructor arguments, forward arguments, names of the differentiated tensors)`:
    every argument of the peer's at Liger's default, but the data, and the references that
    Liger's default `use_ref_model=True` needs."""
    x = _inputs()
    target = torch.where(x["mask"].bool(), x["ids"], -100)
    g = torch.Generator().manual_seed(4)
    data = {
        "grpo": dict(
            _input=x["h"],
            lin_weight=x["w"],
            selected_token_ids=x["ids"],
            attention_mask=x["mask"],
            advantages=x["adv"],
            ref_per_token_logps=x["ref"],
        ),
        "ce": dict(lin_weight=x["w"], _input=x["h"].view(-1, H), target=target.view(-1)),
        "dpo": dict(
            lin_weight=x["w"],
            _input=x["h"],
            target=target,
            ref_input=torch.randn(B, T, H, generator=g),
            ref_weight=torch.randn(V, H, generator=g),
        ),
        "jsd": dict(
            student_input=x["h"].view(-1, H),
            student_weight=x["w"],
            teacher_input=torch.randn(B * T, 12, generator=g),
            teacher_weight=torch.randn(V, 12, generator=g),
            true_labels=target.view(-1),
        ),
    }[name]
    init, call = _parameters(PEERS[name][1], "__init__"), _parameters(PEERS[name][1], "forward")
    assert set(data) <= set(call)
    call |= data
    assert inspect.Parameter.empty not in call.values()
    leaves = {"grpo": ("_input", "lin_weight"), "jsd": ("student_input", "student_weight")}.get(
        name, ("lin_weight", "_input")
    )
    return init, call, leaves


def _run_keywords(module, call, leaves):
    tensors = {n: call[n].detach().clone().requires_grad_(True) for n in leaves}
    out = module(**(call | tensors))
    (out[0] if isinstance(out, tuple) else out).backward()
    return out, [tensors[n].grad for n in leaves]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: Inductor
@pytest.mark.parametrize("name", PEERS)
def test_every_liger_argument_at_its_default_matches_liger(name, compiled):
    """Ours built and called with every argument of Liger's, each at Liger's default (by
    keyword: a missing one is a TypeError) — `compiled` too in the slow case — equals Liger's
    module built the same way (the dense cross-entropy for Liger's Triton one), uncompiled."""
    ours_cls, theirs_cls = PEERS[name]
    init, call, leaves = _default_call(name)
    ours = ours_cls(**(init | {"compiled": compiled}))
    got = _run_keywords(ours, call, leaves)
    if name == "ce":
        theirs_cls(**init)  # Liger's own constructor takes them as well
        expected = _run_keywords(
            lambda lin_weight, _input, target, bias: torch.nn.functional.cross_entropy(_input @ lin_weight.T, target),
            call,
            leaves,
        )
    else:
        expected = _run_keywords(theirs_cls(**(init | {"compiled": False})), call, leaves)
    _assert_same(got, expected)


REFUSED = {
    "grpo": dict(loss_type=["sapo", "luspo", "vespo"], delta=[1.0, 1.1]),
    "ce": dict(
        ce_weight=[torch.ones(V)],
        lse_square_scale=[1e-4],
        label_smoothing=[0.1],
        softcap=[30.0],
        return_z_loss=[True],
        accum_dtype=[torch.float32],
        use_token_scaling=[True],
        return_token_accuracy=[True],
        return_predicted_tokens=[True],
    ),
    "dpo": dict(
        loss_type=sorted(liger.LigerFusedLinearDPOLoss._SUPPORTED_LOSS_TYPES - {"sigmoid", "bco_pair"}),
        label_smoothing=[0.1],
        discopop_tau=[0.1],
    ),
    "jsd": {},
}
"""Per module, each Liger argument with the values of it that the module cannot honour."""

HONOURED = {
    "grpo": {"beta", "compiled", "use_ref_model", "chunk_size", "epsilon_low", "epsilon_high", "max_completion_length"}
    | {"temperature", "use_bias_correction_kl", "_input", "lin_weight", "selected_token_ids", "attention_mask"}
    | {"advantages", "bias", "ref_per_token_logps", "old_per_token_logps", "num_items_in_batch"}
    | {"importance_sampling_level", "ref_input", "ref_weight", "ref_bias", "vllm_is_ratio"}
    | {"sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg"}
    | {"vespo_lambda_neg"},  # sapo_* and vespo_*: read only by the refused loss types, ignored by the others
    "ce": {"ignore_index", "reduction", "lin_weight", "_input", "target", "bias"},
    "dpo": {"ignore_index", "beta", "alpha", "compute_nll_loss", "compiled", "use_ref_model", "average_log_prob"}
    | {"chunk_size", "lin_weight", "_input", "target", "bias", "ref_input", "ref_weight", "ref_bias"},
    "jsd": set(_parameters(liger.LigerFusedLinearJSDLoss, "__init__"))
    | set(_parameters(liger.LigerFusedLinearJSDLoss, "forward")),
}
"""Per module, the Liger arguments whose values it computes as Liger does (the other tests)."""


@pytest.mark.parametrize("name", PEERS)
def test_every_liger_argument_is_honoured_or_refused_by_name(name):
    """Each argument of Liger's is either honoured or, at a value the module cannot
    honour, refused with a ValueError naming it (constructor arguments when the module is
    built, forward arguments before anything compiles) — never a TypeError."""
    ours_cls, theirs_cls = PEERS[name]
    init, call = _parameters(theirs_cls, "__init__"), _parameters(theirs_cls, "forward")
    assert set(REFUSED[name]).isdisjoint(HONOURED[name])
    assert set(REFUSED[name]) | HONOURED[name] == set(init) | set(call)
    _, data, _ = _default_call(name)
    for argument, values in REFUSED[name].items():
        for value in values:
            with pytest.raises(ValueError, match=rf"\b{argument}\b"):
                if argument in init:
                    ours_cls(**{argument: value})
                else:
                    ours_cls()(**(data | {argument: value}))
