"""The Liger-signature modules against Liger-Kernel's own chunked losses (pure PyTorch on
CPU: `pip install --no-deps liger-kernel==0.8.5`) and the dense cross-entropy: the loss,
every returned metric and the gradients of the hidden states, the head and its bias."""

from __future__ import annotations

import pytest
import torch

from compiled_loss.integrations import (
    FusedLinearCrossEntropyLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
)

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="the peer: pip install --no-deps liger-kernel==0.8.5")

B, T, H, V = 4, 7, 16, 50
RTOL, ATOL = 1e-5, 1e-6


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


def _assert_same(ours, theirs):
    (out_a, grads_a), (out_b, grads_b) = ours, theirs
    values_a, values_b = _flatten(out_a), _flatten(out_b)
    assert len(values_a) == len(values_b)
    for a, b in zip(values_a + grads_a, values_b + grads_b):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [False, True])
def test_grpo_matches_liger(loss_type, beta, off_policy):
    x = _inputs()
    kw = dict(beta=beta, use_ref_model=beta != 0, loss_type=loss_type, max_completion_length=10, temperature=0.7)
    kw |= dict(epsilon_high=0.28, use_bias_correction_kl=off_policy)
    theirs = liger.LigerFusedLinearGRPOLoss(compiled=False, **kw)
    ours = FusedLinearGRPOLoss(compiled=False, **kw)
    call = dict(selected_token_ids=x["ids"], attention_mask=x["mask"], advantages=x["adv"])
    call |= dict(ref_per_token_logps=x["ref"] if beta else None, num_items_in_batch=torch.tensor(20))
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


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_matches_liger(beta):
    x = _inputs()
    labels = torch.where(x["mask"].bool(), x["ids"], -100).view(-1)
    g = torch.Generator().manual_seed(2)
    teacher_h, teacher_w = torch.randn(B * T, 12, generator=g), torch.randn(V, 12, generator=g) * 0.3
    kw = dict(beta=beta, temperature=2.0, weight_hard_loss=0.3, weight_soft_loss=0.7, chunk_size=4)
    theirs = liger.LigerFusedLinearJSDLoss(compiled=False, **kw)
    ours = FusedLinearJSDLoss(compiled=False, **kw)
    _assert_same(
        _run(lambda h, w: ours(h, w, teacher_h, teacher_w, labels), x["h"].view(-1, H), x["w"]),
        _run(lambda h, w: theirs(h, w, teacher_h, teacher_w, labels), x["h"].view(-1, H), x["w"]),
    )


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FusedLinearGRPOLoss(loss_type="cispo"), "loss_type must be one of"),
        (lambda: FusedLinearGRPOLoss(loss_type="dr_grpo"), "needs max_completion_length > 0"),
        (
            lambda: FusedLinearGRPOLoss(importance_sampling_level="sequence"),
            "importance_sampling_level must be 'token'",
        ),
        (lambda: FusedLinearGRPOLoss(delta=2.0), "delta"),
        (lambda: FusedLinearCrossEntropyLoss(label_smoothing=0.1), "label_smoothing is not supported"),
        (lambda: FusedLinearCrossEntropyLoss(reduction="batchmean"), "reduction must be"),
        (lambda: FusedLinearDPOLoss(loss_type="hinge"), "loss_type must be 'sigmoid'"),
        (lambda: FusedLinearJSDLoss(beta=1.5), r"beta must be in \[0, 1\]"),
    ],
)
def test_unsupported_options_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_calls_are_refused_before_compiled_code():
    x = _inputs()
    loss = FusedLinearGRPOLoss(beta=0.04)
    with pytest.raises(ValueError, match=r"needs ref_per_token_logps \[B, T\]"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"])
    with pytest.raises(ValueError, match=r"advantages must have shape \(4,\), got \(4, 7\)"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"][:, None].expand(B, T), ref_per_token_logps=x["ref"])
    with pytest.raises(ValueError, match="ref_input/ref_weight/ref_bias are not supported"):
        loss(x["h"], x["w"], x["ids"], x["mask"], x["adv"], ref_input=x["h"], ref_weight=x["w"])
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
