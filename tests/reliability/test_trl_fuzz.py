"""Property test of the TRL trainer swap (`compiled_loss.integrations.trl.GRPOTrainer`)
against TRL's own `GRPOTrainer.compute_loss` on the same trainer and inputs: random
configurations (every loss type the swap computes, β zero or not, ε_high, the temperature,
the KL's bias correction, `max_completion_length`, gradient accumulation with a short last
window), architectures whose head transforms the logits (Llama, Granite's scale, Cohere's
scale, Gemma 2's softcap), fp32 and bf16 mixed precision (`GRPOConfig.bf16`: fp32 weights
under autocast), and sequences of micro-batches through ONE trainer whose completion widths
cross shape buckets: random prompt widths with left padding, completion masks with holes
and fully masked rows, a tool mask, with or without the old policy's log-probs.

Every call compares the loss, the gradient of every parameter, and the metrics the swap
logs (`kl`, `clip_ratio/region_mean`, as TRL logs them; at completion width 1 TRL's ignore
the mask, see `test_one_token_completions_log_masked_metrics`) within the tolerance of its dtype:
rtol 1e-5 in fp32; under bf16 autocast within 2 % of each tensor's largest entry. The old
policy's log-probs are TRL's own log-probs of the inputs shifted by log-ratios away from the
clip boundaries, so that rounding does not flip which tokens clip.

Fast tier: the loss uncompiled, a few derandomized examples. Slow tier: a larger budget,
and the loss compiled (aot_eager), one compile per distinct bucket.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reliability.oracle import hyp
from tolerances import close

trl = pytest.importorskip("trl", reason="the [hf] extra")
datasets = pytest.importorskip("datasets", reason="the [hf] extra")

from integrations.test_trl import ARCHITECTURES, CHARS, _distinct_characters, _tiny_model  # noqa: E402

TOLERANCE = {  # relative, and absolute in units of the compared values' scale
    "fp32": close(torch.float32, "reordered")["rtol"],
    "bf16": close(torch.bfloat16, "reordered")["rtol"],
}
"""rtol, and atol as a fraction of each compared tensor's largest entry (at least 1)."""

LOG_RATIOS = torch.tensor([0.0, 0.05, -0.05, 0.5, -0.5])
"""`lp - old` per token: inside the clip range (0.2 / 0.28) or well outside it."""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
VOCAB = len(CHARS) + 2
METRICS = ("kl", "clip_ratio/region_mean")


@dataclasses.dataclass(frozen=True)
class Call:
    rows: int
    prompt: int  # prompt width (left-padded)
    width: int  # completion width
    seed: int
    old: bool  # the old policy's log-probs given (else TRL takes the policy's own, detached)
    tool_mask: bool
    accumulation: int  # current_gradient_accumulation_steps (≤ the configured steps: a short last window)


@dataclasses.dataclass(frozen=True)
class Case:
    architecture: str
    dtype: str
    config: tuple[tuple[str, Any], ...]  # GRPOConfig fields beyond the fixed ones
    calls: tuple[Call, ...]


