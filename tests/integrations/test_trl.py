"""TRL's GRPOTrainer with compiled_loss swapped in (`compiled_loss.integrations.trl`), end to
end on CPU: a tiny model built locally (no download) — a Llama, and the architectures whose
logits transform the head's output (Granite's `logits_scaling`, Cohere's `logit_scale`,
Gemma 2's `final_logit_softcapping`) — fp32, a reference model (β ≠ 0).

On the first micro-batch the swapped trainer computes TRL's own loss (`trl.GRPOTrainer.
compute_loss`, the model's own logits) on the same inputs as well: the loss and every
parameter's gradient agree within fp32 rounding (rtol 1e-5), and the KL logged at step 1,
when the policy is the reference, is 0. Then it trains a few steps, logging TRL's metrics."""

from __future__ import annotations

import pytest
import torch
from tolerances import close

trl = pytest.importorskip("trl", reason="the [hf] extra")
transformers = pytest.importorskip("transformers", reason="the [hf] extra")
datasets = pytest.importorskip("datasets", reason="the [hf] extra")

pytestmark = pytest.mark.slow

CHARS = "abcdefghij "


ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, {}),
    "granite": (transformers.GraniteConfig, {"logits_scaling": 8.0}),
    "cohere": (transformers.CohereConfig, {"logit_scale": 4.0}),
    "gemma2": (
        transformers.Gemma2Config,
        {"final_logit_softcapping": 0.5, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4},
    ),
}
"""name → (config class, what the tiny model's config sets beyond `_tiny_model`'s): each
transform at a value that changes the logits well beyond rounding."""


def _tiny_model(path, architecture="llama", **extra):
    """A 2-layer model of `architecture` (`ARCHITECTURES`; `extra` config attributes) and a
    character-level tokenizer, saved to `path` (TRL loads the reference model from it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    config_class, transform = ARCHITECTURES[architecture]
    config = config_class(
        **transform,
        **extra,
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def _distinct_characters(completions, **_):
    return [float(len(set(c))) for c in completions]


def _head_changes_logits(model, inputs):
    """The model's logits differ from `lm_head(hidden)` (its transform matters) by more than 1%."""
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        output = model(input_ids=ids, output_hidden_states=True)
        raw = model.get_output_embeddings()(output.hidden_states[-1])
    return bool((output.logits - raw).abs().max() > 0.01 * raw.abs().max())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_grpo_trainer_swap_gives_trls_loss_and_gradients(tmp_path, architecture):
    """Also with the head's transform (Granite's scale 1/8: the gradients were 8× TRL's, and the
    KL at step 1 not 0)."""
    from compiled_loss.integrations.trl import GRPOTrainer

    tokenizer = _tiny_model(tmp_path / "model", architecture)
    checks = []

    class Checked(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs)
            if not checks:
                params = [p for p in model.parameters() if p.requires_grad]
                theirs = trl.GRPOTrainer.compute_loss(self, model, inputs)
                grads = torch.autograd.grad(loss, params, retain_graph=True)
                their_grads = torch.autograd.grad(theirs, params)
                checks.append((loss.detach(), theirs.detach(), grads, their_grads, _head_changes_logits(model, inputs)))
            return loss

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.05,
        loss_type="dapo",
        beta=0.04,
        temperature=0.9,
        bf16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4})
    trainer = Checked(
        model=str(tmp_path / "model"),
        reward_funcs=_distinct_characters,
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.train()

    ours, theirs, grads, their_grads, transformed = checks[0]
    assert transformed == (architecture != "llama")
    torch.testing.assert_close(ours, theirs, **close(torch.float32, "reordered"))
    assert any(g.abs().max() > 0 for g in their_grads)
    for g, their_g in zip(grads, their_grads):
        torch.testing.assert_close(g, their_g, **close(torch.float32, "reordered"))
    norms = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])) for gs in checks[0][2:4]]
    print(f"{architecture}: grad norm {float(norms[0]):.4g} (TRL's {float(norms[1]):.4g})")
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert all("kl" in h and "clip_ratio/region_mean" in h for h in logged)
    assert abs(logged[0]["kl"]) < close(torch.float32, "reordered")["atol"]  # step 1: the policy is the reference


