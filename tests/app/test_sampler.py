"""The compiled sampler: its log-probs are the policy's (the loss's log-probs of the same
tokens, fp32, under temperature and top-k / top-p), it draws by inverse CDF from the
filtered distribution, rows end at EOS, a replica's rows draw what the whole batch draws,
and the compiled sampler holds to one graph per function over many batches."""

from __future__ import annotations

import random

import pytest
import torch
from tolerances import close

from compiled_loss.app import compose_config
from compiled_loss.app.batches import model_logprobs
from compiled_loss.app.sampler import Sampler, _pick, sampling_uniforms
from compiled_loss.demo.data import EOS, PAD, response_width, sampled_batch, score, task_prompts
from compiled_loss.demo.model import TinyLM

SMALL = [
    "model.vocab_size=96",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.max_positions=64",
    "data.prompts=3",
    "data.group_size=4",
    "data.modulus=16",
    "data.prompt_terms_max=5",
    "data.total_terms=10",
    "data.response_max=12",
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def _sampled(*overrides: str, steps: int = 1):
    cfg = compose_config(*SMALL, *overrides)
    torch.manual_seed(0)
    model = TinyLM(cfg.model)
    rows = cfg.data.prompts * cfg.data.group_size
    sampler = Sampler(cfg, model, rows)
    rng = random.Random(0)
    for step in range(steps):
        prompts = task_prompts(cfg.data, cfg.model.vocab_size, rng, cfg.data.prompts).repeat(cfg.data.group_size)
        samples = sampler(prompts, sampling_uniforms(0, step, rows, response_width(cfg.data)))
    return cfg, model, sampler, prompts, samples


@pytest.mark.parametrize(
    "sampling",
    [(), ("logprob.temperature=0.7", "logprob.top_k=20", "logprob.top_p=0.9")],
    ids=["plain", "temperature-topk-topp"],
)
@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_the_samplers_logprobs_are_the_policys(sampling, backend):
    compile_ = ["compile.enabled=false"] if backend == "eager" else [f"compile.backend={backend}"]
    cfg, model, _, prompts, samples = _sampled(*compile_, *sampling)
    rewards = score(prompts, samples.tokens, samples.lengths)
    batch = sampled_batch(prompts, samples.tokens, samples.lengths, samples.logprobs, rewards, rewards)
    mask = batch["token_mask"] > 0
    recomputed = model_logprobs(model, batch["input_ids"], cfg.logprob)  # as the loss computes them
    torch.testing.assert_close(batch["generation_logprobs"][mask], recomputed[mask], **close(torch.float32, "decode"))
    assert torch.isfinite(recomputed[mask]).all()  # every drawn token is inside the filter
    assert mask.sum() == samples.lengths.sum() > 0


def test_compiled_sampler_compiles_once_per_function_over_many_batches():
    _, _, sampler, _, _ = _sampled("compile.backend=aot_eager", steps=4)
    assert sampler.recorder.report.problems() == []
    assert sampler.compiles == 2  # prefill + first token, decode step


def test_inverse_cdf_draw_and_filter():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    probs = torch.softmax(logits[0], -1)
    cdf = probs.cumsum(0)
    uniforms = torch.tensor([0.0, float(cdf[1]) + 1e-4, 0.99999])
    alive = torch.ones(3, dtype=torch.bool)
    tokens, logprobs, still = _pick(logits, uniforms, temperature=1.0, top_k=None, top_p=1.0, alive=alive)
    assert tokens.tolist() == [0, 2, 3]
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    tokens, logprobs, _ = _pick(logits, uniforms, temperature=1.0, top_k=2, top_p=1.0, alive=alive)
    assert tokens.tolist() == [2, 2, 3]  # only the two largest can be drawn, renormalised
    torch.testing.assert_close(logprobs, torch.log_softmax(logits[0, 2:], -1)[tokens - 2])
    dead = torch.tensor([True, False, True])
    tokens, logprobs, _ = _pick(logits, uniforms, temperature=1.0, top_k=None, top_p=1.0, alive=dead)
    assert tokens[1] == PAD and logprobs[1] == 0


def test_rows_end_at_eos():
    _, _, _, _, samples = _sampled("compile.enabled=false", "data.prompts=8")
    for tokens, logprobs, length in zip(samples.tokens, samples.logprobs, samples.lengths):
        ended = (tokens == EOS).nonzero()
        assert length == (ended[0, 0] + 1 if len(ended) else len(tokens))
        assert (tokens[length:] == PAD).all() and (logprobs[length:] == 0).all() and (logprobs[:length] < 0).all()


def test_a_replicas_rows_draw_what_the_whole_batch_draws():
    """Uniforms are indexed by the row's place in the global batch (data-parallel replicas)."""
    cfg, model, sampler, prompts, samples = _sampled("compile.enabled=false")
    uniforms = sampling_uniforms(0, 0, sampler.rows, response_width(cfg.data))
    half = sampler.rows // 2
    part = Sampler(cfg, model, half)(prompts.rows(slice(half, None)), uniforms[half:])
    assert torch.equal(part.tokens, samples.tokens[half:]) and torch.equal(part.lengths, samples.lengths[half:])
    torch.testing.assert_close(part.logprobs, samples.logprobs[half:])


def test_the_wrong_prompt_shape_is_refused():
    cfg, _, sampler, prompts, _ = _sampled("compile.enabled=false")
    with pytest.raises(ValueError, match=r"Sampler takes 12 prompts of width 6, got \(6, 6\)"):
        sampler(prompts.rows(slice(0, 6)), torch.rand(6, response_width(cfg.data)))


def test_non_finite_rows_draw_inside_the_vocabulary_with_a_nan_logprob():
    """searchsorted over a NaN cdf answers V (one past the vocabulary): the draw stays inside it."""
    logits = torch.tensor(
        [[0.0, 1.0, 2.0, 3.0], [float("nan")] * 4, [float("inf"), 1.0, 2.0, 3.0], [float("-inf")] * 4]
    )
    for top_k in (None, 2):
        tokens, logprobs, _ = _pick(
            logits,
            torch.full((4,), 0.2),
            temperature=1.0,
            top_k=top_k,
            top_p=1.0,
            alive=torch.ones(4, dtype=torch.bool),
        )
        assert tokens.tolist() == [2, 3, 3, 3]
        assert logprobs[0].isfinite() and logprobs[1:].isnan().all()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_diverged_policy_is_refused_naming_the_step(backend):
    compile_ = ["compile.enabled=false"] if backend == "eager" else [f"compile.backend={backend}"]
    cfg = compose_config(*SMALL, *compile_)
    model = TinyLM(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    rows = cfg.data.prompts * cfg.data.group_size
    prompts = task_prompts(cfg.data, cfg.model.vocab_size, random.Random(0), cfg.data.prompts).repeat(
        cfg.data.group_size
    )
    with pytest.raises(FloatingPointError) as error:
        Sampler(cfg, model, rows)(prompts, sampling_uniforms(0, 7, rows, response_width(cfg.data)), step=7)
    assert str(error.value) == (
        "Sampler (step 7): the policy's logits for row 0 at response slot 0 are not finite "
        "(NaN or inf): the policy has diverged, there is no distribution to sample from"
    )
