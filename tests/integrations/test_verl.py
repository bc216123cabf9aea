"""`compiled_loss.integrations.verl` against verl 0.9.1's own `core_algos` (when verl
imports: `pip install 'compiled_loss[verl]' && pip install --no-deps verl==0.9.1`): every
covered policy loss in every aggregation mode, with and without `rollout_is_weights` and the
global-batch normalisers — the loss, every metric under verl's keys and the gradient of
`log_prob` — plus `agg_loss`, `kl_penalty`, `register` / `restore`; and, without verl, the
compile properties (one graph per shape bucket, no graph break, no in-graph host sync) and
`ClippedPGLossFn.token_objective`."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import types

import pytest
import torch
from expecttest import TestCase
from tolerances import close

from compiled_loss.checks import ConfigError
from compiled_loss.integrations import verl as ours
from compiled_loss.losses import ClippedPGLossConfig, ClippedPGLossFn
from compiled_loss.losses.common import reduce_like_loss
from compiled_loss.train.recorder import graph_sync_ops

try:
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
except ImportError:
    core_algos = None

needs_verl = pytest.mark.skipif(
    core_algos is None,
    reason="verl does not import: pip install 'compiled_loss[verl]' && pip install --no-deps verl==0.9.1",
)

COVERED = ("vanilla", "gspo", "cispo", "gpg")
INFOS = ({}, {"dp_size": 2, "batch_num_tokens": 23, "global_batch_size": 6, "loss_scale_factor": 12})
"""`global_batch_info`: none (the micro-batch's own counts), and a data-parallel global batch."""


def _config(clip_ratio_high=0.28, clip_ratio_c=3.0, info=None):
    """verl's ActorConfig when verl imports, else the fields the losses read."""
    info = dict(info or {})
    if core_algos is None:
        return types.SimpleNamespace(
            clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
            global_batch_info=info,
        )  # fmt: skip
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )  # fmt: skip
    config.global_batch_info.update(info)
    return config


def _batch(seed, rows=5, width=9, spread=0.4, mask_dtype=torch.float32, token_adv=True):
    """`(old, log_prob, advantages, mask, weights)`: one fully masked row, log-ratios with
    spread `spread` (10 reaches verl's ±20 clamp on some tokens), advantages per token or
    per sequence."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g) * 3
    lp = old + torch.randn(rows, width, generator=g) * spread
    adv = torch.randn(rows, width if token_adv else 1, generator=g).expand(rows, width).contiguous()
    mask = torch.rand(rows, width, generator=g) > 0.3
    mask[1] = False
    mask[0, 0] = True
    weights = torch.rand(rows, width, generator=g) * 2
    return old, lp, adv, mask.to(mask_dtype), weights


def _run(fn, old, lp, *args, **kwargs):
    """`fn`'s loss, its metrics and the gradient of `lp`."""
    lp = lp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, *args, **kwargs)
    loss.backward()
    return loss.detach(), metrics, lp.grad


def _assert_same(mine, theirs, terms=None, spread=1.0):
    """Equal losses, metric keys and values, gradients. The sums run in another order over
    the bucket-padded shapes: tolerances relative to the size of the terms summed (`terms`:
    the sum of their magnitudes; `spread`: the log-ratios' scale, which ppo_kl averages)."""
    (loss, metrics, grad), (loss_v, metrics_v, grad_v) = mine, theirs
    scale = 1.0 if terms is None else max(1.0, float(terms))
    tol = close(torch.float32, "same")  # relative to the terms' size: atol = rtol × Σ|term|
    torch.testing.assert_close(loss, loss_v, rtol=tol["rtol"], atol=tol["rtol"] * scale)
    assert list(metrics) == list(metrics_v)
    for key, value in metrics_v.items():
        assert isinstance(metrics[key], float), key
        assert metrics[key] == pytest.approx(value, rel=tol["rtol"], abs=tol["atol"] * max(1.0, spread)), key
    torch.testing.assert_close(grad, grad_v, **tol)


# ---------------------------------------------------------------------------------------
# against verl's own functions
# ---------------------------------------------------------------------------------------


