"""A Hugging Face `transformers` causal LM behind the embedded model's interface (`model=hf`).

`HFCausalLM` wraps an `AutoModelForCausalLM` — built from the run's model sizes (random
init, no download) or loaded from a local `from_pretrained` directory (`model.hf_path`) —
with `TinyLM`'s contract, so the compiled training step and the sampler run it unchanged:

- `forward(input_ids, position_ids, segment_ids)`: the base model runs under a 4D boolean
  attention mask, causal within each segment (a packed `[1, T]` row's sequences never attend
  across), with the caller's position ids (restarting at 0 in each packed sequence); the
  logits are the final norm's output times `lm_head` (`linear_logits=True`: the two kept
  apart as `LinearLogits`). Attention is PyTorch's SDPA (`attn_implementation="sdpa"`),
  which reads the boolean mask as given; `transformers` returns a 4D mask as it is, so the
  forward traces into one graph under `torch.compile(fullgraph=True)`.
- `prefill` / `decode`: generation over the sampler's static key/value cache, a tensor
  `[layers, 2, R, kv_heads, cache_len, head_dim]` that the sampler passes back unread.
  Each call hands the model a `DynamicCache` of the slots so far; `decode` appends its
  token's key and value, masks the slots at and past each row's position, and writes the
  new key and value to that slot of the returned cache.

Only what this interface covers is supported: full attention (a configuration with other
layer types, or a sliding window shorter than `model.max_positions`, is refused), no value
head (`loss=mse_value`) and no co-trained drafter, which read parts of the model this
wrapper does not expose.

`transformers` is imported when a model is built, never at import (without it, a
`ConfigError` names `pip install 'compiled_loss[hf]'`, the extra that provides it).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from compiled_loss.checks import ConfigError, require
from compiled_loss.config import ModelConfig
from compiled_loss.demo.model import TinyLM
from compiled_loss.integrations.hf import head_transform
from compiled_loss.vocab import LinearLogits

Tensor = torch.Tensor


def _transformers() -> Any:
    """The `transformers` module, or a ConfigError naming the extra that provides it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ConfigError(
            f"model.architecture=hf needs the transformers package, which does not import ({e}): "
            "pip install 'compiled_loss[hf]'"
        ) from None


SUPPORTED_MODEL_TYPES = tuple(
    """
apertus apertus1p5_text arcee aria_text biogpt bitnet cohere ctrl diffllama doge ernie4_5
ernie4_5_moe exaone flex_olmo gemma glm glm4 glm4_moe gpt-sw3 gpt2 gpt_bigcode
gpt_neox granite granitemoe granitemoeshared helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3
hyperclovax internlm3 iquestcoder jais2 jetmoe laguna lfm2 llama mellum minicpm5_moe
minimax_m2 minimax_m3_vl_text ministral3 mistral mixtral nanochat nemotron olmo olmo2 olmoe opt
param2moe persimmon phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_moe sarvam_moe seed_oss
smollm3 solar_open stablelm starcoder2
""".split()
)
"""The `transformers` model types `model=hf` runs: decoder-only text LMs of full attention whose
logits, prefill and decode are tested equal to the model's own (`model(...).logits`, with its logit
scaling or softcap) in tests/app/test_hf_model.py."""


def _require_supported(model_type: str, where: str) -> None:
    require(
        model_type in SUPPORTED_MODEL_TYPES,
        f"{where} is not a model type model=hf runs (decoder-only text LMs of full attention, keys and values of "
        f"one head width, each tested against transformers' own logits): one of {', '.join(SUPPORTED_MODEL_TYPES)}",
    )


