"""A small causal LM for the embedded default run (random init, no download).

Pre-norm transformer with learned positions. Attention is causal and restricted to the
token's own segment, so one model serves the padded `[B, S]` layout (one segment per row)
and the packed `[1, T]` layout (one segment per sequence, positions restarting at 0).
For generation it also runs over a static key/value cache (`prefill`, `decode`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from compiled_loss.config import ModelConfig
from compiled_loss.draft.runtime import aux_hidden_states
from compiled_loss.packing.context import ContextShards
from compiled_loss.parallel.collectives import gather_context_parallel
from compiled_loss.vocab import LinearLogits

Tensor = torch.Tensor


def _every_rank(x: Tensor, group: Any, gather_index: Tensor) -> Tensor:
    """Keys or values `[R, heads, L_local, d]` of this context-parallel rank's slots → those of
    every rank's, `[R, heads, L, d]` in the layout's global order (the all-gather's backward
    sums every rank's gradient and keeps this rank's block)."""
    rows, heads, length, d = x.shape
    flat = x.permute(0, 2, 1, 3).reshape(rows * length, heads, d)
    whole = gather_context_parallel(flat, group).flatten(0, 1).index_select(0, gather_index)
    return whole.view(rows, -1, heads, d).permute(0, 2, 1, 3)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_heads
        self.norm1 = nn.RMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.norm2 = nn.RMSNorm(h)
        self.up = nn.Linear(h, cfg.mlp_ratio * h, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * h, h, bias=False)

    def forward(self, x: Tensor, mask: Tensor, context: tuple[Any, Tensor] | None = None) -> Tensor:
        """`x [R, L, H]`, `mask` broadcastable to `[R, heads, L, keys]` → the block's output (the
        training forward: what FSDP2 runs as the block's unit). `context` (a context-parallel
        group and `ContextShards.gather_index`): `x` holds this rank's slots, and attention
        reads the keys and values of every rank's, in the layout's global order."""
        return self.attend(x, mask, context=context)[0]

    def attend(
        self,
        x: Tensor,
        mask: Tensor,
        cache: Tensor | None = None,
        slots: Tensor | None = None,
        context: tuple[Any, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """`x [R, L, H]`, `mask` broadcastable to `[R, heads, L, keys]` → the block's output
        and the keys and values attention read (`[R, heads, keys, H / heads]` each). With a
        `cache` (`[2, R, heads, C, H / heads]`) this call's keys and values go to the cache
        slots `slots [R, L]`, and attention reads the whole cache (generation); `context`: as
        `forward`."""
        rows, length, _ = x.shape
        y = self.norm1(x)  # heads: all of them, or this rank's under tensor parallelism
        q, k, v = (m(y).view(rows, length, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        if context is not None:
            k, v = (_every_rank(t, *context) for t in (k, v))
        if cache is not None:
            index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            k, v = cache[0].scatter(2, index, k), cache[1].scatter(2, index, v)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(rows, length, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x)))), (k, v)


class TinyLM(nn.Module):
    """`forward(input_ids, position_ids, segment_ids) -> logits [R, L, V]` (or values
    `[R, L, 1]` with `value_head=True`, a PPO critic); with `return_hidden=True` also the
    hidden states after the embedding and after each block; with `linear_logits=True` the
    logits as `LinearLogits` (the final hidden states and the LM head), never formed.

    Tensor parallel (`compiled_loss.train.shard_model` with `tp_plan()`): the logits are a
    DTensor sharded on the vocabulary (`Shard(-1)`), and with `linear_logits=True` the head's
    weight is a DTensor sharded on its rows (the loss's edge unwraps both:
    `compiled_loss.vocab.shards`); `full_vocab=True` returns the whole logits as a plain
    tensor. Generation (`prefill`, `extend`, `decode`) always returns full-vocabulary
    logits."""

    context_parallel = True
    """`forward` takes `context=`: under context parallelism it runs one rank's slots."""

    def __init__(self, cfg: ModelConfig, value_head: bool = False) -> None:
        super().__init__()
        self.cfg, self.value_head = cfg, value_head
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, 1 if value_head else cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.to(getattr(torch, cfg.dtype))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        segment_ids: Tensor,
        return_hidden: bool = False,
        full_vocab: bool = False,
        linear_logits: bool = False,
        context: tuple[ContextShards, Tensor] | None = None,
    ) -> Tensor | LinearLogits | tuple[Tensor, list[Tensor]]:
        """`context` (`ContextShards` of the layout and its segment ids `[R, L]`): the inputs are
        this context-parallel rank's slots `[R, L / cp]`, and every block attends over every
        rank's keys and values; the outputs are this rank's slots'."""
        if context is None:
            index = torch.arange(input_ids.shape[1], device=input_ids.device)
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (index[None, :] <= index[:, None])
            keys = None
        else:
            shards, key_segments = context
            rows, width = key_segments.shape
            offset = torch.arange(rows, device=input_ids.device)[:, None] * width
            query = shards.local_to_global.view(rows, -1) - offset  # each local slot's place in its row
            index = torch.arange(width, device=input_ids.device)
            mask = (segment_ids[:, :, None] == key_segments[:, None, :]) & (index[None, None, :] <= query[:, :, None])
            keys = (shards.group, shards.gather_index)
        x = self.embed(input_ids) + self.pos(position_ids)
        hidden = [x]
        for block in self.blocks:
            x = block(x, mask[:, None], keys)
            hidden.append(x)
        if linear_logits:
            return LinearLogits(self.norm(x), self.head.weight)
        logits = self._logits(self.norm(x)) if full_vocab else self.head(self.norm(x))
        return (logits, hidden) if return_hidden else logits

    def _logits(self, x: Tensor) -> Tensor:
        """The LM head over the whole vocabulary, a plain tensor (gathered under tensor parallelism)."""
        logits = self.head(x)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def decoder_layers(self) -> list[nn.Module]:
        """The blocks FSDP shards (and compiles) one by one."""
        return list(self.blocks)

    def tp_plan(self) -> dict[str, ParallelStyle]:
        """The DTensor tensor-parallel plan (`parallelize_module`): attention heads and the
        MLP column-/row-wise, the token and position embeddings on their rows, the LM head's
        output sharded on the vocabulary as a DTensor (`Shard(-1)`; a value head stays
        replicated). The norms are replicated."""
        plan: dict[str, ParallelStyle] = {name: RowwiseParallel(input_layouts=Replicate()) for name in ("embed", "pos")}
        if not self.value_head:
            plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        for i in range(len(self.blocks)):
            plan.update({f"blocks.{i}.{name}": ColwiseParallel() for name in ("q", "k", "v", "up")})
            plan.update({f"blocks.{i}.{name}": RowwiseParallel() for name in ("proj", "down")})
        return plan

    def prefill(
        self, input_ids: Tensor, lengths: Tensor, cache_len: int, aux_layers: tuple[int, ...] = ()
    ) -> tuple[Tensor, ...]:
        """Prompts `input_ids [R, P]` (row `r`'s first `lengths[r]` tokens; the rest is
        padding) → the logits after each prompt's last token `[R, V]` and the key/value
        cache `[layers, 2, R, heads, cache_len, H / heads]` (slots past `P` empty); with
        `aux_layers` also the outputs of those decoder layers at every prompt slot,
        concatenated `[R, P, A·H]` (what a drafter reads)."""
        rows, width = input_ids.shape
        index = torch.arange(width, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(index.expand(rows, width))
        mask = (index[None, :] <= index[:, None])[None, None]
        caches, hidden = [], [x]
        for block in self.blocks:
            x, keys_values = block.attend(x, mask)
            caches.append(F.pad(torch.stack(keys_values), (0, 0, 0, cache_len - width)))
            hidden.append(x)
        last = x.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]
        out = self._logits(self.norm(last)), torch.stack(caches)
        return out + (aux_hidden_states(hidden, aux_layers),) if aux_layers else out

    def extend(
        self, tokens: Tensor, positions: Tensor, cache: Tensor, aux_layers: tuple[int, ...] = ()
    ) -> tuple[Tensor, ...]:
        """`n` tokens per row (`tokens [R, n]`, the first at `positions [R]`) over the cache
        of `prefill`: their keys and values go to slots `positions[r] + i`, token `i`
        attends to the slots up to its own. Returns the next-token logits `[R, n, V]`, the
        updated cache and, with `aux_layers`, those layers' outputs `[R, n, A·H]`."""
        slot = positions[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [R, n]
        mask = (torch.arange(cache.shape[-2], device=tokens.device) <= slot[..., None])[:, None]  # [R, 1, n, C]
        x = self.embed(tokens) + self.pos(slot)
        caches, hidden = [], [x]
        for block, layer_cache in zip(self.blocks, cache.unbind(0)):
            x, keys_values = block.attend(x, mask, layer_cache, slot)
            caches.append(torch.stack(keys_values))
            hidden.append(x)
        out = self._logits(self.norm(x)), torch.stack(caches)
        return out + (aux_hidden_states(hidden, aux_layers),) if aux_layers else out

    def decode(self, tokens: Tensor, positions: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """One token per row (`tokens`, `positions` `[R]`) over the cache of `prefill`: its
        key and value go to slot `positions[r]`, it attends to slots `<= positions[r]`.
        Returns the next-token logits `[R, V]` and the updated cache."""
        logits, cache = self.extend(tokens[:, None], positions, cache)
        return logits[:, 0], cache