@needs_verl
@pytest.mark.parametrize("name", COVERED)
def test_policy_loss_equals_verl(name):
    """Every aggregation mode × rollout_is_weights or not × global_batch_info or not × bool or
    float mask × log-ratios inside and beyond verl's ±20 clamp × per-token or per-sequence
    advantages: loss, verl's metrics (floats, same keys) and the gradient of log_prob."""
    mine = ours.PolicyLoss(name, compiled=False)
    theirs = core_algos.get_policy_loss_fn(name)
    assert not isinstance(theirs, ours.PolicyLoss)
    cases = itertools.product(ours.AGG_MODES, (False, True), INFOS, (torch.bool, torch.float32), (0.4, 12.0))
    for i, (mode, weighted, info, mask_dtype, spread) in enumerate(cases):
        old, lp, adv, mask, weights = _batch(i, spread=spread, mask_dtype=mask_dtype, token_adv=i % 2 == 0)
        args = (adv, mask, mode, _config(info=info), weights if weighted else None)
        terms = (adv.abs() * torch.exp((lp - old).clamp(max=20)) * (1 + lp.abs())).sum()
        _assert_same(_run(mine, old, lp, *args), _run(theirs, old, lp, *args), terms, spread)


@needs_verl
def test_default_modes_and_metric_keys_are_verls():
    old, lp, adv, mask, _ = _batch(0)
    for name in COVERED:
        mine = _run(ours.PolicyLoss(name, compiled=False), old, lp, adv, mask, None, _config())
        _assert_same(mine, _run(core_algos.get_policy_loss_fn(name), old, lp, adv, mask, config=_config()))
    keys = {name: list(_run(ours.PolicyLoss(name, compiled=False), old, lp, adv, mask, None, _config())[1])
            for name in COVERED}  # fmt: skip
    TestCase().assertExpectedInline(
        str(keys),
        """{'vanilla': ['actor/pg_clipfrac', 'actor/ppo_kl', 'actor/pg_clipfrac_lower'], 'gspo': ['actor/pg_clipfrac', 'actor/ppo_kl', 'actor/pg_clipfrac_lower'], 'cispo': ['actor/pg_clipfrac', 'actor/ppo_kl', 'actor/pg_clipfrac_lower'], 'gpg': []}""",  # noqa: E501
    )