def test_a_head_transform_that_cannot_be_described_is_refused_naming_the_model_type(tmp_path):
    """A Llama whose config sets a transform-like attribute no rule describes for its type."""
    from compiled_loss.integrations.trl import GRPOTrainer

    tokenizer = _tiny_model(tmp_path / "model", logits_scaling=2.0)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, use_cpu=True, report_to=[]
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["ab"] * 4})
    with pytest.raises(ValueError, match=r"^compiled_loss GRPOTrainer: model_type='llama': .*logits_scaling=2\.0"):
        GRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=_distinct_characters,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
        )


def test_unsupported_configuration_is_refused_naming_the_field(tmp_path):
    from compiled_loss.integrations.trl import GRPOTrainer

    tokenizer = _tiny_model(tmp_path / "model")
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        loss_type="cispo",
        use_cpu=True,
        report_to=[],
        bf16=False,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["ab"] * 4})
    with pytest.raises(ValueError, match=r"GRPOConfig.loss_type='cispo' is not supported"):
        GRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=_distinct_characters,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
        )


def _trainer(tmp_path, **config):
    from compiled_loss.integrations.trl import GRPOTrainer

    tokenizer = _tiny_model(tmp_path / "model")
    args = trl.GRPOConfig(
        **{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4}
        | {"use_cpu": True, "report_to": [], "bf16": False, "beta": 0.0}
        | config
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["ab"] * 4})
    return GRPOTrainer(
        model=str(tmp_path / "model"),
        reward_funcs=_distinct_characters,
        args=args,
        train_dataset=prompts,
        eval_dataset=None if args.eval_strategy == "no" else prompts,
        processing_class=tokenizer,
        compiled="eager",
    )


def test_the_loss_compiles_every_completion_bucket_of_max_completion_length(tmp_path):
    """max_completion_length=256: 12 token buckets (16, 32, …, 128, 160, …, 256), each compiled
    once by the trainer's loss (Dynamo's default limit of 8 stopped the run at the ninth)."""
    from compiled_loss.integrations.trl import bucket_bound

    trainer = _trainer(tmp_path, max_completion_length=256)
    assert bucket_bound(trainer.args) == trainer.liger_loss._objective.max_buckets == 12
    g = torch.Generator().manual_seed(0)
    weight = trainer.model.get_output_embeddings().weight.detach()
    widths = (1, 17, 40, 60, 70, 90, 100, 120, 130, 170, 200, 256)
    for width in widths:
        hidden = torch.randn(4, width, weight.shape[1], generator=g, requires_grad=True)
        ids = torch.randint(0, weight.shape[0], (4, width), generator=g)
        loss, _ = trainer.liger_loss(hidden, weight, ids, torch.ones(4, width), torch.randn(4, generator=g))
        loss.backward()
        assert torch.isfinite(hidden.grad).all()
    assert len(trainer.liger_loss._objective.buckets) == len(widths)


def test_more_buckets_than_the_cap_are_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^compiled_loss GRPOTrainer: GRPOConfig.max_completion_length=1073741824 gives 300 shape buckets of "
        r"the fused loss, more than MAX_BUCKETS=256 compiles$",
    ):
        _trainer(tmp_path, max_completion_length=2**30, eval_strategy="steps", eval_steps=1)


_RANK = """
import sys, torch, torch.distributed as dist
from compiled_loss.integrations.trl import token_weighted_mean
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
def reduce(t):
    dist.all_reduce(t)
    return t
# rank 0: 3 tokens with metric 1; rank 1: 1 token with metric 0
value, tokens = (torch.tensor(1.0), torch.tensor(3)) if rank == 0 else (torch.tensor(0.0), torch.tensor(1))
print(token_weighted_mean(value, tokens, reduce))
dist.destroy_process_group()
"""


def test_metrics_are_token_weighted_across_processes(tmp_path):
    """TRL's global_masked_mean: (3·1 + 1·0) / 4 = 0.75 on every rank (a mean of per-rank means
    is 0.5). Two processes on gloo."""
    import subprocess
    import sys

    command = [sys.executable, "-c", _RANK]
    ranks = [subprocess.Popen([*command, str(r), str(tmp_path / "init")], stdout=subprocess.PIPE) for r in (0, 1)]
    outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert [float(out) for out in outputs] == [0.75, 0.75]
