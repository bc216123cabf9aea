"""DFlash: a co-trained block drafter (ref §11.3 "DSpark / DFlash", §7.7, §14).

The reference specifies the loss contract of the block drafters (anchors, eval mask, decayed
soft-CE, TV term, confidence head, τ / accept-rate metrics) but not the drafter's forward;
the forward here follows the DFlash idea (arXiv 2602.06036, z-lab/dflash): a small
non-causal decoder that, conditioned on the target model's hidden states of the context,
proposes a block of γ tokens after an anchor in ONE parallel forward.

Drafter (`DFlashDrafter`)
    context   `ctx = RMSNorm(fc(concat of the policy's aux hidden states))`, `[R, L, D]`;
              computed once per micro-batch, padding slots zeroed first.
    blocks    one per anchor `p`, `block_size = γ + 1` slot queries: slot 0 is the anchor
              token's embedding (the verified "bonus anchor" of DFlash; unsupervised,
              `FIRST_SUPERVISED_SLOT = 1`), slots 1..γ a learned mask-token embedding; every
              slot adds a learned slot embedding. The token embedding is copied from the
              policy and frozen when given (projected if the widths differ).
    layers    pre-norm blocks; each layer's keys/values are its own K/V projections of the
              context features followed by those of the block's slots ("KV injection": the
              context is re-read by every layer, as in DFlash). A slot sees the context
              slots of the anchor's document strictly BEFORE the anchor — at inference the
              anchor is the token the target just sampled, whose hidden state does not
              exist yet, so that is all a drafter can condition on — and every slot of its
              own block (bidirectional). RoPE on per-document positions (context slot at
              its position, block slot j at `pos(p) + j`) with q/k RMSNorm, SwiGLU MLP.
    heads     final RMSNorm, an LM head over the draft vocabulary (draft id i = target id
              i + d2t[i]) and, optionally, a confidence head (one logit per slot).

Loss (`DFlashRuntime.draft_loss`)
    anchors   positions p whose NEXT token is supervised inside p's document; a static
              `num_anchors` of them per micro-batch, drawn without replacement as the top-k
              of the host-drawn `anchor_noise` over the candidates, sorted; anchors beyond
              the number of candidates are padded (index 0) with `keep = False`.
    targets   slot j of the block at p: label token p+j; teacher = the policy's logits at
              p+j-1 (`teacher_logits[row, label_positions - 1]`, ref §7.7), mapped to the
              draft vocabulary.
    eval mask label inside the sequence and p's document, mappable to the draft vocabulary,
              supervised (`loss_mask[label]`), block kept; then a cumulative product along
              the block (a contiguous prefix), slot 0 forced valid for the product and then
              zeroed.
    terms     `w = eval · exp(-(slot - 1) / γ_decay)` (no decay for γ_decay = 0);
              CE: the soft cross-entropy against the teacher distribution, fused with the
              draft LM head (`dflash_soft_ce_stats`, ref §7.7; the §11.3
              runtime uses the hard label ids instead);
              TV: `Σ_v |softmax(draft) - softmax(teacher)|` (row chunks, recomputing
              backward); accept rate `a = clamp(1 - TV/2, 0, 1)`;
              confidence: BCE-with-logits of the confidence head against the detached `a`.
              `loss = (α_ce·Σ CE·w / W + α_l1·Σ TV·w / W + α_conf·Σ BCE·eval / E) / n_slots`
              with `W = Σ w`, `E = Σ eval` detached and summed over the data-parallel group
              (+1e-6, `DFLASH_LOSS_DEN_EPS`).
    metrics   `draft_loss` and its terms; num/den pairs (they sum over micro-batches):
              `draft_tau_*` (τ = 1 + Σ_j Π_{i≤j} a_i per block), and per slot j = 1..γ
              `draft_accept_rate_*@j` (mean a) and `draft_acc_*@j` (top-1 agreement of the
              draft with the teacher).

Everything has static shapes (`[R, L]`, `num_anchors`, `block_size`) and no host sync, so
one compile serves every micro-batch of a shape whatever its anchors; an unpacked batch
`[B, S]` and the same documents packed into one row give the same loss, metrics and drafter
gradients for the same anchors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from compiled_loss.checks import FLOAT32, check_factor, require
from compiled_loss.draft.common import (
    DFLASH_LOSS_DEN_EPS,
    ROPE_THETA,
    check_draft_batch,
    check_draft_config,
    check_heads,
    resolve_aux_layers,
    resolve_draft_vocab,
    rope_tables,
    rotate_half,
    same_document,
    shift_left,
)
from compiled_loss.draft.runtime import DraftBatch, DraftRuntimeBase
from compiled_loss.draft.speculative import DrafterState, Sample
from compiled_loss.losses.draft_ce import DEFAULT_DRAFT_TOKEN_CHUNK_SIZE, dflash_soft_ce_stats
from compiled_loss.parallel.collectives import all_reduce_sum
from compiled_loss.vocab import DraftVocab, total_variation

Tensor = torch.Tensor

FIRST_SUPERVISED_SLOT = 1
"""Slot 0 of a DFlash block holds the verified anchor (the "bonus" token): never supervised."""

_INIT_STD = 0.02  # of the learned embeddings (the token embedding when none is copied, mask and slot)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """The DFlash block drafter and its loss (ref §11.3)."""

    loss_weight: float = 1.0
    """λ: the policy loss gets `loss_weight × draft loss` (0 or in [1e-6, 1e6], `FACTOR_MAX`)."""
    block_size: int = 5
    """Slots per block, the anchor slot included: γ + 1 (>= 2); γ tokens are proposed."""
    num_anchors: int = 32
    """Static number of anchors (blocks) per micro-batch (>= 1)."""
    loss_decay_gamma: float = 4.0
    """γ_decay: slot k after the anchor is weighted exp(-(k-1)/γ_decay); 0 = no decay. Otherwise every slot's
    weight, down to the last one's exp(-(block_size-2)/γ_decay), must be a normal float32 (>= 1.18e-38):
    γ_decay >= max(1, block_size - 2) / 87.34."""
    ce_loss_alpha: float = 1.0
    """Weight of the soft cross-entropy term (0 or in [1e-6, 1e6])."""
    l1_loss_alpha: float = 0.0
    """Weight of the total-variation term Σ|p_draft - p_teacher| (0 or in [1e-6, 1e6])."""
    confidence_head_alpha: float = 0.0
    """Weight of the confidence-head BCE (0 or in [1e-6, 1e6]); > 0 adds the confidence head."""
    hidden_size: int | None = None
    """Drafter width; None = the policy's."""
    num_heads: int | None = None
    """Drafter attention heads; None = the policy's."""
    num_layers: int = 1
    """Drafter decoder layers (>= 1)."""
    draft_vocab_size: int | None = None
    """Draft vocabulary size; None = the policy vocabulary (or the length of `d2t`)."""
    token_chunk_size: int | None = None
    """Rows per fp32 vocabulary tile in eager mode (None = ~4 MiB tiles); ignored when compiled."""
    aux_layers: tuple[int, ...] | None = None
    """Policy decoder layers (0-based, distinct, read in ascending order) whose outputs feed the drafter; None =
    `aux_layers_default`."""

    def __post_init__(self) -> None:
        check_draft_config(self, sizes=("hidden_size", "num_heads", "draft_vocab_size", "token_chunk_size"))
        for name in ("loss_decay_gamma", "ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be >= 0, got {value}")
        for name in ("ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha"):
            check_factor(name, getattr(self, name), "it scales a term of the draft loss")
        require(self.block_size >= 2, f"block_size must be >= 2, got {self.block_size}")
        gamma, powers = self.loss_decay_gamma, max(1, self.block_size - 2)  # the decay and its largest power
        least = powers / -math.log(FLOAT32.smallest_normal)
        require(
            gamma == 0 or gamma >= least,
            f"loss_decay_gamma must be 0 or >= {least:.4g} (with block_size={self.block_size}), got {gamma}: slot k "
            f"is weighted exp(-(k-1)/loss_decay_gamma), which underflows float32 (< {FLOAT32.smallest_normal:.3g}) "
            "for the block's last slots below that, so they would train nothing",
        )
        for name in ("num_anchors", "num_layers"):
            value = getattr(self, name)
            require(value >= 1, f"{name} must be >= 1, got {value}")


