"""TRL's GRPOTrainer with compiled_loss swapped in (`compiled_loss.integrations.trl`), end to
end on CPU: a tiny Llama built locally (no download), fp32, a reference model (β ≠ 0).

On the first micro-batch the swapped trainer computes TRL's own loss (`trl.GRPOTrainer.
compute_loss`) on the same inputs as well: the loss and every parameter's gradient agree
within fp32 rounding (rtol 1e-5). Then it trains a few steps, logging TRL's metrics."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl", reason="the [hf] extra")
transformers = pytest.importorskip("transformers", reason="the [hf] extra")
datasets = pytest.importorskip("datasets", reason="the [hf] extra")

pytestmark = pytest.mark.slow

CHARS = "abcdefghij "


def _tiny_model(path):
    """A 2-layer Llama and a character-level tokenizer, saved to `path` (TRL loads the
    reference model from it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
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
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def _distinct_characters(completions, **_):
    return [float(len(set(c))) for c in completions]


def test_grpo_trainer_swap_gives_trls_loss_and_gradients(tmp_path):
    from compiled_loss.integrations.trl import GRPOTrainer

    tokenizer = _tiny_model(tmp_path / "model")
    checks = []

    class Checked(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs)
            if not checks:
                params = [p for p in model.parameters() if p.requires_grad]
                theirs = trl.GRPOTrainer.compute_loss(self, model, inputs)
                grads = torch.autograd.grad(loss, params, retain_graph=True)
                their_grads = torch.autograd.grad(theirs, params)
                checks.append((loss.detach(), theirs.detach(), grads, their_grads))
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

    ours, theirs, grads, their_grads = checks[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in their_grads)
    for g, their_g in zip(grads, their_grads):
        torch.testing.assert_close(g, their_g, rtol=1e-5, atol=1e-6)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert all("kl" in h and "clip_ratio/region_mean" in h for h in logged)


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
