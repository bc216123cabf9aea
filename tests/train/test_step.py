"""The training step and the Hydra runner, end to end on small sizes."""

from __future__ import annotations

import copy
import json
import math
import random
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from tolerances import approx, close

from compiled_loss.app import load_config
from compiled_loss.app.batches import rollout, sample_batch
from compiled_loss.app.loop import train
from compiled_loss.config import loss_family
from compiled_loss.demo.model import TinyLM
from compiled_loss.train import build_train_step

SMALL = [
    "model.vocab_size=96",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.max_positions=64",
    "data.prompts=3",
    "data.group_size=2",
    "data.modulus=16",
    "data.response_median=5",
    "data.response_max=12",
    "data.prompt_terms_max=5",
    "data.teacher_topk=4",
    "packing.tokens=32",
    "packing.width=24",
    "packing.rows=4",
    "run.micro_batches=2",
    "run.sft_steps=0",
]
LOSSES = ["clipped_pg", "gspo", "cispo", "reinforce", "nll", "dpo", "distillation", "mse_value"]
PACKINGS = ["none", "per_sequence", "fused"]


def config(*overrides: str):
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        return load_config(compose(config_name="config", overrides=SMALL + list(overrides)))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.mark.slow
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_three_steps_every_loss_and_packing(loss, packing, tmp_path):
    """Dynamo traces model + loss as one graph per bucket (backend=eager keeps it fast)."""
    summary = train(config(f"loss={loss}", f"packing={packing}", "run.steps=3", "compile.backend=eager"), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in lines)
    assert summary["compile_problems"] == []
    assert 1 <= summary["compiles"] <= summary["buckets"]
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == lines[-1]["loss"]


def _one_step(loss: str, packing: str, *overrides: str):
    """Loss metrics and gradients of one step on a fixed batch and a fixed init."""
    sampling = ["logprob.top_k=6"] if loss not in ("distillation", "mse_value") else []
    cfg = config(f"loss={loss}", f"packing={packing}", "compile.enabled=false", *sampling, *overrides)
    family = loss_family(cfg.loss)
    torch.manual_seed(0)
    model = TinyLM(cfg.model, value_head=family == "value")
    reference = copy.deepcopy(model)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(1), pairs=family == "dpo")
    batch = rollout(batch, family, policy=model, reference=reference, teacher=reference, topk=4)
    step = build_train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0))
    result = step(batch)
    return result.metrics, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", LOSSES)
def test_packing_modes_agree(loss):
    """none, per_sequence and fused give the same loss, metrics and gradients."""
    metrics, grads = _one_step(loss, "none")
    for packing in ("per_sequence", "fused"):
        other_metrics, other_grads = _one_step(loss, packing)
        for key in ("loss", "num_valid_samples"):
            assert other_metrics[key] == approx(metrics[key], torch.float32, "reordered"), key
        for g, h in zip(grads, other_grads):
            torch.testing.assert_close(h, g, **close(torch.float32, "accumulated"))


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("loss", [name for name in LOSSES if name != "mse_value"])
def test_the_fused_lm_head_equals_the_logits_path(loss, packing):
    """`logprob.fused_linear=true` (the loss from hidden states and the LM head, chunk by
    chunk, never forming the logits): every metric and every gradient as with the logits."""
    metrics, grads = _one_step(loss, packing)
    fused_metrics, fused_grads = _one_step(loss, packing, "logprob.fused_linear=true", "logprob.chunk_size=7")
    assert sorted(fused_metrics) == sorted(metrics)
    for key, value in metrics.items():
        assert fused_metrics[key] == approx(value, torch.float32, "fused", nan_ok=True), key
    for g, h in zip(grads, fused_grads):
        torch.testing.assert_close(h, g, **close(torch.float32, "accumulated"))


@pytest.mark.slow
def test_the_fused_lm_head_compiles_once_per_bucket(tmp_path):
    """Traced with the model as one graph per bucket, no graph break, no recompile."""
    cfg = config(
        "packing=fused", "logprob.fused_linear=true", "logprob.top_k=6", "run.steps=3", "compile.backend=aot_eager"
    )
    summary = train(cfg, tmp_path)
    assert summary["compile_problems"] == [] and 1 <= summary["compiles"] <= summary["buckets"]