@needs_verl
@pytest.mark.parametrize(
    "loss_type,rollout_is,rollout_rs",
    [("ppo_clip", "token", None), ("reinforce", "token", None), ("reinforce", "sequence", "token_k1"),
     ("reinforce", None, None), ("ppo_clip", "sequence", "seq_mean_k1")],
)  # fmt: skip
def test_bypass_mode_equals_verl(loss_type, rollout_is, rollout_rs):
    """verl's helper makes the weights and the rejection mask; the loss and its metrics
    (ppo_kl plus the helper's rollout_corr/*) equal verl's bypass_mode."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    threshold = {None: None, "token_k1": 1.3, "seq_mean_k1": "0.9_1.1"}[rollout_rs]
    correction = RolloutCorrectionConfig(
        rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rollout_rs, rollout_rs_threshold=threshold,
        bypass_mode=True, loss_type=loss_type,
    )  # fmt: skip
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction),
    )  # fmt: skip
    old, lp, adv, mask, _ = _batch(3, mask_dtype=torch.bool)
    for mode in ours.AGG_MODES:
        args = (adv, mask, mode, config, None)
        mine = _run(ours.PolicyLoss("bypass_mode", compiled=False), old, lp, *args)
        _assert_same(mine, _run(core_algos.get_policy_loss_fn("bypass_mode"), old, lp, *args))


@needs_verl
def test_agg_loss_equals_verl():
    """Five modes × normalisers (none, ints, tensors, a loss_scale_factor) × mask dtypes
    (bool, float32, float64 with a float64 loss), value and gradient."""
    g = torch.Generator().manual_seed(0)
    infos = [
        {},
        {"dp_size": 4, "batch_num_tokens": 31, "global_batch_size": 9},
        {"batch_num_tokens": torch.tensor(31), "global_batch_size": torch.tensor(9.0), "loss_scale_factor": 7},
    ]
    for mode, info, dtype in itertools.product(ours.AGG_MODES, infos, (torch.bool, torch.float32, torch.float64)):
        loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        mat = torch.randn(6, 11, generator=g, dtype=loss_dtype)
        mask = torch.rand(6, 11, generator=g) > 0.4
        mask[2] = False
        results = []
        for fn in (ours.agg_loss, core_algos.agg_loss):
            x = mat.clone().requires_grad_(True)
            out = fn(x, mask.to(dtype), mode, **info)
            out.backward()
            results.append((out.detach(), x.grad))
        torch.testing.assert_close(results[0], results[1], **close(loss_dtype, "same"))


@needs_verl
def test_agg_loss_refusals_are_verls():
    mat, mask = torch.randn(2, 3), torch.ones(2, 3)
    for kwargs in (
        {"loss_agg_mode": "token-mean", "dp_size": 2},
        {"loss_agg_mode": "seq-mean-token-mean", "dp_size": 2},
        {"loss_agg_mode": "seq-mean-token-sum", "dp_size": 2},
        {"loss_agg_mode": "sum"},
    ):
        with pytest.raises(ValueError) as theirs:
            core_algos.agg_loss(mat, mask, **kwargs)
        with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
            ours.agg_loss(mat, mask, **kwargs)


@needs_verl
@pytest.mark.parametrize("mode", [m + plus for m in ours.KL_PENALTIES for plus in ("", "+")])
def test_kl_penalty_equals_verl(mode):
    """Value and gradient of each mode and its straight-through `+` form, log-ratios beyond
    the k3 clamp included."""
    g = torch.Generator().manual_seed(1)
    logprob, ref = -torch.rand(4, 8, generator=g) * 3, -torch.rand(4, 8, generator=g) * 3
    logprob[0, :2], ref[0, :2] = torch.tensor([-30.0, -0.1]), torch.tensor([-0.1, -30.0])
    results = []
    for fn in (ours.kl_penalty, core_algos.kl_penalty):
        x = logprob.clone().requires_grad_(True)
        out = fn(x, ref, mode)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[0], results[1], **close(torch.float32, "same"))


@needs_verl
@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_nan_outside_the_mask_reaches_nothing(name):
    """Inputs outside response_mask are zeroed before any math: a NaN there leaves the loss,
    the metrics and the gradient as they are (verl's vanilla is finite too in token modes;
    its sequence modes and gspo give a NaN loss)."""
    old, lp, adv, mask, weights = _batch(5, mask_dtype=torch.bool)
    poisoned = [x.masked_fill(~mask, float("nan")) for x in (old, lp, adv, weights)]
    loss = ours.PolicyLoss(name, compiled=False)
    for mode in ours.AGG_MODES:
        clean = _run(loss, old, lp, adv, mask, mode, _config(), weights)
        dirty = _run(loss, poisoned[0], poisoned[1], poisoned[2], mask, mode, _config(), poisoned[3])
        _assert_same(dirty, clean)
    theirs = _run(core_algos.get_policy_loss_fn(name), poisoned[0], poisoned[1], poisoned[2], mask, "seq-mean-token-mean",
                  _config(), poisoned[3])  # fmt: skip
    assert theirs[0].isnan()


# ---------------------------------------------------------------------------------------
# verl's registry
# ---------------------------------------------------------------------------------------


@needs_verl
def test_register_returns_what_it_replaced_and_restore_puts_it_back():
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    replaced = ours.register()
    try:
        assert replaced == {name: before[name] for name in ours.POLICY_LOSSES}
        for name in ours.POLICY_LOSSES:
            fn = core_algos.get_policy_loss_fn(name)
            assert isinstance(fn, ours.PolicyLoss) and fn.name == name
        for name in ours.VERL_OWN:  # verl's own stay
            assert core_algos.get_policy_loss_fn(name) is before[name]
        assert set(core_algos.POLICY_LOSS_REGISTRY) == set(before)
        again = ours.register(["gspo"], compiled=False)
        assert again["gspo"] is not before["gspo"] and isinstance(again["gspo"], ours.PolicyLoss)
    finally:
        ours.restore(replaced)
    assert core_algos.POLICY_LOSS_REGISTRY == before
    with pytest.raises(ValueError) as refused:
        ours.register(["vanilla", "sapo"])
    assert core_algos.POLICY_LOSS_REGISTRY == before  # refused before anything changed
    TestCase().assertExpectedInline(
        str(refused.value),
        """register: 'sapo' is not computed by compiled_loss (it stays verl's own); names: ('vanilla', 'gspo', 'cispo', 'gpg', 'bypass_mode')""",  # noqa: E501
    )


@needs_verl
def test_registered_loss_is_what_a_verl_config_selects():
    """verl's actor reads `config.policy_loss.loss_mode` through `get_policy_loss_fn`: after
    one `register()` call it computes this library's loss."""
    replaced = ours.register(compiled=False)
    try:
        config = _config()
        fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
        old, lp, adv, mask, _ = _batch(2)
        _assert_same(_run(fn, old, lp, adv, mask, "token-mean", config), _run(replaced["vanilla"], old, lp, adv, mask,
                     "token-mean", config))  # fmt: skip
    finally:
        ours.restore(replaced)