# ---------------------------------------------------------------------------------------
# Anchors and block targets (pure, traceable)
# ---------------------------------------------------------------------------------------


class DFlashBlocks(NamedTuple):
    """Where each block's slots point, `[N, B]` (N anchors, B = block_size slots)."""

    anchors: Tensor
    """`[N]` long: flat index `row·L + p` of each anchor (0 for a padded anchor)."""
    keep: Tensor
    """`[N]` bool: a real anchor."""
    labels: Tensor
    """`[N, B]` long: the token at p + slot (target vocabulary; clamped inside the row)."""
    teacher_index: Tensor
    """`[N, B]` long: flat index of the teacher logits row for each slot (p + slot - 1, clamped)."""
    eval_mask: Tensor
    """`[N, B]` fp32 0/1: the slots the loss reads (a contiguous prefix; slot 0 never)."""


def select_anchors(loss_mask: Tensor, document_ids: Tensor, noise: Tensor, num_anchors: int) -> tuple[Tensor, Tensor]:
    """`num_anchors` anchors without replacement among the positions whose next token is
    supervised in the same document: the top-k of `noise` over those candidates, sorted by
    flat index `row·L + p`. Returns `(anchors [N] long, keep [N] bool)`; anchors beyond the
    number of candidates are 0 with `keep = False` (static shapes, no host sync)."""
    rows, length = loss_mask.shape
    total = rows * length
    candidate = same_document(document_ids, 1) & (shift_left(loss_mask, 1, 0) > 0)
    score = torch.where(candidate, noise.float(), float("-inf")).flatten()
    if total < num_anchors:
        score = F.pad(score, (0, num_anchors - total), value=float("-inf"))
    top, index = torch.topk(score, num_anchors)
    order = torch.where(top > float("-inf"), index, total).sort().values  # real anchors first, ascending
    keep = order < total
    return torch.where(keep, order, 0), keep