def hf_config(model: ModelConfig) -> Any:
    """The `transformers` config of `model`: the checkpoint's (`model.hf_path`, read with
    `local_files_only`; its vocabulary must be `model.vocab_size`), or one of
    `model.hf_model_type` built from the model's sizes. A configuration with layers other
    than full attention, or a sliding window shorter than `model.max_positions`, is refused
    (the wrapper's mask is full causal attention)."""
    transformers = _transformers()
    if model.hf_path is not None:
        path = Path(model.hf_path)
        require(
            (path / "config.json").is_file(),
            f"model.hf_path={model.hf_path}: no such directory of a transformers model (config.json missing); "
            "the path is read locally, nothing is downloaded",
        )
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        vocab = config.get_text_config().vocab_size
        require(
            vocab == model.vocab_size,
            f"model.hf_path={model.hf_path} has a vocabulary of {vocab} tokens, model.vocab_size={model.vocab_size}: "
            f"set model.vocab_size={vocab} (the task's token ids, the loss's vocabulary and the checks against "
            "data.modulus read it)",
        )
    else:
        _require_supported(model.hf_model_type, f"model.hf_model_type={model.hf_model_type!r}")
        try:
            config = transformers.AutoConfig.for_model(
                model.hf_model_type,
                vocab_size=model.vocab_size,
                hidden_size=model.hidden_size,
                intermediate_size=model.mlp_ratio * model.hidden_size,
                num_hidden_layers=model.num_layers,
                num_attention_heads=model.num_heads,
                num_key_value_heads=model.num_heads,
                head_dim=model.hidden_size // model.num_heads,
                max_position_embeddings=model.max_positions,
                # the task's PAD, BOS and EOS (a default past a small vocabulary fails the embedding's check)
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        except ValueError as e:
            raise ConfigError(f"model.hf_model_type={model.hf_model_type!r}: {e}") from None
    where = (
        f"model.hf_path={model.hf_path}" if model.hf_path is not None else f"model.hf_model_type={model.hf_model_type}"
    )
    text = config.get_text_config()
    if model.hf_path is not None:
        _require_supported(config.model_type, f"{where} (model_type {config.model_type!r})")
    try:
        head_transform(config)  # its logit scaling / softcap: a number > 0
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    layer_types = getattr(text, "layer_types", None) or []
    require(
        all(t == "full_attention" for t in layer_types),
        f"{where}: layer types {sorted(set(layer_types))}; model.architecture=hf runs full-attention layers only",
    )
    window = getattr(text, "sliding_window", None)
    require(
        bool(layer_types) or window is None or window >= model.max_positions,
        f"{where}: a sliding window of {window} positions, shorter than model.max_positions={model.max_positions}; "
        "model.architecture=hf runs full attention only",
    )
    return config


class HFCausalLM(nn.Module):
    """`forward(input_ids, position_ids, segment_ids) -> logits [R, L, V]` of a `transformers`
    causal LM (see the module docstring); with `linear_logits=True` the logits as
    `LinearLogits` (the final norm's output, `lm_head`'s weight and bias), never formed.

    Tensor parallel (`compiled_loss.train.shard_model` with `tp_plan()`): the logits are a
    DTensor sharded on the vocabulary (`Shard(-1)`), with `linear_logits=True` the head's
    weight and bias are DTensors sharded on their rows (the loss's edge unwraps them), and
    `full_vocab=True` returns the whole logits as a plain tensor. Generation (`prefill`,
    `decode`) always returns full-vocabulary logits.

    Dropout is off in every mode (`train`). Under a meta default device
    (`torch.device("meta")`) the model is built from the checkpoint's config without
    reading its weights (a parameter count)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        transformers = _transformers()
        config = hf_config(cfg)
        dtype = getattr(torch, cfg.dtype)
        auto = transformers.AutoModelForCausalLM
        if cfg.hf_path is not None and torch.get_default_device().type != "meta":
            self.lm = auto.from_pretrained(cfg.hf_path, dtype=dtype, attn_implementation="sdpa", local_files_only=True)
        else:
            self.lm = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.head_transform = head_transform(self.lm.config)  # the model's own logits: scaling, softcap
        self._cache = transformers.DynamicCache  # the generation cache (resolved here: Dynamo traces no import)
        self.train()

    def train(self, mode: bool = True) -> HFCausalLM:
        """Sets the wrapper's mode; the HF model stays in eval mode (no dropout), so the
        training step computes the distribution the sampler draws from."""
        super().train(mode)
        self.lm.eval()
        return self

    def _hidden(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor, cache: Any = None) -> Tensor:
        """The base model's last hidden state (after the final norm) under the boolean `mask`
        `[R, 1, L, keys]` (True: attend); `cache`: a `DynamicCache` its layers extend."""
        out = self.lm.base_model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    def _logits(self, hidden: Tensor, full_vocab: bool = True) -> Tensor:
        """The model's logits from its last hidden state: the whole vocabulary as a plain
        tensor (gathered under tensor parallelism) unless `full_vocab=False`."""
        logits = self.head_transform.dense(self.lm.get_output_embeddings()(hidden))
        return logits.full_tensor() if full_vocab and isinstance(logits, DTensor) else logits

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers FSDP shards (and compiles) one by one."""
        return list(self.lm.base_model.layers)

    def tp_plan(self) -> dict[str, ParallelStyle]:
        """The DTensor tensor-parallel plan (`parallelize_module`) of a Llama-shaped decoder
        (q/k/v/o projections, a gated or plain MLP; transformers' own module names): the
        projections and the MLP column-/row-wise, the token embedding on its vocabulary rows,
        `lm_head`'s output sharded on the vocabulary as a DTensor (`Shard(-1)`). A model
        whose modules are not those is refused, naming its type."""
        base = self.lm.base_model_prefix
        colwise = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        rowwise = ("self_attn.o_proj", "mlp.down_proj")
        names = dict(self.lm.named_modules())
        plan: dict[str, ParallelStyle] = {
            f"{base}.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(len(self.decoder_layers())):
            layer = f"{base}.layers.{i}"
            plan.update({f"{layer}.{n}": ColwiseParallel() for n in colwise if f"{layer}.{n}" in names})
            plan.update({f"{layer}.{n}": RowwiseParallel() for n in rowwise})
        missing = sorted({name.split(".", 3)[-1] for name in plan if name not in names})
        require(
            not missing and f"{base}.layers.0.mlp.up_proj" in names,
            f"model_type {self.lm.config.model_type!r} at parallel.tp > 1: its modules are not a Llama-shaped "
            f"decoder's (missing {missing or ['mlp.up_proj']}); the tensor-parallel plan covers q/k/v/o_proj, "
            "mlp.gate/up/down_proj, embed_tokens and lm_head",
        )
        return {f"lm.{name}": style for name, style in plan.items()}

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        segment_ids: Tensor,
        full_vocab: bool = False,
        linear_logits: bool = False,
    ) -> Tensor | LinearLogits:
        length = input_ids.shape[1]
        index = torch.arange(length, device=input_ids.device)
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (index[None, :] <= index[:, None])
        hidden = self._hidden(input_ids, position_ids, mask[:, None])
        if linear_logits:
            head = self.lm.get_output_embeddings()
            return self.head_transform.linear(hidden, head.weight, head.bias)
        return self._logits(hidden, full_vocab)

    def prefill(self, input_ids: Tensor, lengths: Tensor, cache_len: int) -> tuple[Tensor, Tensor]:
        """Prompts `input_ids [R, P]` (row `r`'s first `lengths[r]` tokens; the rest is
        padding) → the logits after each prompt's last token `[R, V]` and the key/value
        cache `[layers, 2, R, kv_heads, cache_len, head_dim]` (slots past `P` empty)."""
        rows, width = input_ids.shape
        index = torch.arange(width, device=input_ids.device)
        mask = (index[None, :] <= index[:, None])[None, None].expand(rows, 1, width, width)
        cache = self._cache()
        hidden = self._hidden(input_ids, index.expand(rows, width), mask, cache)
        last = hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        slots = torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])
        return self._logits(last), F.pad(slots, (0, 0, 0, cache_len - width))

    def decode(self, tokens: Tensor, positions: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """One token per row (`tokens`, `positions` `[R]`) over the cache of `prefill`: its
        key and value go to slot `positions[r]`, it attends to slots `< positions[r]` and to
        itself. Returns the next-token logits `[R, V]` and the updated cache."""
        slots = torch.arange(cache.shape[-2], device=tokens.device)
        before = slots[None, :] < positions[:, None]
        mask = torch.cat([before, torch.ones_like(before[:, :1])], 1)[:, None, None, :]
        past = self._cache([(layer[0], layer[1]) for layer in cache.unbind(0)])
        hidden = self._hidden(tokens[:, None], positions[:, None], mask, past)
        new = torch.stack([torch.stack([layer.keys[..., -1:, :], layer.values[..., -1:, :]]) for layer in past.layers])
        write = (slots[None, :] == positions[:, None])[:, None, :, None]
        return self._logits(hidden[:, 0]), torch.where(write, new, cache)


Policy = TinyLM | HFCausalLM
"""What the runner trains: `forward`, `prefill` and `decode` as `TinyLM` defines them."""


def policy_model(cfg: ModelConfig, *, value_head: bool = False, draft: str | None = None) -> Policy:
    """The run's policy: `TinyLM` (`model.architecture=tiny`; a value head for `value_head`)
    or `HFCausalLM` (`model.architecture=hf`, which refuses a value head and a drafter:
    `draft` is the run's co-trained drafter's option name, None without one)."""
    if cfg.architecture == "tiny":
        return TinyLM(cfg, value_head=value_head)
    require(
        not value_head,
        "model.architecture=hf: loss=mse_value trains a value head, which only model.architecture=tiny builds",
    )
    require(
        draft is None,
        f"model.architecture=hf: draft={draft} co-trains a drafter on the policy's token embedding and hidden "
        "states, which only model.architecture=tiny returns; use draft=none",
    )
    return HFCausalLM(cfg)