@needs_verl
def test_importing_patches_nothing():
    """Executing the module (a fresh copy of it) changes neither verl's registry nor
    core_algos' functions, and imports no verl module."""
    import importlib.util

    registry, functions = dict(core_algos.POLICY_LOSS_REGISTRY), (core_algos.agg_loss, core_algos.kl_penalty)
    loaded = {name for name in sys.modules if name.split(".")[0] == "verl"}
    spec = importlib.util.spec_from_file_location("_verl_integration_copy", ours.__file__)
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    try:
        spec.loader.exec_module(sys.modules[spec.name])
    finally:
        del sys.modules[spec.name]
    assert core_algos.POLICY_LOSS_REGISTRY == registry
    assert (core_algos.agg_loss, core_algos.kl_penalty) == functions
    assert {name for name in sys.modules if name.split(".")[0] == "verl"} == loaded


@pytest.mark.slow
def test_importing_imports_no_verl():
    """A process that imports the module has no verl module loaded (it imports verl only in
    `register`, `restore` and bypass_mode)."""
    code = "import sys, compiled_loss.integrations.verl; print(sorted(m for m in sys.modules if m.startswith('verl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------
# refusals (without verl: a config with the fields the losses read)
# ---------------------------------------------------------------------------------------


def test_refusals():
    old, lp, adv, mask, _ = _batch(0)
    vanilla = ours.PolicyLoss("vanilla", compiled=False)
    messages = []
    for call in (
        lambda: vanilla(old, lp, adv, mask, "token-mean", None),
        lambda: vanilla(old, lp, adv, mask, "token-mean", _config(clip_ratio_c=1.0)),
        lambda: vanilla(old, lp, adv, mask, "token-mean", _config(info={"dp_size": 2})),
        lambda: vanilla(old, lp, adv, mask, "seq-mean", _config()),
        lambda: vanilla(old, lp[:, :3], adv, mask, "token-mean", _config()),
        lambda: vanilla(old, lp, adv, mask, "token-mean", _config(info={"micro_batches": 2})),
        lambda: ours.PolicyLoss("sapo"),
        lambda: ours.kl_penalty(lp, old, "full"),
    ):
        with pytest.raises(ValueError) as refused:
            call()
        messages.append(str(refused.value))
    TestCase().assertExpectedInline(
        "\n".join(messages),
        """\
compiled_loss verl policy loss 'vanilla': config (verl's ActorConfig) is required
compiled_loss verl policy loss 'vanilla': config.clip_ratio_c, the lower bound of the ratio for dual-clip PPO, must be > 1.0, got 1.0
(global) batch_num_tokens is required when dp_size > 1
Invalid loss_agg_mode: seq-mean (compiled_loss verl policy loss 'vanilla': one of token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm)
compiled_loss verl policy loss 'vanilla': old_log_prob must have shape (5, 3), got (5, 9)
compiled_loss verl policy loss 'vanilla': config.global_batch_info has unknown keys ['micro_batches']; known: ['dp_size', 'batch_num_tokens', 'global_batch_size', 'loss_scale_factor']
PolicyLoss: name must be one of ('vanilla', 'gspo', 'cispo', 'gpg', 'bypass_mode'), got 'sapo' ('sapo' stays verl's own)
kl_penalty: 'full' is not computed (verl raises NotImplementedError for it too); one of kl, k1, abs, mse, k2, low_var_kl, k3, each also with a '+' suffix""",  # noqa: E501
    )
    with pytest.raises(ConfigError):  # an AssertionError too, as verl asserts
        vanilla(old, lp, adv, mask, "token-mean", None)
    with pytest.raises(NotImplementedError):  # the exception verl raises
        ours.kl_penalty(lp, old, "k4")