@st.composite
def cases(draw, loss_type: str, dtype: str, crossing: bool = False) -> Case:
    """A random case: 1-3 micro-batches of random widths; `crossing`: 2-3 in distinct buckets
    of the default grid (multiples of 16), then one more in the first one's bucket."""
    accumulation = draw(st.sampled_from([1, 2]))
    config = dict(
        loss_type=loss_type,
        beta=draw(st.sampled_from([0.0, 0.04, 0.3])),
        epsilon_high=draw(st.sampled_from([0.2, 0.28])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        use_bias_correction_kl=draw(st.booleans()),
        max_completion_length=48 if crossing else draw(st.sampled_from([16, 40])),
        gradient_accumulation_steps=accumulation,
    )
    count = draw(st.integers(2, 3)) if crossing else draw(st.integers(1, 3))
    calls = []
    for k in [*range(count), 0] if crossing else range(count):
        width = draw(st.integers(1, 16)) + 16 * k if crossing else draw(st.integers(1, config["max_completion_length"]))
        calls.append(
            Call(
                rows=draw(st.integers(1, 4)),
                prompt=draw(st.integers(1, 6)),
                width=width,
                seed=draw(st.integers(0, 2**16)),
                old=draw(st.booleans()),
                tool_mask=draw(st.booleans()),
                accumulation=draw(st.integers(1, accumulation)),
            )
        )
    return Case(draw(st.sampled_from(sorted(ARCHITECTURES))), dtype, tuple(sorted(config.items())), tuple(calls))


@functools.cache
def _model_dir(architecture: str, root: str) -> str:
    """A tiny model of `architecture` saved once per test session (TRL loads it, and its reference, by path)."""
    path = f"{root}/{architecture}"
    _tiny_model(path, architecture)
    return path


def _trainer(case: Case, root: str, compiled: Any):
    from compiled_loss.integrations.trl import GRPOTrainer

    path = _model_dir(case.architecture, root)
    args = trl.GRPOConfig(
        output_dir=f"{root}/out",
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        report_to=[],
        bf16=case.dtype == "bf16",
        **dict(case.config),
    )
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=_distinct_characters,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["ab"] * 4}),
        processing_class=transformers_tokenizer(path),
        compiled=compiled,
    )
    # as trainer.train() prepares it: the forward under the mixed-precision autocast, its outputs in fp32
    trainer.model = trainer.accelerator.prepare_model(trainer.model)
    trainer.model.train()
    return trainer


