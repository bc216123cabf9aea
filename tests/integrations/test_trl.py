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
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in their_grads)
    for g, their_g in zip(grads, their_grads):
        torch.testing.assert_close(g, their_g, rtol=1e-5, atol=1e-6)
    norms = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])) for gs in checks[0][2:4]]
    print(f"{architecture}: grad norm {float(norms[0]):.4g} (TRL's {float(norms[1]):.4g})")
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert all("kl" in h and "clip_ratio/region_mean" in h for h in logged)
    assert abs(logged[0]["kl"]) < 1e-6  # step 1: the policy is the reference


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