# ---------------------------------------------------------------------------------------
# ClippedPGLossFn.token_objective
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        {"ratio_clip_c": 3.0, "ratio_clip_max": 0.28},
        {"use_cispo": True},
        {"disable_ppo_ratio": True},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.5},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
         "truncated_importance_sampling_ratio": 1.5, "truncated_importance_sampling_ratio_min": 0.5},
    ],
)  # fmt: skip
def test_token_objective_reduces_to_the_loss(cfg):
    """The loss (β = 0, no NLL term) is the reduction of `token_objective`: same value and
    gradient, token- or sequence-level."""
    fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **cfg))
    g = torch.Generator().manual_seed(0)
    rows, width = 4, 10
    data = {
        "token_mask": (torch.rand(rows, width, generator=g) > 0.3).float(),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "advantages": torch.randn(rows, width, generator=g),
        "prev_logprobs": -torch.rand(rows, width, generator=g) * 2,
        "generation_logprobs": -torch.rand(rows, width, generator=g) * 2,
    }
    lp = -torch.rand(rows, width - 1, generator=g) * 2
    toks, seqs = data["token_mask"][:, 1:].sum() * 1.5, torch.tensor(4.0)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, _ = fn(next_token_logprobs=a, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
    loss.backward()
    tm, sm = data["token_mask"][:, 1:], data["sample_mask"]
    reduced = reduce_like_loss(fn.token_objective(b, data), tm, sm, fn.cfg.token_level_loss, toks, seqs)
    reduced.backward()
    torch.testing.assert_close((reduced, b.grad), (loss, a.grad), **close(torch.float32, "same"))
    assert (fn.token_objective(lp, data)[tm * sm[:, None] == 0] == 0).all()


# ---------------------------------------------------------------------------------------
# compiled once per shape bucket
# ---------------------------------------------------------------------------------------


class _Counting:
    """A `torch.compile` backend that runs each graph eagerly (Dynamo's tracing is what breaks
    graphs and what the recompile limit counts), counting the graphs and the in-graph host
    syncs it is handed."""

    def __init__(self) -> None:
        self.graphs, self.syncs = 0, []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.syncs += graph_sync_ops(gm)
        return gm.forward


def _compiled_equals_eager(name, shapes, backend, mode="token-mean", max_buckets=64):
    """Each `(rows, width)` through one compiled `PolicyLoss` equals the eager one; the
    normalisers change every call (their values are graph inputs, not constants)."""
    compiled = ours.PolicyLoss(name, compiled=backend, max_buckets=max_buckets)
    eager = ours.PolicyLoss(name, compiled=False)
    for i, (rows, width) in enumerate(shapes):
        old, lp, adv, mask, weights = _batch(i, rows=rows, width=width, mask_dtype=torch.bool)
        info = {"dp_size": 2, "batch_num_tokens": 40 + i, "global_batch_size": 7 + i}
        args = (adv, mask, mode, _config(info=info), weights)
        _assert_same(_run(compiled, old, lp, *args), _run(eager, old, lp, *args))
    return compiled


def test_one_graph_per_bucket():
    """Widths 7, 9 and 16 share the 16-token bucket, 17 is the next one: two graphs, no
    graph break (fullgraph), no in-graph host sync."""
    torch._dynamo.reset()
    backend = _Counting()
    loss = _compiled_equals_eager("vanilla", [(4, 7), (4, 9), (4, 16), (4, 17), (4, 9)], backend)
    assert (backend.graphs, backend.syncs, len(loss._objective.buckets)) == (2, [], 2)


WIDTHS = (16, 31, 40, 64, 65, 90, 100, 128, 150, 180, 200, 250)
"""One response length in each of the default grid's 12 buckets up to 256."""


@pytest.mark.slow
@pytest.mark.parametrize("name", COVERED)
def test_twelve_buckets_then_a_refusal(name):
    """12 buckets (widths, and rows 3, 5, 6 sharing one) compile 12 graphs, each call equal to
    the eager loss, with no graph break and no host sync; `max_buckets=12` refuses the 13th
    on the host, naming it, before anything compiles."""
    torch._dynamo.reset()
    backend = _Counting()
    shapes = [(3 + i % 2, w) for i, w in enumerate(WIDTHS)]
    loss = _compiled_equals_eager(name, shapes, backend, mode="seq-mean-token-sum-norm", max_buckets=12)
    assert (backend.graphs, backend.syncs) == (12, [])
    old, lp, adv, mask, _ = _batch(0, rows=4, width=300)
    with pytest.raises(ValueError, match="would be distinct bucket 13, and max_buckets=12") as refused:
        loss(old, lp, adv, mask, "seq-mean-token-sum-norm", _config())
    assert "float32[4, 320]" in str(refused.value)
    assert backend.graphs == 12


@pytest.mark.slow
def test_inductor_equals_eager():
    """Inductor (the default `compiled=True`): every covered loss, in one bucket each, equals
    the eager loss (one aggregation mode each, all five over the four)."""
    torch._dynamo.reset()
    for name, mode in zip(COVERED, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")):
        _compiled_equals_eager(name, [(4, 7), (3, 12)], True, mode=mode)