def block_targets(
    input_ids: Tensor,
    loss_mask: Tensor,
    document_ids: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    target_in_draft: Tensor | None = None,
) -> DFlashBlocks:
    """Labels, teacher rows and the eval mask of the blocks at `anchors` (ref §11.3).

    A slot is valid when its label p + slot lies inside the row and the anchor's document,
    is supervised (`loss_mask`), is in the draft vocabulary (`target_in_draft [V]` bool;
    None = every id) and the block is kept; the eval mask is the cumulative product of
    validity along the block with the leading unsupervised slot forced valid, then zeroed.
    """
    rows, length = input_ids.shape
    slot = torch.arange(block_size, device=input_ids.device)
    position = anchors % length
    label_pos = position[:, None] + slot  # [N, B]
    inside = label_pos < length
    flat = anchors[:, None] - position[:, None] + label_pos.clamp(max=length - 1)
    docs = document_ids.flatten()
    anchor_doc = docs[anchors]
    valid = inside & (docs[flat] == anchor_doc[:, None]) & (anchor_doc[:, None] >= 0)
    labels = input_ids.flatten()[flat]
    valid = valid & (loss_mask.flatten()[flat] > 0) & keep[:, None]
    if target_in_draft is not None:
        vocab = target_in_draft.shape[0]
        in_range = (labels >= 0) & (labels < vocab)
        valid = valid & in_range & target_in_draft[labels.clamp(0, vocab - 1)]
    leading = slot < FIRST_SUPERVISED_SLOT
    eval_mask = torch.where(leading, True, valid).float().cumprod(-1)
    eval_mask = torch.where(leading, 0.0, eval_mask)
    return DFlashBlocks(anchors, keep, labels, (flat - 1).clamp(min=0), eval_mask)


# ---------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------


