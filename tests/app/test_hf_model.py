"""A Hugging Face `transformers` causal LM as the run's policy (`model=hf`,
`compiled_loss.demo.hf`): the wrapper's logits are the HF model's own, packed sequences do
not see each other, the fused LM head and the generation cache give what the plain forward
gives, the compiled step trains it alike in every layout, and the runner's main job raises
its reward. Skipped without `transformers` (`pip install 'compiled_loss[hf]'`)."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from common import LEARNING_TASK, SMALL_RUN

pytest.importorskip("transformers", reason="model=hf needs transformers: pip install 'compiled_loss[hf]'")

from tolerances import approx, close

from compiled_loss.app import compose_config  # noqa: E402
from compiled_loss.app.batches import rollout, sample_batch  # noqa: E402
from compiled_loss.checks import ConfigError  # noqa: E402
from compiled_loss.config import ModelConfig  # noqa: E402
from compiled_loss.demo import hf  # noqa: E402
from compiled_loss.demo.hf import HFCausalLM, policy_model  # noqa: E402
from compiled_loss.integrations.hf import HEAD_RULES, HeadTransform  # noqa: E402
from compiled_loss.train import build_train_step  # noqa: E402

SIZES = dict(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, max_positions=64, architecture="hf")

# the runner's overrides at test size (tests/common.py's SMALL_RUN with model=hf, 3 prompts)
SMALL = [
    "model=hf",
    *(o for o in SMALL_RUN if not o.startswith("data.prompts=")),
    "data.prompts=3",
    "run.micro_batches=2",
    "run.sft_steps=0",
]


def _model(model_type: str = "llama", **overrides) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(ModelConfig(**{**SIZES, "hf_model_type": model_type, **overrides}))


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_logits_are_the_hf_models_own(model_type):
    model = _model(model_type)
    ids = _ids(3, 10)
    positions = torch.arange(10).expand(3, 10)
    logits = model(ids, positions, torch.zeros_like(ids))
    assert logits.shape == (3, 10, SIZES["vocab_size"])
    torch.testing.assert_close(logits, model.lm(input_ids=ids).logits, **close(torch.float32, "forward"))
    assert model.training and not model.lm.training  # dropout stays off while the wrapper trains


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_sequences_each_see_only_themselves(model_type):
    """A `[1, T]` row of three sequences (segment ids, positions restarting at 0, padding
    slots of their own segment) gives each sequence the logits it has alone."""
    model = _model(model_type)
    lengths = [5, 9, 3]
    sequences = [_ids(1, n)[0] for n in lengths]
    ids = torch.cat([*sequences, torch.zeros(7, dtype=torch.long)])[None]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate([*lengths, 7])])[None]
    positions = torch.cat([torch.arange(n) for n in [*lengths, 7]])[None]
    packed = model(ids, positions, segments)[0]
    start = 0
    for sequence in sequences:
        n = len(sequence)
        alone = model(sequence[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0]
        torch.testing.assert_close(packed[start : start + n], alone, **close(torch.float32, "forward"))
        start += n


def test_linear_logits_are_the_dense_logits_factors():
    model = _model()
    ids = _ids(2, 8)
    positions, segments = torch.arange(8).expand(2, 8), torch.zeros_like(ids)
    factors = model(ids, positions, segments, linear_logits=True)
    assert factors.weight is model.lm.lm_head.weight
    dense = model(ids, positions, segments)
    torch.testing.assert_close(
        F.linear(factors.hidden, factors.weight, factors.bias), dense, **close(torch.float32, "exact")
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_prefill_and_decode_give_the_forwards_next_token_logits(model_type):
    """Right-padded prompts of different lengths, then three decoding steps at each row's
    own position: every step's logits are the full forward's over the row so far."""
    _check_generation(_model(model_type))


def _check_generation(model: HFCausalLM) -> None:
    prompts, lengths = _ids(3, 6), torch.tensor([6, 2, 4])
    width, steps = 6, 3
    logits, cache = model.prefill(prompts, lengths, cache_len=width + steps)
    assert cache.shape[-2] == width + steps
    rows = [prompts[r, : lengths[r]].tolist() for r in range(3)]
    positions = lengths.clone()
    for _ in range(steps):
        for r, row in enumerate(rows):
            n = len(row)
            expected = model(torch.tensor([row]), torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0, -1]
            torch.testing.assert_close(logits[r], expected, **close(torch.float32, "decode"))
        tokens = logits.argmax(-1)
        for r, row in enumerate(rows):
            row.append(int(tokens[r]))
        logits, cache = model.decode(tokens, positions, cache)
        positions = positions + 1


# each logit transform a config may declare, at a value that shows (its default is often 1 or
# none)
_TRANSFORMS = {"logits_scaling": 8.0, "logit_scale": 0.25, "final_logit_softcapping": 3.0}
_FAST_TYPES = {"llama", "granite", "cohere", "nanochat", "hyperclovax"}  # one per transform rule


def _showing_transforms(monkeypatch) -> None:
    built = hf.hf_config

    def config(model):
        config = built(model)
        text = config.get_text_config()
        for name, value in _TRANSFORMS.items():
            if name in vars(text):
                setattr(text, name, value)
        return config

    monkeypatch.setattr(hf, "hf_config", config)


@pytest.mark.parametrize(
    "model_type",
    [t if t in _FAST_TYPES else pytest.param(t, marks=pytest.mark.slow) for t in hf.SUPPORTED_MODEL_TYPES],
)
def test_every_supported_architecture_gives_the_models_own_logits(model_type, monkeypatch):
    """For every model type `model=hf` accepts, with its logit scaling / softcap at a value
    that shows and an LM head large enough for the softcap to bend: the adapter's dense
    logits are `model(...).logits` of transformers, the fused head's factors give the same
    logits, and prefill and decode give the forward's."""
    _showing_transforms(monkeypatch)
    model = _model(model_type)
    if model_type in HEAD_RULES:
        assert model.head_transform != HeadTransform(), "the test's transform attributes must show"
    with torch.no_grad():
        model.lm.get_output_embeddings().weight.mul_(30)
        ids = _ids(2, 7)
        args = (ids, torch.arange(7).expand(2, 7), torch.zeros_like(ids))
        dense = model(*args)
        torch.testing.assert_close(dense, model.lm(input_ids=ids).logits, **close(torch.float32, "forward"))
        factors = model(*args, linear_logits=True)
        torch.testing.assert_close(factors.logits(), dense, **close(torch.float32, "fused"))
        _check_generation(model)


