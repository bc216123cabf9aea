"""Speculative sampling with the co-trained drafters (`compiled_loss.app.speculative`): the
tokens follow the policy's distribution exactly (greedy: the plain sampler's tokens; with
temperature / top-k / top-p: a chi-square test on many draws that detects a 1 % shift),
the log-probs are the policy's own, EAGLE-3's inference steps are its training steps, one
compile serves every acceptance count, and the runner reports τ and the speed-up."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch
from tolerances import close

from compiled_loss.app import compose_config
from compiled_loss.app.batches import model_logprobs
from compiled_loss.app.sampler import Sampler, log_probs, sampling_uniforms
from compiled_loss.app.speculative import SpeculativeSampler, speculative_uniforms
from compiled_loss.checks import ConfigError
from compiled_loss.config import build_draft_runtime
from compiled_loss.demo.data import EOS, response_width, sampled_batch, score, task_prompts
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft.common import shift_left

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
    "run.speculative=true",
]
DRAFTS = ["eagle3", "dflash"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def _models(draft: str, *overrides: str, sharpen: float = 1.0, sharpen_draft: float = 1.0):
    """The config, a policy and its (random) drafter; `sharpen` / `sharpen_draft` scale
    their LM heads (at 1 both are near uniform, so most drafts are accepted)."""
    cfg = compose_config(*SMALL, f"draft={draft}", *overrides)
    torch.manual_seed(0)
    policy = TinyLM(cfg.model)
    runtime = build_draft_runtime(cfg.draft, cfg.model, policy)
    with torch.no_grad():
        policy.head.weight.mul_(sharpen)
        head = runtime.drafter.head if draft == "eagle3" else runtime.drafter.lm_head
        head.weight.mul_(sharpen_draft)
    return cfg, policy, runtime


def _prompts(cfg, rows: int):
    prompts = task_prompts(cfg.data, cfg.model.vocab_size, random.Random(0), cfg.data.prompts)
    return prompts.repeat(rows // cfg.data.prompts)


def _patterned(draft: str):
    """A greedy policy that emits token 40, and 41 after every third position, and a drafter
    that always proposes 40: some drafts are accepted, some rejected, all deterministically."""
    cfg, policy, runtime = _models(draft, "logprob.top_k=1", "compile.enabled=false")
    with torch.no_grad():
        policy.embed.weight[:, 0] = 100.0  # a dominant first feature at every position
        policy.pos.weight[:, 1] = 0.0
        policy.pos.weight[1::3, 1] = 100.0  # and a second one every third position
        policy.head.weight.zero_()
        policy.head.weight[40, 0], policy.head.weight[41, 1] = 1.0, 2.0
        drafter = runtime.drafter
        head = drafter.head if draft == "eagle3" else drafter.lm_head
        head.weight.zero_()
        head.weight[40, 0] = 1.0
        if draft == "eagle3":  # the drafter's hidden stream carries the policy's first feature
            drafter.fc.weight.zero_()
            drafter.fc.weight[0, 0] = 1.0
        else:  # every block slot carries a first feature
            drafter.slot_embedding[:, 0] = 100.0
    return cfg, policy, runtime


@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_tokens_are_the_plain_samplers(draft):
    """At top_k=1 the tokens are the plain sampler's, with drafts accepted (40 where the
    policy emits 40) and rejected (where it emits 41)."""
    cfg, policy, runtime = _patterned(draft)
    rows, slots = 12, response_width(cfg.data)
    prompts = _prompts(cfg, rows)
    plain = Sampler(cfg, policy, rows)(prompts, sampling_uniforms(0, 0, rows, slots))
    fast = SpeculativeSampler(cfg, policy, runtime, rows)(prompts, speculative_uniforms(0, 0, rows, slots))
    assert set(plain.tokens.unique().tolist()) == {40, 41}
    assert 1.5 < fast.tau < 3  # both accepted and rejected drafts
    assert torch.equal(fast.tokens, plain.tokens) and torch.equal(fast.lengths, plain.lengths)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, **close(torch.float32, "decode"))


def test_the_wrong_inputs_are_refused():
    cfg, policy, runtime = _models("dflash", "compile.enabled=false")
    sampler = SpeculativeSampler(cfg, policy, runtime, 12)
    with pytest.raises(ValueError) as error:
        sampler(_prompts(cfg, 12), torch.rand(12, response_width(cfg.data)))
    assert (
        str(error.value)
        == "SpeculativeSampler takes 12 prompts of width 6 and uniforms [12, 8, 3], got (12, 6) and [12, 8]"
    )
    with pytest.raises(TypeError) as error:
        SpeculativeSampler(cfg, policy, object(), 12)
    assert str(error.value) == "SpeculativeSampler drafts with an Eagle3Runtime or a DFlashRuntime, not object"


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize(
    "sampling",
    [(), ("logprob.temperature=0.7", "logprob.top_k=20", "logprob.top_p=0.9")],
    ids=["plain", "temperature-topk-topp"],
)
def test_the_logprobs_are_the_policys_own(draft, sampling):
    """Drafts are accepted (τ > 1.15 here: 1.2 to 2.6) and every token's log-prob is what
    the loss computes for it from a full forward of the sampled rows."""
    cfg, policy, runtime = _models(draft, "compile.enabled=false", *sampling)
    rows = 48
    prompts = _prompts(cfg, rows)
    samples = SpeculativeSampler(cfg, policy, runtime, rows)(
        prompts, speculative_uniforms(0, 0, rows, response_width(cfg.data))
    )
    assert samples.tau > 1.15
    rewards = score(prompts, samples.tokens, samples.lengths)
    batch = sampled_batch(prompts, samples.tokens, samples.lengths, samples.logprobs, rewards, rewards)
    mask = batch["token_mask"] > 0
    recomputed = model_logprobs(policy, batch["input_ids"], cfg.logprob)
    torch.testing.assert_close(batch["generation_logprobs"][mask], recomputed[mask], **close(torch.float32, "decode"))
    assert mask.sum() == samples.lengths.sum() > 0


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile `z` (3.09: p = 1e-3), Wilson–Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, categories expected < 5 times pooled."""
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    return float(((counts - expected)[keep] ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def _exact_third_token(cfg, policy, prompt: torch.Tensor) -> torch.Tensor:
    """`[V + 1]`: the policy's probability of each id as the third response token of
    `prompt`, and (last) of the response having ended before it (EOS first or second)."""
    vocab, length = cfg.model.vocab_size, prompt.shape[0]

    def next_probs(rows: torch.Tensor) -> torch.Tensor:
        n, width = rows.shape
        logits = policy(rows, torch.arange(width).expand(n, width), torch.zeros_like(rows))[:, -1]
        return log_probs(logits, **_sampling(cfg)).exp()

    ids = torch.arange(vocab)
    first = next_probs(prompt[None])[0]  # [V]
    second = next_probs(torch.cat([prompt.expand(vocab, length), ids[:, None]], 1))  # [a, b]
    pairs = torch.cartesian_prod(ids, ids)
    third = next_probs(torch.cat([prompt.expand(vocab * vocab, length), pairs], 1)).view(vocab, vocab, vocab)
    joint = first[:, None] * second  # [a, b]
    live = joint * (ids[:, None] != EOS) * (ids[None, :] != EOS)
    out = (live[..., None] * third).sum((0, 1))
    return torch.cat([out, (1 - live.sum())[None]])


def _sampling(cfg) -> dict:
    lp = cfg.logprob
    return {"temperature": lp.temperature, "top_k": lp.top_k, "top_p": lp.top_p}


@pytest.mark.slow
@pytest.mark.parametrize(
    "draft, sampling",
    [("eagle3", ()), ("dflash", ("logprob.temperature=0.7", "logprob.top_k=20", "logprob.top_p=0.9"))],
)
def test_the_tokens_follow_the_policys_distribution(draft, sampling):
    """40,000 draws of the third response token (up to two rounds of drafts and rejections
    behind it) against its exact distribution: the chi-square statistic stays below its
    1e-3 quantile (measured: 89 against 144 with 96 degrees of freedom, EAGLE-3; 54 against
    76 with 42, DFlash), and the same draws reject a reference moved by 1 % of mass (193
    and 108): the test detects a 1 % shift. The draws are seeded: the outcome is fixed."""
    cfg, policy, runtime = _models(
        draft, "compile.enabled=false", "data.prompts=1", *sampling, sharpen=3, sharpen_draft=3
    )
    rows = 40_000
    prompts = _prompts(cfg, rows)
    prompt = prompts.input_ids[0, : prompts.lengths[0]]
    samples = SpeculativeSampler(cfg, policy, runtime, rows)(
        prompts, speculative_uniforms(0, 0, rows, response_width(cfg.data))
    )
    assert 1.05 < samples.tau < 4  # drafts are both accepted and rejected
    with torch.no_grad():
        exact = _exact_third_token(cfg, policy, prompt)
    third = torch.where(samples.lengths > 2, samples.tokens[:, 2], cfg.model.vocab_size)
    counts = torch.bincount(third, minlength=exact.shape[0]).double()
    stat, df = _chi2(counts, exact.double() * rows)
    assert stat < _chi2_critical(df), (stat, df)
    top, second = exact.topk(2).indices.tolist()  # a reference 1 % of mass away (total variation 0.01)
    shifted = exact.double().clone()
    shifted[top] -= 0.01
    shifted[second] += 0.01
    stat_shifted, df_shifted = _chi2(counts, shifted * rows)
    assert stat_shifted > _chi2_critical(df_shifted), (stat_shifted, df_shifted)


def test_eagle3_inference_steps_are_its_training_steps():
    """`context` (step 0 over a cache) and `chain` (steps k >= 1) give the outputs of the
    training forward's teacher-forced steps at every slot."""
    cfg, policy, runtime = _models("eagle3", "compile.enabled=false")
    drafter = runtime.drafter
    rows, length, steps = 3, 9, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (rows, length), generator=g)
    aux = torch.randn(rows, length, drafter.aux_hidden_size, generator=g)
    positions = torch.arange(length).expand(rows, length)
    with torch.no_grad():
        want = drafter(ids, aux, torch.zeros_like(ids), positions, steps)
        heads = drafter.num_heads
        cache = torch.zeros(2, rows, heads, length + 2, drafter.hidden_size // heads)
        out, cache = drafter.context(shift_left(ids, 1, 0), aux, positions, cache)
        torch.testing.assert_close(out, want[0], **close(torch.float32, "forward"))
        for t in range(length - steps):
            previous, chain, slot = out[:, t], [], torch.full((rows,), t)
            for k in range(1, steps):
                previous, chain = drafter.chain(ids[:, t + k + 1], previous, slot, k, cache, chain)
                torch.testing.assert_close(previous, want[k][:, t], **close(torch.float32, "forward"))


@pytest.mark.parametrize("draft", DRAFTS)
def test_compiled_rounds_compile_once_and_draw_what_eager_draws(draft):
    eager = _models(draft, "compile.enabled=false", sharpen_draft=2)
    compiled = _models(draft, "compile.backend=aot_eager", sharpen_draft=2)
    rows, slots = 12, response_width(eager[0].data)
    prompts = _prompts(eager[0], rows)
    sampler = SpeculativeSampler(*compiled, rows)
    for step in range(3):
        uniforms = speculative_uniforms(0, step, rows, slots)
        want = SpeculativeSampler(*eager, rows)(prompts, uniforms)
        got = sampler(prompts, uniforms)
        assert torch.equal(got.tokens, want.tokens) and (got.tokens_per_round, got.row_rounds) == (
            want.tokens_per_round,
            want.row_rounds,
        )
        torch.testing.assert_close(got.logprobs, want.logprobs)
    assert sampler.recorder.report.problems() == []
    assert sampler.compiles == 2  # prefill and first token, one round


def test_a_replicas_rows_draw_what_the_whole_batch_draws():
    cfg, policy, runtime = _models("eagle3", "compile.enabled=false", sharpen_draft=2)
    rows = 12
    prompts = _prompts(cfg, rows)
    uniforms = speculative_uniforms(0, 0, rows, response_width(cfg.data))
    whole = SpeculativeSampler(cfg, policy, runtime, rows)(prompts, uniforms)
    part = SpeculativeSampler(cfg, policy, runtime, 6)(prompts.rows(slice(6, None)), uniforms[6:])
    assert torch.equal(part.tokens, whole.tokens[6:]) and torch.equal(part.lengths, whole.lengths[6:])


def test_a_diverged_policy_is_refused_naming_the_step():
    cfg, policy, runtime = _models("dflash", "compile.enabled=false")
    with torch.no_grad():
        policy.head.weight.fill_(float("nan"))
    rows = 12
    with pytest.raises(FloatingPointError, match=r"^Sampler \(step 7\): the policy's logits for row 0 at response"):
        SpeculativeSampler(cfg, policy, runtime, rows)(
            _prompts(cfg, rows), speculative_uniforms(0, 7, rows, response_width(cfg.data)), step=7
        )


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        compose_config(*SMALL, *overrides)
    return str(error.value)


def test_what_speculation_needs_is_checked_up_front():
    assert _error("draft=none") == (
        "run.speculative=true drafts with the co-trained drafter: choose draft=eagle3 or draft=dflash"
    )
    assert _error("draft=dflash", "run.speculative_tokens=5") == (
        "run.speculative_tokens=5 exceeds draft.block_size - 1 = 4, the tokens one DFlash block proposes"
    )
    assert _error("draft=eagle3", "model.max_positions=18", "data.response_max=1", "packing.pad_to_multiple=2") == (
        "run.speculative=true needs 19 positions (prompt and response buckets, run.speculative_tokens=4 and 1), "
        "model.max_positions is 18"
    )
    assert _error("draft=eagle3", "run.speculative_tokens=8") == (
        "run.speculative_tokens=8 exceeds 7: a round drafts the tokens after the response's first, and the response "
        "bucket holds 8 (data.total_terms - data.prompt_terms_min + 1)"
    )
    assert _error("draft=eagle3", "run.speculative_tokens=0") == "run.speculative_tokens must be >= 1, got 0"


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS)
def test_a_speculative_run_reports_tau_and_the_speedup(draft, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "compiled_loss.run",
            *SMALL,
            f"draft={draft}",
            "compile.backend=eager",
            "run.steps=3",
            "run.sft_steps=1",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= r["speculative_tau"] <= 5 and r["speculative_speedup"] > 0 for r in records)
    lines = [line for line in done.stdout.splitlines() if "step 3/3" in line]
    assert len(lines) == 1 and " speculative_tau " in lines[0] and " speculative_speedup " in lines[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_speculative_tau"] == records[-1]["speculative_tau"]
    assert (tmp_path / "curves.png").exists()