@functools.cache
def transformers_tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def _inputs(trainer, call: Call) -> dict[str, torch.Tensor]:
    """A micro-batch as TRL's generation step leaves it."""
    g = torch.Generator().manual_seed(call.seed)
    rows = call.rows
    prompt_mask = (torch.arange(call.prompt) >= torch.randint(0, call.prompt, (rows, 1), generator=g)).long()
    prompt_ids = torch.randint(2, VOCAB, (rows, call.prompt), generator=g) * prompt_mask
    completion_ids = torch.randint(1, VOCAB, (rows, call.width), generator=g)
    keep = torch.rand(rows, call.width, generator=g) >= float(
        torch.tensor([0.0, 0.3])[torch.randint(0, 2, (), generator=g)]
    )
    keep &= torch.rand(rows, 1, generator=g) >= 0.25  # fully masked rows
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=keep.long(),
        advantages=torch.randn(rows, generator=g),
    )
    if call.tool_mask:
        inputs["tool_mask"] = (torch.rand(rows, call.width, generator=g) >= 0.2).long()
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    with torch.no_grad():
        mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, call.width)[0]
    if call.old:
        inputs["old_per_token_logps"] = lp - LOG_RATIOS[torch.randint(0, len(LOG_RATIOS), lp.shape, generator=g)]
    if trainer.beta != 0.0:
        inputs["ref_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    kept = inputs["completion_mask"] * inputs.get("tool_mask", 1)
    inputs["num_items_in_batch"] = kept.sum() + torch.randint(0, 5, (), generator=g)  # spans the generation batch
    return inputs


def _evaluate(trainer, compute_loss, inputs):
    """`(loss, gradients of every parameter, the metrics this call logged)`."""
    logged = trainer._metrics["train"]
    before = {k: len(logged[k]) for k in METRICS}
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = compute_loss(trainer, trainer.model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    metrics = {k: logged[k][before[k] :] for k in METRICS}
    return loss.detach(), grads, metrics


def _assert_close(case: Case, width: int, ours, theirs, where: str) -> None:
    tol = TOLERANCE[case.dtype]
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = ours, theirs
    beta = dict(case.config)["beta"]
    for k in METRICS:
        assert len(metrics_a[k]) == len(metrics_b[k]) == (0 if k == "kl" and beta == 0 else 1), (where, k)
        if width == 1:  # TRL's metrics ignore the mask there (test_one_token_completions_log_masked_metrics)
            continue
        torch.testing.assert_close(
            torch.tensor(metrics_a[k]),
            torch.tensor(metrics_b[k]),
            rtol=tol,
            atol=tol,
            msg=lambda m: f"{where} {k}: {m}",
        )
    for i, (a, b) in enumerate(zip([loss_a, *grads_a], [loss_b, *grads_b])):
        a, b = a.float(), b.float()
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=lambda m: f"{where} #{i}: {m}")


def check(case: Case, root: str, compiled: Any = False):
    """Every call of `case` through ONE swapped trainer against TRL's compute_loss; returns the trainer."""
    trainer = _trainer(case, root, compiled)
    for k, call in enumerate(case.calls):
        trainer.current_gradient_accumulation_steps = call.accumulation
        inputs = _inputs(trainer, call)
        theirs = _evaluate(trainer, trl.GRPOTrainer.compute_loss, inputs)
        ours = _evaluate(trainer, type(trainer).compute_loss, inputs)
        _assert_close(case, call.width, ours, theirs, f"{case.architecture} {dict(case.config)} call {k} ({call})")
    return trainer


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trl_fuzz"))


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@given(data=st.data())
@hyp(max_examples=2)
def test_trl_swap_matches_trl(root, loss_type, dtype, data):
    check(data.draw(cases(loss_type, dtype)), root)


@pytest.mark.slow  # a larger budget of the same
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@given(data=st.data())
@hyp(max_examples=12)
def test_trl_swap_matches_trl_at_length(root, loss_type, dtype, data):
    check(data.draw(cases(loss_type, dtype)), root)


class _CountingAotEager:
    def __init__(self) -> None:
        self.graphs, self.backend = 0, torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


@pytest.mark.slow  # aot_eager: one compile per bucket of each example
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@given(data=st.data())
@hyp(max_examples=1)
def test_compiled_trl_swap_matches_trl(root, loss_type, dtype, data):
    """The same property with the loss compiled, 2 or 3 micro-batches in distinct buckets and
    one more in the first one's: one compile per distinct bucket (the repeated one reuses its graph)."""
    backend = _CountingAotEager()
    case = data.draw(cases(loss_type, dtype, crossing=True))
    trainer = check(case, root, compiled=backend)
    assert backend.graphs == len(trainer.liger_loss._objective.buckets) == len(case.calls) - 1


def test_one_token_completions_log_masked_metrics(root):
    """A deviation from TRL 1.16: TRL's metric mean takes a `[B, 1]` tensor for one value per
    sequence (sequence-level importance sampling) and sums it unmasked, so a batch of
    one-token completions logs the KL of masked tokens. The swap logs the masked mean at
    every width: 0 here, where the only token is masked; the loss (0) and gradients agree."""
    config = dict(loss_type="bnpo", beta=0.04, max_completion_length=16, gradient_accumulation_steps=1)
    case = Case("llama", "fp32", tuple(sorted(config.items())), ())
    trainer = _trainer(case, root, False)
    trainer.current_gradient_accumulation_steps = 1
    call = Call(rows=1, prompt=2, width=1, seed=3, old=False, tool_mask=False, accumulation=1)
    inputs = _inputs(trainer, call) | {"completion_mask": torch.zeros(1, 1, dtype=torch.long)}
    theirs = _evaluate(trainer, trl.GRPOTrainer.compute_loss, inputs)
    ours = _evaluate(trainer, type(trainer).compute_loss, inputs)
    assert float(theirs[0]) == float(ours[0]) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in ours[1] + theirs[1])
    assert ours[2] == {"kl": [0.0], "clip_ratio/region_mean": [0.0]}
    assert theirs[2]["kl"][0] > 0.01  # the masked token's KL, unmasked