def test_a_checkpoints_logit_scaling_is_applied(tmp_path):
    """A Granite checkpoint with logits_scaling=8, loaded with model.hf_path: the loaded
    model's logits are transformers' own (lm_head's output / 8)."""
    torch.manual_seed(0)
    config = hf.hf_config(ModelConfig(**SIZES, hf_model_type="granite"))
    config.logits_scaling = 8.0
    import transformers

    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "granite")
    loaded = HFCausalLM(ModelConfig(**SIZES, hf_path=str(tmp_path / "granite")))
    assert loaded.head_transform == HeadTransform(scale=1 / 8)
    ids = _ids(2, 7)
    with torch.no_grad():
        ours = loaded(ids, torch.arange(7).expand(2, 7), torch.zeros_like(ids))
        torch.testing.assert_close(ours, loaded.lm(input_ids=ids).logits, **close(torch.float32, "forward"))


def test_local_weights_load_and_are_checked(tmp_path):
    model = _model()
    model.lm.save_pretrained(tmp_path / "weights")
    loaded = HFCausalLM(ModelConfig(**SIZES, hf_path=str(tmp_path / "weights")))
    ids = _ids(2, 7)
    args = (ids, torch.arange(7).expand(2, 7), torch.zeros_like(ids))
    torch.testing.assert_close(loaded(*args), model(*args), **close(torch.float32, "exact"))
    with pytest.raises(ConfigError, match=r"model.hf_path=.*has a vocabulary of 32 tokens, model.vocab_size=40: set"):
        HFCausalLM(ModelConfig(**{**SIZES, "vocab_size": 40}, hf_path=str(tmp_path / "weights")))
    with pytest.raises(ConfigError, match=r"model.hf_path=.*missing: no such directory of a transformers model"):
        HFCausalLM(ModelConfig(**SIZES, hf_path=str(tmp_path / "missing")))


def test_refused_configurations_name_the_key(monkeypatch):
    with pytest.raises(ConfigError, match="model.hf_path=/w needs model.architecture=hf"):
        ModelConfig(hf_path="/w")
    with pytest.raises(ConfigError, match="model.architecture must be 'tiny' or 'hf', got 'llama'"):
        ModelConfig(architecture="llama")
    with pytest.raises(ConfigError, match="model.hf_model_type='no_such_model'"):
        _model("no_such_model")
    for unsupported in ("gemma2", "dots1", "bert", "phi4_multimodal"):  # sliding layers, crashes, an encoder, …
        with pytest.raises(ConfigError, match=f"model.hf_model_type='{unsupported}' is not a model type model=hf runs"):
            _model(unsupported)
    with pytest.raises(ConfigError, match="model.hf_model_type='dots1' is not a model type"):  # at load
        compose_config("model=hf", "model.hf_model_type=dots1")
    with pytest.raises(ConfigError, match="model.hf_model_type=mistral: a sliding window of 4096 positions, shorter"):
        _model("mistral", max_positions=8192)
    _model("mistral")  # its window covers model.max_positions: full attention is its attention
    with pytest.raises(ConfigError, match="loss=mse_value trains a value head"):
        policy_model(ModelConfig(**SIZES), value_head=True)
    with pytest.raises(ConfigError, match="draft=eagle3 co-trains a drafter"):
        policy_model(ModelConfig(**SIZES), draft="eagle3")
    with pytest.raises(ConfigError, match="model.hf_path=/nonexistent"):  # before anything is built
        compose_config("model=hf", "model.hf_path=/nonexistent")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"needs the transformers package.*pip install 'compiled_loss\[hf\]'"):
        _model()