class _BlockLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm_attn = nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)
        self.norm_mlp = nn.RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rows: Tensor,
        ctx_rope: tuple[Tensor, Tensor],
        block_rope: tuple[Tensor, Tensor],
        mask: Tensor,
    ) -> Tensor:
        n, slots, hidden = x.shape
        heads = (self.heads, self.head_dim)
        h = self.norm_attn(x)
        q = rotate_half(self.q_norm(self.q(h).unflatten(-1, heads)), *block_rope)
        k_block = rotate_half(self.k_norm(self.k(h).unflatten(-1, heads)), *block_rope)
        v_block = self.v(h).unflatten(-1, heads)
        k_ctx = rotate_half(self.k_norm(self.k(ctx).unflatten(-1, heads)), *ctx_rope).index_select(0, rows)
        v_ctx = self.v(ctx).unflatten(-1, heads).index_select(0, rows)  # [N, L, heads, hd]
        k = torch.cat([k_ctx, k_block], 1).transpose(1, 2)
        v = torch.cat([v_ctx, v_block], 1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        x = x + self.o(attn.transpose(1, 2).reshape(n, slots, hidden))
        gate, up = self.gate_up(self.norm_mlp(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashShape:
    """The sizes of a `DFlashDrafter`: the policy's hidden size, auxiliary layers and
    vocabulary, the drafter's width, heads, block and layers, whether it has a confidence
    head, its MLP ratio and RoPE base."""

    policy_hidden_size: int
    aux_layers: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    num_heads: int
    block_size: int
    num_layers: int = 1
    confidence_head: bool = False
    mlp_ratio: int = 4
    rope_theta: float = ROPE_THETA


class DFlashDrafter(nn.Module):
    """The block drafter (see the module docstring), of `shape` (`DFlashShape`).

    `forward(hidden_states [R, L, A·H], input_ids, position_ids, document_ids [R, L], anchors
    [N]) -> [N, block_size, D]` final hidden states of every block slot; `logits(h)` over the
    draft vocabulary, `confidence(h)` one logit per slot (with `confidence_head=True`),
    `to_draft_vocab(teacher [..., V])` the teacher restricted to the draft vocabulary.
    """

    def __init__(
        self,
        shape: DFlashShape,
        *,
        d2t: Tensor | DraftVocab | None = None,
        embedding_weight: Tensor | None = None,
    ) -> None:
        super().__init__()
        policy_hidden_size, aux_layers, vocab_size = shape.policy_hidden_size, shape.aux_layers, shape.vocab_size
        hidden_size, num_heads, block_size = shape.hidden_size, shape.num_heads, shape.block_size
        num_layers, confidence_head, mlp_ratio, rope_theta = (
            shape.num_layers,
            shape.confidence_head,
            shape.mlp_ratio,
            shape.rope_theta,
        )
        check_heads(hidden_size, num_heads)
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.aux_layers, self.block_size, self.rope_theta = tuple(sorted(aux_layers)), block_size, rope_theta
        self.fc = nn.Linear(len(self.aux_layers) * policy_hidden_size, hidden_size, bias=False)
        self.ctx_norm = nn.RMSNorm(hidden_size)
        if embedding_weight is not None:
            if embedding_weight.dim() != 2 or embedding_weight.shape[0] != vocab_size:
                raise ValueError(
                    f"policy_embedding_weight must be [{vocab_size}, E], got {tuple(embedding_weight.shape)}"
                )
            self.embed = nn.Embedding.from_pretrained(embedding_weight.detach().clone().float(), freeze=True)
        else:
            self.embed = nn.Embedding(vocab_size, hidden_size)
            nn.init.normal_(self.embed.weight, std=_INIT_STD)
        width = self.embed.weight.shape[1]
        self.embed_proj = nn.Identity() if width == hidden_size else nn.Linear(width, hidden_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.randn(hidden_size) * _INIT_STD)
        self.slot_embedding = nn.Parameter(torch.randn(block_size, hidden_size) * _INIT_STD)
        self.layers = nn.ModuleList(
            _BlockLayer(hidden_size, num_heads, mlp_ratio * hidden_size) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden_size)
        if d2t is not None:
            vocab = d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t)
            vocab.check_vocab(vocab_size)
            in_draft = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")  # the host's, as the index
            in_draft = in_draft.index_fill(0, vocab.target_ids.cpu(), True)
            self.register_buffer("d2t", vocab.d2t.detach().clone().long())
            self.register_buffer("draft_target_ids", vocab.target_ids.detach().clone(), persistent=False)
            self.register_buffer("target_in_draft", in_draft, persistent=False)
            draft_vocab = vocab.size
        else:
            self.d2t = self.draft_target_ids = self.target_in_draft = None
            draft_vocab = vocab_size
        self.lm_head = nn.Linear(hidden_size, draft_vocab, bias=False)
        self.confidence_head = nn.Linear(hidden_size, 1) if confidence_head else None
        head_dim = hidden_size // num_heads
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin `[..., 1, hd/2]` of the rotary angles (rotate-half convention, `rotate_half`)."""
        cos, sin = rope_tables(positions, self.inv_freq, self.fc.weight.dtype)
        return cos[..., None, :], sin[..., None, :]  # broadcast over the heads

    def forward(
        self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor, document_ids: Tensor, anchors: Tensor
    ) -> Tensor:
        rows, length = input_ids.shape
        n, slots = anchors.shape[0], self.block_size
        dtype = self.fc.weight.dtype
        real = document_ids >= 0
        ctx = self.ctx_norm(self.fc(torch.where(real[..., None], hidden_states.to(dtype), 0.0)))  # [R, L, D]
        row, position = anchors // length, anchors % length
        anchor_doc = document_ids.flatten()[anchors]
        tokens = self.embed_proj(self.embed(input_ids.flatten()[anchors]).to(dtype))  # [N, D]
        x = torch.cat([tokens[:, None], self.mask_embedding.expand(n, slots - 1, -1)], 1) + self.slot_embedding
        columns = torch.arange(length, device=input_ids.device)
        visible = (
            (document_ids.index_select(0, row) == anchor_doc[:, None])
            & (columns < position[:, None])
            & (anchor_doc[:, None] >= 0)
        )  # [N, L]: the anchor's document strictly before it
        mask = torch.cat(
            [
                visible[:, None, :].expand(n, slots, length),
                torch.ones(n, slots, slots, dtype=torch.bool, device=x.device),
            ],
            -1,
        )[:, None]
        slot = torch.arange(slots, device=input_ids.device)
        ctx_rope = self._rope(position_ids)
        block_rope = self._rope(position_ids.flatten()[anchors][:, None] + slot)
        for layer in self.layers:
            x = layer(x, ctx, row, ctx_rope, block_rope, mask)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def confidence(self, hidden: Tensor) -> Tensor:
        if self.confidence_head is None:
            raise ValueError("this DFlashDrafter has no confidence head (build it with confidence_head=True)")
        return self.confidence_head(hidden).squeeze(-1)

    def to_draft_vocab(self, teacher: Tensor) -> Tensor:
        """Teacher logits `[..., V]` → `[..., V_draft]` (draft id i = target id i + d2t[i])."""
        return teacher if self.draft_target_ids is None else teacher.index_select(-1, self.draft_target_ids)


# ---------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------


class DFlashRuntime(DraftRuntimeBase):
    """The DFlash runtime: `draft_loss(batch, n_slots) -> (loss, metrics)` (see the module
    docstring); the seed protocol (`begin_global_batch`, `stash_teacher_logits`,
    `compute_loss`) comes from `DraftRuntimeBase`."""

    def __init__(self, config: DFlashConfig, drafter: DFlashDrafter, dp_group: Any = None) -> None:
        super().__init__(config.loss_weight, drafter.aux_layers, dp_group)
        if drafter.block_size != config.block_size:
            raise ValueError(f"drafter.block_size ({drafter.block_size}) != config.block_size ({config.block_size})")
        if (config.confidence_head_alpha > 0) != (drafter.confidence_head is not None):
            raise ValueError(
                f"config.confidence_head_alpha = {config.confidence_head_alpha} needs a drafter "
                f"{'with' if config.confidence_head_alpha > 0 else 'without'} a confidence head"
            )
        self.config, self.drafter = config, drafter

    @property
    def gamma(self) -> int:
        """Proposed tokens per block."""
        return self.config.block_size - FIRST_SUPERVISED_SLOT

    # `SpeculativeDrafter`: one block forward at each row's last token over the auxiliary hidden
    # states of the slots before it; the state is (those hidden states, the tokens) of every slot

    def prefill(
        self, ids: Tensor, lengths: Tensor, first: Tensor, aux: Tensor, *, cache_len: int, pad: int
    ) -> DrafterState:
        """The prompts' hidden states and tokens, `first` after each prompt."""
        rows, prompt = ids.shape
        aux_cache = aux.new_zeros(rows, cache_len, aux.shape[-1])
        aux_cache[:, :prompt] = aux
        ids_cache = F.pad(ids, (0, cache_len - prompt), value=pad)
        return aux_cache, ids_cache.scatter(1, lengths[:, None], first[:, None])

    def propose(self, state: DrafterState, pos: Tensor, uniforms: Tensor, sample: Sample) -> tuple[Tensor, Tensor]:
        """Block slots `1..γ` of the block anchored at `pos`: independent proposals."""
        drafter = self.drafter
        aux_cache, ids_cache = state
        rows, cache_len = ids_cache.shape
        positions = torch.arange(cache_len, device=pos.device).expand(rows, cache_len)
        anchors = torch.arange(rows, device=pos.device) * cache_len + pos
        hidden = drafter(aux_cache, ids_cache, positions, torch.zeros_like(ids_cache), anchors)
        return sample(drafter.logits(hidden[:, 1 : uniforms.shape[1] + 1]), drafter.draft_target_ids, uniforms)

    def commit(self, state: DrafterState, emitted: Tensor, aux: Tensor, pos: Tensor, accepted: Tensor) -> DrafterState:
        """The round's hidden states at slots `pos .. pos + γ`, its tokens after them."""
        aux_cache, ids_cache = state
        index = torch.arange(emitted.shape[1], device=pos.device)
        at = (pos[:, None] + index)[..., None].expand(-1, -1, aux.shape[-1])
        return (
            aux_cache.scatter(1, at, aux.to(aux_cache.dtype)),
            ids_cache.scatter(1, pos[:, None] + 1 + index, emitted),
        )

    def draft_loss(self, batch: DraftBatch, n_slots: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, drafter = self.config, self.drafter
        check_draft_batch(batch, n_slots, drafter.fc.in_features, drafter.embed.num_embeddings, anchor_noise=True)
        anchors, keep = select_anchors(batch.loss_mask, batch.document_ids, batch.anchor_noise, cfg.num_anchors)
        blocks = block_targets(
            batch.input_ids, batch.loss_mask, batch.document_ids, anchors, keep, cfg.block_size, drafter.target_in_draft
        )
        hidden = drafter(batch.hidden_states, batch.input_ids, batch.position_ids, batch.document_ids, anchors)
        length = batch.input_ids.shape[1]
        slot = torch.arange(cfg.block_size, device=hidden.device)
        decay = math.exp(-1 / cfg.loss_decay_gamma) if cfg.loss_decay_gamma > 0 else 1.0
        # the decayed soft-CE, fused with the draft LM head (no [N·γ, V_draft] logits kept)
        stats = dflash_soft_ce_stats(
            draft_hidden=hidden,
            output_weight=drafter.lm_head.weight,
            teacher_logits=drafter.to_draft_vocab(batch.teacher_logits),
            teacher_rows=(anchors // length, (anchors % length)[:, None] + slot),
            loss_mask=blocks.eval_mask > 0,
            position_decay=decay,
            token_chunk_size=cfg.token_chunk_size or DEFAULT_DRAFT_TOKEN_CHUNK_SIZE,
        )
        eval_mask = blocks.eval_mask[:, FIRST_SUPERVISED_SLOT:]  # [N, γ]
        weight = eval_mask * stats.weights  # [N, γ]
        dens = all_reduce_sum(torch.stack([weight.sum(), eval_mask.sum()]).detach(), self.dp_group)
        weight_den, eval_den = dens[0] + DFLASH_LOSS_DEN_EPS, dens[1] + DFLASH_LOSS_DEN_EPS
        ce_term = (stats.numerators * stats.weights).sum() / weight_den

        # the total variation: a loss term (with a gradient) or only the accept-rate metric
        hidden = hidden[:, FIRST_SUPERVISED_SLOT:]  # [N, γ, D]: the supervised slots
        valid = eval_mask.flatten() > 0
        rows = blocks.teacher_index[:, FIRST_SUPERVISED_SLOT:].flatten()
        teacher = drafter.to_draft_vocab(batch.teacher_logits.flatten(0, 1).index_select(0, rows))
        teacher = torch.where(valid[:, None], teacher, 0.0)  # masked slots read no garbage (NaN-safe)
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.l1_loss_alpha > 0):
            logits = drafter.logits(hidden).flatten(0, 1)
            tv = total_variation(logits, teacher, cfg.token_chunk_size)
        tv = torch.where(valid, tv, 0.0).view_as(weight)
        agree = ((logits.detach().argmax(-1) == teacher.argmax(-1)) & valid).view_as(weight).float()  # top-1
        accept = torch.where(eval_mask > 0, (1 - 0.5 * tv.detach()).clamp(0, 1), 0.0)  # [N, γ]
        loss = cfg.ce_loss_alpha * ce_term
        tv_term = (tv * weight).sum() / weight_den
        if cfg.l1_loss_alpha > 0:
            loss = loss + cfg.l1_loss_alpha * tv_term
        conf_term = torch.zeros((), device=hidden.device)
        if drafter.confidence_head is not None:  # learns to predict each slot's acceptance
            bce = F.binary_cross_entropy_with_logits(drafter.confidence(hidden).float(), accept, reduction="none")
            conf_term = torch.where(eval_mask > 0, bce, 0.0).sum() / eval_den
            loss = loss + cfg.confidence_head_alpha * conf_term
        loss = loss / n_slots
        metrics = {
            "draft_loss": loss.detach(),
            "draft_ce_loss": ce_term.detach() / n_slots,
            "draft_tv_loss": tv_term.detach() / n_slots,
            "draft_conf_loss": conf_term.detach() / n_slots,
        }
        return loss, metrics | _acceptance_metrics(accept, agree, eval_mask)


def _acceptance_metrics(accept: Tensor, agree: Tensor, eval_mask: Tensor) -> dict[str, Tensor]:
    """τ (1 + the expected accepted run of a block) and each slot's accept rate and top-1
    agreement, as numerators and denominators, from `[N, γ]` acceptance probabilities, top-1
    agreements and the supervised slots."""
    valid_block = eval_mask[:, 0]  # a block with at least one supervised slot
    tau = 1 + torch.cumprod(accept, -1).sum(-1)
    metrics = {"draft_tau_num": (tau * valid_block).sum(), "draft_tau_den": valid_block.sum()}
    accept_num, accept_den, agree_num = accept.sum(0), eval_mask.sum(0), agree.sum(0)
    for i in range(accept.shape[-1]):
        metrics[f"draft_accept_rate_num@{i + 1}"] = accept_num[i]
        metrics[f"draft_accept_rate_den@{i + 1}"] = accept_den[i]
        metrics[f"draft_acc_num@{i + 1}"] = agree_num[i]
        metrics[f"draft_acc_den@{i + 1}"] = accept_den[i]
    return metrics


def build_dflash_runtime(
    config: DFlashConfig,
    policy_model_config: Any,
    policy_embedding_weight: Tensor | None = None,
    d2t: Tensor | DraftVocab | None = None,
    dp_group: Any = None,
) -> DFlashRuntime:
    """A `DFlashRuntime` for a policy described by `policy_model_config` (any object with
    `vocab_size`, `hidden_size`, `num_heads`, `num_layers`): the drafter's width and heads
    default to the policy's, its aux layers to `aux_layers_default(num_layers)`; the token
    embedding is copied from `policy_embedding_weight` and frozen when given; `d2t` maps the
    draft vocabulary (checked once, here)."""
    shape = DFlashShape(
        policy_hidden_size=policy_model_config.hidden_size,
        aux_layers=resolve_aux_layers(config.aux_layers, policy_model_config.num_layers),
        vocab_size=policy_model_config.vocab_size,
        hidden_size=config.hidden_size or policy_model_config.hidden_size,
        num_heads=config.num_heads or policy_model_config.num_heads,
        num_layers=config.num_layers,
        block_size=config.block_size,
        confidence_head=config.confidence_head_alpha > 0,
    )
    drafter = DFlashDrafter(
        shape,
        d2t=resolve_draft_vocab(d2t, config.draft_vocab_size, policy_model_config.vocab_size),
        embedding_weight=policy_embedding_weight,
    )
    return DFlashRuntime(config, drafter, dp_group=dp_group)


__all__ = [
    "FIRST_SUPERVISED_SLOT",
    "DFlashBlocks",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashRuntime",
    "DFlashShape",
    "block_targets",
    "build_dflash_runtime",
    "select_anchors",
]