@pytest.mark.slow
def test_nll_learns_the_task(tmp_path):
    """50 steps of NLL on the synthetic task: a clear, asserted drop of the loss."""
    train(
        config(
            "loss=nll",
            "run.steps=50",
            "compile.backend=eager",
            "data.prompts=8",
            "data.group_size=1",
            "model.hidden_size=64",
            "optim.lr=3e-3",
        ),
        tmp_path,
    )
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.4 * first, (first, last)


@pytest.mark.slow
def test_steady_state_never_recompiles_a_warm_bucket(tmp_path):
    cfg = config("run.steps=40", "compile.backend=aot_eager", "packing.per_octave=1")
    summary = train(cfg, tmp_path)
    assert summary["compile_problems"] == []
    assert summary["compiles"] == summary["buckets"] < 10
    compiles = [json.loads(line)["compiles"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert compiles[-10:] == [compiles[-1]] * 10  # the last ten steps hit warm buckets only


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    """`-m` sweeps run every combination and write a summary per job."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "compiled_loss.run",
            "-m",
            "loss=nll,dpo",
            "packing=none,fused",
            "run.steps=1",
            "compile.enabled=false",
            f"hydra.sweep.dir={tmp_path}",
            *SMALL,
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    assert sorted((s["loss"], s["packing"]) for s in summaries) == [
        ("dpo", "fused"),
        ("dpo", "none"),
        ("nll", "fused"),
        ("nll", "none"),
    ]


@pytest.mark.slow
def test_bad_override_fails_before_a_model_is_built(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "compiled_loss.run", "loss=mse_value", "logprob.top_p=0.9", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "logprob.top_p=0.9 applies to log-prob losses only; loss=mse_value reads logit inputs" in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_dynamic_shapes_hold_to_one_compile(tmp_path):
    summary = train(config("run.steps=8", "compile.backend=eager", "compile.dynamic=true"), tmp_path)
    assert (summary["compiles"], summary["compile_problems"]) == (1, [])
    assert summary["buckets"] > 1


def _step_and_batch(*overrides: str):
    cfg = config("compile.enabled=false", *overrides)
    family = loss_family(cfg.loss)
    torch.manual_seed(0)
    model = TinyLM(cfg.model)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(1), pairs=family == "dpo")
    batch = rollout(batch, family, policy=model, reference=copy.deepcopy(model), teacher=model, topk=4)
    return build_train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0)), batch


def test_an_odd_dpo_batch_is_refused_not_truncated():
    step, batch = _step_and_batch("loss=dpo")
    batch = {k: v[:5] for k, v in batch.items()}
    with pytest.raises(
        ValueError,
        match=r"DPOLossFn reads \(chosen, rejected\) row pairs; the batch has an odd "
        r"number of rows \(5\)",
    ):
        step(batch)


def test_the_step_validates_each_batch_before_the_compiled_region():
    step, batch = _step_and_batch("loss=clipped_pg")
    bad = {**batch, "input_ids": batch["input_ids"].clone()}
    bad["input_ids"][0, 1] = 96  # model.vocab_size = 96
    with pytest.raises(ValueError, match=r"data\['input_ids'\] must hold token ids in \[0, 96\)"):
        step(bad)
    fractional = {**batch, "sample_mask": batch["sample_mask"] * 2}  # not a mask, but computable
    with pytest.raises(ValueError, match=r"data\['sample_mask'\] must hold values in \[0, 1\]"):
        step(fractional)
    unchecked, _ = _step_and_batch("loss=clipped_pg", "run.validate_inputs=false")
    assert math.isfinite(unchecked(fractional).metrics["loss"])


def test_the_step_compiles_a_method_that_dynamos_precompile_cache_can_name():
    # torch 2.13's precompile cache (TORCH_CACHING_PRECOMPILE=1) keys a compiled function by its
    # __qualname__ and first line: the step hands torch.compile a method of one object, no
    # functools.partial (which has no __qualname__)
    from torch._dynamo.package import CompilePackage

    from compiled_loss.train.step import MicroBatchGraph

    step, _ = _step_and_batch("loss=clipped_pg")
    compiled = step._compiled
    assert isinstance(compiled.__self__, MicroBatchGraph)
    assert compiled.__qualname__ == "MicroBatchGraph.model_and_loss"
    assert len(CompilePackage.source_id_from_fn(compiled)) == 64