def _one_step(packing: str, *overrides: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Metrics and gradients of one clipped-PG step of the HF policy on a fixed batch and init."""
    torch._dynamo.reset()
    cfg = compose_config(*SMALL, "loss=clipped_pg", f"packing={packing}", "logprob.top_k=6", *overrides)
    torch.manual_seed(0)
    model = policy_model(cfg.model)
    reference = copy.deepcopy(model)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(1))
    batch = rollout(batch, "policy_gradient", policy=model, reference=reference, sampling=cfg.logprob)
    step = build_train_step(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0))
    result = step(batch)
    if step.recorder is not None:
        assert step.recorder.report.problems() == []  # no graph break, sync or eager fallback
    return result.metrics, {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same_step(a, b) -> None:
    (metrics, grads), (other_metrics, other_grads) = a, b
    assert sorted(other_metrics) == sorted(metrics)
    for key, value in metrics.items():
        assert other_metrics[key] == approx(value, torch.float32, "fused", nan_ok=True), key
    assert sorted(other_grads) == sorted(grads)
    for name, g in grads.items():
        assert g.abs().sum() > 0 or name.endswith("bias"), f"{name} has no gradient"
        torch.testing.assert_close(other_grads[name], g, **close(torch.float32, "accumulated"), msg=name)


def test_packed_and_padded_steps_agree():
    """packing=none (padded rows) and packing=fused (one packed row per micro-batch): the
    same loss, metrics and gradients (eager; the runner's test below traces the model with the
    step)."""
    _assert_same_step(_one_step("none", "compile.enabled=false"), _one_step("fused", "compile.enabled=false"))


def test_the_fused_lm_head_equals_the_logits_path():
    """`logprob.fused_linear=true` reads the final norm's output and `lm_head`: the step's
    metrics and gradients are the logits path's."""
    eager = "compile.enabled=false"
    fused = ("logprob.fused_linear=true", "logprob.chunk_size=7", eager)
    _assert_same_step(_one_step("fused", eager), _one_step("fused", *fused))


def _runner(out, *overrides: str) -> tuple[dict, list[dict]]:
    """`python -m compiled_loss.run <overrides>` into `out`: its summary and metrics lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "compiled_loss.run", *overrides, f"hydra.run.dir={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), steps


# tests/app/test_learning.py's task (a 64-wide LM over 32 tokens, modulus 16) with model=hf
LEARNING = [
    "model=hf",
    *LEARNING_TASK,
    "optim.sft_lr=6e-3",
    "optim.lr=1e-3",
]


@pytest.mark.slow
def test_the_runner_raises_the_reward_of_the_hf_model(tmp_path):
    """`python -m compiled_loss.run model=hf logprob.fused_linear=true`: 20 warm-start steps,
    then 40 of GRPO on its own samples, every loss computed from the final hidden states and
    `lm_head`, the model traced whole with the loss by Dynamo (aot_eager: Inductor's code
    generation alone takes ~2 minutes on 2 cores) — the reward rises beyond the warm start's
    and at most one compile per bucket."""
    overrides = (*LEARNING, "logprob.fused_linear=true", "compile.backend=aot_eager", "run.sft_steps=20")
    summary, steps = _runner(tmp_path, *overrides, "run.steps=60")
    assert [s["phase"] for s in steps] == ["sft"] * 20 + ["clipped_pg"] * 40
    first, final = summary["first_reward"], summary["final_reward"]  # means over the loss's first / last 5 steps
    assert steps[0]["reward"] < 0.1
    assert summary["warm_start_reward"] < first  # the warm start climbed from ~0
    assert final >= first + 0.12 and final >= 0.55, (first, final)
    assert summary["compile_problems"] == []  # the model traced with the loss: no graph break
    assert 1 <= summary["compiles"] <= summary["buckets"]


@pytest.mark.slow
def test_tensor_parallel_steps_equal_the_single_process_ones(tmp_path):
    """Under torchrun with `parallel.tp=2` (each rank's LM head a vocabulary shard; gloo, two
    processes, eager): the warm-start and GRPO steps' losses and gradient norms are the
    single-process run's."""
    run = [*SMALL, "compile.enabled=false", "run.sft_steps=1", "run.steps=2"]
    _, single = _runner(tmp_path / "single", *run)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*torchrun, "-m", "compiled_loss.run", *run, "parallel.tp=2", f"hydra.run.dir={tmp_path / 'tp2'}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = [json.loads(line) for line in (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()]
    assert [s["phase"] for s in sharded] == [s["phase"] for s in single] == ["sft", "clipped_pg"]
    for a, b in zip(single, sharded):
        for key in ("loss", "grad_norm", "reward"):
            assert b[key] == approx(a[key], torch.float32, "parallel"), key


@pytest.mark.slow
def test_without_transformers_the_package_imports_and_model_hf_names_the_extra():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import compiled_loss.app.loop, compiled_loss.demo.hf\n"
        "from compiled_loss.app import compose_config\n"
        "compose_config('model=tiny')\n"
        "compose_config('model=hf')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "compiled_loss.checks.ConfigError: model.architecture=hf needs the transformers package, which does not "
            "import (import of transformers halted; None in sys.modules): pip install 'compiled_loss[hf]'"
        )
    )
