"""Full-vocabulary on-policy distillation (`ClippedPGLossFn(opd_full=…)`, OPD_FULL inputs):
the reverse KL, its diagnostics, the sampled reference KL and the metrics against float64
formulas written here; hidden-state payloads routed per teacher; the config rules; the
pre-packed and `cp_sharder` keywords; a payload short of the batch refused under context
parallelism (every path single-process: `tests/inputs/test_prepare_checks.py`). Packing
equality and compile hygiene run through `tests/cases.py` (`opd_full_*` cases), TP/CP
through `tests/parallel/test_parity.py`."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from tolerances import close

from compiled_loss.checks import ConfigError
from compiled_loss.interfaces import LossInputType, MetricNormalizer
from compiled_loss.loss_functions import ClippedPGLossFn, OPDFullConfig
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.train import compile_loss
from compiled_loss.utils import OPD_FULL_TEACHER_INDEX_FIELD, OPD_FULL_TEACHER_PAYLOAD_FIELD

B, S, V, H = 3, 7, 11, 5
OPD = {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, S)
    for i, length in enumerate((7, 4, 6)):
        token_mask[i, 2:length] = 1.0
    data = {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        "reference_policy_logprobs": -torch.rand(B, S, generator=g) * 3,
        OPD_FULL_TEACHER_PAYLOAD_FIELD: torch.randn(B, S, V, generator=g) * 2,
    }
    logits = (torch.randn(B, S, V, generator=g) * 2).requires_grad_()
    return data, logits


def _globals(data):
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()


def _run(loss_fn, logits, data, **prepare_kwargs):
    inputs, data = prepare_loss_input(logits, data, loss_fn, **prepare_kwargs)
    return loss_fn(data=data, global_valid_seqs=_globals(data)[0], global_valid_toks=_globals(data)[1], **inputs)


def _per_token(logits, teacher_logits):
    """float64 (reverse KL, entropy, cross-entropy) per position `[B, S-1]`."""
    lp = logits.double().log_softmax(-1)[:, :-1]
    lq = teacher_logits.double().log_softmax(-1)[:, :-1]
    p = lp.exp()
    return (p * (lp - lq)).sum(-1), -(p * lp).sum(-1), -(p * lq).sum(-1)


@pytest.mark.parametrize("token_level", [True, False])
def test_reverse_kl_value_gradient_and_metrics(token_level):
    data, logits = _batch()
    loss_fn = ClippedPGLossFn({**OPD, "token_level_loss": token_level}, opd_full={"validate_decomposition": True})
    assert loss_fn.input_type == LossInputType.OPD_FULL
    loss, metrics = _run(loss_fn, logits, data)
    kl, ent, ce = _per_token(logits, data[OPD_FULL_TEACHER_PAYLOAD_FIELD])
    tm, sm = data["token_mask"][:, 1:].double(), data["sample_mask"].double()
    mask = tm * sm[:, None]
    gs, gt = _globals(data)
    if token_level:
        want = (kl * mask).sum() / gt
    else:
        want = (((kl * tm).sum(-1) / tm.sum(-1)) * sm).sum() / gs
    torch.testing.assert_close(loss.double(), want, **close(torch.float32, "same"))
    (grad,) = torch.autograd.grad(loss, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad.double(), want_grad.double(), **close(torch.float32, "reordered"))
    valid = kl[mask > 0]
    expected = {
        "opd_full_reverse_kl": (kl * mask).sum() / gt,
        "opd_full_reverse_kl_min": valid.min(),
        "opd_full_reverse_kl_max": valid.max(),
        "opd_full_entropy": (ent * mask).sum() / gt,
        "opd_full_cross_entropy": (ce * mask).sum() / gt,
        "num_valid_samples": sm.sum(),
        "kl_penalty": torch.tensor(0.0, dtype=torch.float64),
    }
    for key, value in expected.items():
        torch.testing.assert_close(metrics[key].double(), value, **close(torch.float32, "reordered"), msg=key)
    assert 0 <= metrics["opd_full_decomposition_error"] < close(torch.float32, "reordered")["atol"]
    assert set(metrics) == set(expected) | {"loss", "opd_full_decomposition_error"}
    grad_norm = "TOKENS" if token_level else "SEQUENCES"
    assert loss_fn.metric_normalizations == {
        "loss": MetricNormalizer[grad_norm],
        "kl_penalty": MetricNormalizer[grad_norm],
        "num_valid_samples": MetricNormalizer.NONE,
        "opd_full_reverse_kl": MetricNormalizer.TOKENS,
        "opd_full_reverse_kl_min": MetricNormalizer.NONE,
        "opd_full_reverse_kl_max": MetricNormalizer.NONE,
        "opd_full_entropy": MetricNormalizer.TOKENS,
        "opd_full_cross_entropy": MetricNormalizer.TOKENS,
        "opd_full_decomposition_error": MetricNormalizer.NONE,
    }


def test_sampled_reference_kl_with_score_function_weights():
    data, logits = _batch(1)
    beta = 0.3
    with pytest.warns(UserWarning, match="reference KL is added"):
        loss_fn = ClippedPGLossFn({**OPD, "reference_policy_kl_penalty": beta}, opd_full={})
    loss, metrics = _run(loss_fn, logits, data)
    kl, _, _ = _per_token(logits, data[OPD_FULL_TEACHER_PAYLOAD_FIELD])
    lp = logits.double().log_softmax(-1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    log_ratio = (data["reference_policy_logprobs"][:, 1:].double() - lp).clamp(-20, 20)
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * torch.exp(lp - lp.detach())  # weights: value 1, score gradient
    mask = data["token_mask"][:, 1:].double() * data["sample_mask"].double()[:, None]
    gt = _globals(data)[1]
    ref_kl = beta * (k3.clamp(-10, 10) * mask).sum() / gt
    want = (kl * mask).sum() / gt + ref_kl
    torch.testing.assert_close(loss.double(), want, **close(torch.float32, "same"))
    torch.testing.assert_close(metrics["kl_penalty"].double(), ref_kl / beta, **close(torch.float32, "reordered"))
    (grad,) = torch.autograd.grad(loss, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad.double(), want_grad.double(), **close(torch.float32, "reordered"))


def test_hidden_state_payload_routed_per_teacher():
    data, logits = _batch(2)
    g = torch.Generator().manual_seed(3)
    heads = {4: torch.randn(V, H, generator=g), 9: torch.randn(V, H, generator=g)}
    hidden = torch.randn(B, S, H, generator=g)
    index = torch.tensor([9, 4, 7])  # row 2 is masked (sample_mask 0): its unloaded index is never read
    data = {**data, OPD_FULL_TEACHER_PAYLOAD_FIELD: hidden, OPD_FULL_TEACHER_INDEX_FIELD: index}
    loss_fn = ClippedPGLossFn(OPD, opd_full={"teacher_payload": "hidden_states"})
    loss, _ = _run(loss_fn, logits, data, teacher_output_layer_weight_by_index=heads)
    teacher = torch.stack([hidden[i] @ heads[int(index[i])].T if i < 2 else torch.zeros(S, V) for i in range(B)])
    kl, _, _ = _per_token(logits, teacher)
    mask = data["token_mask"][:, 1:].double() * data["sample_mask"].double()[:, None]
    torch.testing.assert_close(loss.double(), (kl * mask).sum() / _globals(data)[1], **close(torch.float32, "same"))
    data[OPD_FULL_TEACHER_INDEX_FIELD] = torch.tensor([9, 7, 4])  # a valid row names no loaded head
    with pytest.raises(ValueError, match="teacher_index names teacher 7 but no teacher LM head is loaded"):
        _run(loss_fn, logits, data, teacher_output_layer_weight_by_index=heads)
    del data[OPD_FULL_TEACHER_INDEX_FIELD]
    with pytest.raises(ValueError, match="2 teacher LM heads are loaded but no teacher_index"):
        _run(loss_fn, logits, data, teacher_output_layer_weight_by_index=heads)


def test_compiled_one_graph_same_values():
    data, logits = _batch(4)
    loss_fn = ClippedPGLossFn(OPD, opd_full={"compute_entropy": True, "compute_cross_entropy": True})
    torch._dynamo.reset()
    compiled = compile_loss(_run, backend="aot_eager", fullgraph=True)
    want, want_metrics = _run(loss_fn, logits, data)
    got, metrics = compiled(loss_fn, logits, data)
    torch.testing.assert_close(got, want)
    for key in want_metrics:
        torch.testing.assert_close(metrics[key], want_metrics[key], msg=key)
    torch.testing.assert_close(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0])


@pytest.mark.parametrize(
    "field,value",
    [
        ("disable_ppo_ratio", False),
        ("ratio_clip_c", 3.0),
        ("force_on_policy_ratio", True),
        ("use_on_policy_kl_approximation", True),
        ("use_importance_sampling_correction", True),
        ("positive_example_nll_weight", 0.5),
        ("use_kl_in_reward", True),
    ],
)
def test_refused_policy_gradient_options(field, value):
    cfg = {**OPD, field: value}
    with pytest.raises(ConfigError, match="opd_full"):
        ClippedPGLossFn(cfg, opd_full={})
    with pytest.raises(ConfigError, match="use_fused_linear_logprobs"):
        ClippedPGLossFn(OPD, True, opd_full={})


def test_config_checks():
    with pytest.raises(ConfigError, match="opd_full.chunk_size must be None or >= 1"):
        OPDFullConfig(chunk_size=0)
    with pytest.raises(ConfigError, match="unknown config keys"):
        ClippedPGLossFn(OPD, opd_full={"chunk": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClippedPGLossFn(OPD, opd_full=OPDFullConfig(chunk_size=2))  # β = 0: no warning


def test_chunking_does_not_change_the_result():
    data, logits = _batch(5)
    whole = _run(ClippedPGLossFn(OPD, opd_full={}), logits, data)[0]
    chunked = _run(ClippedPGLossFn(OPD, opd_full={"chunk_size": 2}), logits, data)[0]
    torch.testing.assert_close(chunked, whole)


def test_wrong_inputs_are_named():
    data, logits = _batch()
    loss_fn = ClippedPGLossFn(OPD, opd_full={})
    with pytest.raises(ValueError, match="opd_full_teacher_payload"):
        _run(loss_fn, logits, {k: v for k, v in data.items() if k != OPD_FULL_TEACHER_PAYLOAD_FIELD})
    with pytest.raises(ValueError, match="opd_full_divergence"):
        loss_fn(torch.zeros(B, S - 1), data, *_globals(data))
    with pytest.raises(ValueError, match="OPD_FULL inputs given to a loss built without opd_full"):
        ClippedPGLossFn(OPD)(torch.zeros(B, S - 1), data, *_globals(data), opd_full_divergence=torch.zeros(B, S - 1))
    with pytest.raises(ValueError, match="cp_sharder"):
        prepare_loss_input(logits, data, loss_fn, cp_sharder=object())


def test_pre_packed_batch_is_one_row():
    """`"cu_seqlens"` in data: input_ids and masks are one packed row; log-probs come back
    in that `[1, T-1]` layout, as for an unpacked one-row batch."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, V, (1, 12), generator=g)
    token_mask = torch.ones(1, 12)
    token_mask[0, [0, 5, 6]] = 0.0  # sequence 0 is [0, 6): its last token predicts nothing
    data = {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(1),
        "cu_seqlens": torch.tensor([0, 6, 12]),
    }
    logits = torch.randn(1, 12, V, generator=g)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    packed, _ = prepare_packed_loss_input(logits, data, loss_fn, None)
    want = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(packed["next_token_logprobs"], want[None])


def _short_payload_under_context_parallelism(rank: int, world: int):
    data, _ = _batch()
    data[OPD_FULL_TEACHER_PAYLOAD_FIELD] = data[OPD_FULL_TEACHER_PAYLOAD_FIELD][:, : S - 1]
    logits = torch.randn(B, 4, V)  # S_local = 4: 2 ranks hold 8 positions, room to zero-pad the payload's 6
    return prepare_loss_input(logits, data, ClippedPGLossFn(OPD, opd_full={}), context_parallel_group=dist.group.WORLD)


@pytest.mark.slow
def test_a_payload_short_of_the_batch_is_refused_under_context_parallelism():
    """Every rank, before any collective: the payload must cover the batch's S positions (not
    only the S_local · cp the ranks hold)."""
    assert (
        run_on_ranks(_short_payload_under_context_parallelism, timeout=60)
        == [
            "ValueError: prepare_loss_input: data['opd_full_teacher_payload'] must have shape [B, S, D] with [B, S] = "
            "(3, 7) (one entry per position of data['input_ids']), got (3, 6, 11)"
        ]
        * 2
    )
