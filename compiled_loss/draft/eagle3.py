"""EAGLE-3 co-trained drafter with training-time test (TTT), ref §11.3 "EAGLE3 TTT".

The drafter (`Eagle3Drafter`) reads what the policy forward captured — the auxiliary
hidden states `h_t` of a few decoder layers, concatenated — and the tokens; the runtime
(`Eagle3Runtime.draft_loss`) unrolls `ttt_steps` draft steps with teacher forcing and
scores step `k` against the policy's own next-token distribution:

- step 0, slot t: input `[norm(embed(x_{t+1})), norm(fc(h_t))]`, predicts `x_{t+2}`
  (the teacher row `t + 1`, supervised by `loss_mask[t + 2]`: vLLM's proposer alignment,
  ref §13.13);
- step k > 0, slot t: input `[norm(embed(x_{t+k+1})), norm(o^{k-1}_t)]` with `o^{k-1}_t` the
  previous step's output at the same slot, predicts `x_{t+k+2}` (teacher row `t + k + 1`,
  `loss_mask[t + k + 2]`). Slot t carries one draft chain through all the steps, as the
  reference's `[0, T - k)` logits against `teacher[:, k:]` do.

The loss is `Σ_k decay^k · Σ_t KL(softmax(teacher) ‖ softmax(draft))·mask_k / den_k /
n_slots` with `den_k = all_reduce_dp(Σ mask_k + 1e-5)` (`EAGLE3_LOSS_DEN_EPS`), the KL in
fp32 through `vocab_reduce` (`KL = lse - Σ p_teacher·x + Σ p_teacher log p_teacher`).
Every shift stays inside one document (`document_ids`), so one packed row of several
sequences and the unpacked rows of the same sequences give the same loss, metrics and
gradients; padding slots (document -1) are zeroed before any math and reach nothing.

Everything is static-shaped and free of host syncs: it traces into the training step's
graph (`fullgraph=True`) and compiles once per `[R, L]` shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compiled_loss.checks import FLOAT32, require
from compiled_loss.draft.common import (
    EAGLE3_LOSS_DEN_EPS,
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
from compiled_loss.parallel.collectives import all_reduce_sum
from compiled_loss.vocab import DraftVocab, draft_vocab_logits, vocab_reduce

Tensor = torch.Tensor

_RMS_NORM_EPS = 1e-6  # of every RMSNorm of the drafter (Llama's `rms_norm_eps`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """The EAGLE-3 drafter and its TTT loss (ref §11.3; unset sizes follow the policy)."""

    loss_weight: float = 1.0
    """λ: the training step adds `loss_weight × draft loss` to the policy loss; 0 or in [1e-6, 1e6] (`FACTOR_MAX`)."""
    ttt_steps: int = 3
    """Unrolled training-time-test steps (the reference's default 3); >= 1."""
    ttt_step_loss_decay: float = 0.8
    """Weight decay^k of step k's loss, in (0, 1] (0.8: EAGLE-3's / SpecForge's step weights); the last step's
    weight decay^(ttt_steps - 1) must be a normal float32 (>= 1.18e-38), or that step's loss is multiplied by 0."""
    hidden_size: int | None = None
    """Width of the drafter (None: the policy's; must equal it when the policy's embedding is copied)."""
    num_heads: int | None = None
    """Attention heads of the drafter's decoder layer (None: the policy's)."""
    intermediate_size: int | None = None
    """Width of the drafter's SiLU-GLU MLP (None: the policy's MLP ratio × hidden_size)."""
    draft_vocab_size: int | None = None
    """Draft vocabulary size (None: the policy's vocabulary, or d2t's size when a d2t map is given)."""
    token_chunk_size: int = 512
    """Rows per fp32 vocab chunk of the KL in eager mode (the reference's 512 positions)."""
    aux_layers: tuple[int, ...] | None = None
    """Policy decoder layers (0-based, distinct, read in ascending order) whose outputs feed the drafter (None:
    `aux_layers_default`)."""
    rope_theta: float = ROPE_THETA
    """Base of the drafter's rotary position embedding; > 0."""

    def __post_init__(self) -> None:
        check_draft_config(self, sizes=("hidden_size", "num_heads", "intermediate_size", "draft_vocab_size"))
        require(self.ttt_steps >= 1, f"ttt_steps must be >= 1, got {self.ttt_steps}")
        decay = self.ttt_step_loss_decay
        require(0 < decay <= 1, f"ttt_step_loss_decay must be in (0, 1], got {decay}")
        require(
            decay ** (self.ttt_steps - 1) >= FLOAT32.smallest_normal,
            f"ttt_step_loss_decay={decay} with ttt_steps={self.ttt_steps}: the last step's loss weight "
            f"decay^{self.ttt_steps - 1} = {decay ** (self.ttt_steps - 1):.3g} underflows float32 (< "
            f"{FLOAT32.smallest_normal:.3g}), so that step would train nothing; raise ttt_step_loss_decay or lower "
            "ttt_steps",
        )
        require(self.token_chunk_size >= 1, f"token_chunk_size must be >= 1, got {self.token_chunk_size}")
        require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the softmax and the rotary angles: fp32, or fp64 for an fp64 drafter."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 draft model: `fc` over the concatenated auxiliary hidden states
    (`A·H_policy → H`), a frozen token embedding `[V, H]` over the policy's vocabulary, ONE
    Llama-style decoder layer whose attention projections read `2H` (the RMS-normalised
    embedding and hidden, concatenated) and whose residual is the hidden stream, a final
    RMSNorm and an LM head over the draft vocabulary. Rotary positions from `position_ids`
    (rotate-half convention, `rotate_half`).

    TTT attention (the reference's `cache_hidden`): step 0 is causal attention within the
    slot's document over the step-0 keys/values; step k > 0 attends, in one softmax, to the
    same step-0 keys/values (slots s <= t of the document) and to the keys/values that slot
    t itself produced at steps 1..k (its own draft chain: one score each, the "diagonal").
    Queries and keys of step k are rotated at `position + k`. Keys/values keep their
    gradients across steps, as the reference's cache does.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        aux_hidden_size: int,
        rope_theta: float = ROPE_THETA,
    ) -> None:
        super().__init__()
        check_heads(hidden_size, num_heads)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.fc = nn.Linear(aux_hidden_size, hidden_size, bias=False)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.embed.weight.requires_grad_(False)  # EAGLE-3 keeps the target's embedding frozen
        self.input_norm = nn.RMSNorm(hidden_size, eps=_RMS_NORM_EPS)  # the token embedding
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=_RMS_NORM_EPS)  # the hidden stream
        self.q_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_norm = nn.RMSNorm(hidden_size, eps=_RMS_NORM_EPS)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=_RMS_NORM_EPS)
        self.head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.rope_theta = rope_theta

    @property
    def aux_hidden_size(self) -> int:
        return self.fc.in_features

    @property
    def vocab_size(self) -> int:
        return self.embed.num_embeddings

    @property
    def draft_vocab_size(self) -> int:
        return self.head.out_features

    def _heads(self, x: Tensor) -> Tensor:
        rows, length, _ = x.shape
        return x.view(rows, length, self.num_heads, -1).transpose(1, 2)  # [R, heads, L, d]

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin `[R, 1, L, d/2]` of the rotary angles, computed in fp32 (fp64 for an fp64 drafter)."""
        width = self.hidden_size // self.num_heads
        exponents = torch.arange(0, width, 2, dtype=_work_dtype(dtype), device=positions.device) / width
        cos, sin = rope_tables(positions, self.rope_theta**-exponents, dtype)
        return cos[:, None], sin[:, None]  # broadcast over the heads

    def forward(
        self, input_ids: Tensor, hidden_states: Tensor, document_ids: Tensor, position_ids: Tensor, steps: int
    ) -> list[Tensor]:
        """The output hidden states `[R, L, H]` of each of `steps` TTT steps (teacher forcing:
        step k reads token `t + k + 1`, or token 0 where that slot lies in another document or
        past the row). `hidden_states [R, L, A·H_policy]`; padding slots (document -1) are
        zeroed before use."""
        real = document_ids >= 0
        dtype = self.fc.weight.dtype
        hidden = self.fc(torch.where(real[..., None], hidden_states.to(dtype), 0.0))
        positions = torch.where(real, position_ids, 0)
        length = input_ids.shape[1]
        index = torch.arange(length, device=input_ids.device)
        allowed = (document_ids[:, :, None] == document_ids[:, None, :]) & (index[None, :] <= index[:, None])
        allowed = allowed[:, None]  # [R, 1, L, L]: causal, within one document (padding with padding)
        scale = 1.0 / math.sqrt(self.hidden_size // self.num_heads)
        k0 = v0 = None
        chain_k: list[Tensor] = []
        chain_v: list[Tensor] = []
        outputs = []
        for step in range(steps):
            ids = torch.where(same_document(document_ids, step + 1), shift_left(input_ids, step + 1, 0), 0)
            q, k, v = self._qkv(ids, hidden, positions + step)
            if step == 0:
                k0, v0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            scores = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [R, heads, L, L]
            scores = scores.masked_fill(~allowed, float("-inf"))
            diagonal = [(q * kk).sum(-1, keepdim=True) * scale for kk in chain_k]  # [R, heads, L, 1] each
            probs = torch.cat([scores, *diagonal], -1).softmax(-1, dtype=_work_dtype(dtype)).to(dtype)
            attn = torch.matmul(probs[..., :length], v0)
            for i, vv in enumerate(chain_v):
                attn = attn + probs[..., length + i : length + i + 1] * vv
            hidden = self._output(hidden, attn)
            outputs.append(hidden)
        return outputs

    def _qkv(self, ids: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries and keys and the values `[R, heads, L, d]` of the decoder layer's
        input `[norm(embed(ids)), norm(hidden)]` (`ids`, `positions [R, L]`, `hidden [R, L, H]`)."""
        dtype = self.fc.weight.dtype
        x = torch.cat([self.input_norm(self.embed(ids).to(dtype)), self.hidden_norm(hidden)], -1)
        cos, sin = self._rope(positions, dtype)
        q = rotate_half(self._heads(self.q_proj(x)), cos, sin)
        return q, rotate_half(self._heads(self.k_proj(x)), cos, sin), self._heads(self.v_proj(x))

    def _output(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """The layer's output `[R, L, H]`: the residual `hidden` plus the attention output
        `attn [R, heads, L, d]` projected, then the MLP."""
        rows, length = hidden.shape[:2]
        out = hidden + self.o_proj(attn.transpose(1, 2).reshape(rows, length, self.hidden_size))
        mlp_in = self.post_norm(out)
        return out + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))

    def context(self, ids: Tensor, hidden_states: Tensor, slots: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """Step 0 at inference over `W` slots a row (`slots [R, W]`, the slot index is the
        position): slot t reads token `ids[:, w]` (`x_{t+1}`) and the policy's auxiliary
        hidden states `hidden_states [R, W, A·H]` (`h_t`). Its keys and values go to slot t
        of the step-0 cache `[2, R, heads, C, d]` and it attends to the cache's slots up to
        t. Returns the outputs `[R, W, H]` and the cache."""
        dtype = self.fc.weight.dtype
        hidden = self.fc(hidden_states.to(dtype))
        q, k, v = self._qkv(ids, hidden, slots)
        index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        cache = torch.stack([cache[0].scatter(2, index, k), cache[1].scatter(2, index, v)])
        visible = torch.arange(cache.shape[-2], device=slots.device) <= slots[..., None]  # [R, W, C]
        scores = torch.matmul(q, cache[0].transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = scores.masked_fill(~visible[:, None], -math.inf).softmax(-1, dtype=_work_dtype(dtype)).to(dtype)
        return self._output(hidden, torch.matmul(probs, cache[1])), cache

    def chain(
        self, ids: Tensor, previous: Tensor, slot: Tensor, step: int, cache: Tensor, chain: list[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """Draft step `step >= 1` at inference for the chain of slot `slot [R]`: the input
        is token `ids [R]` (the previous step's draft) and the previous step's output
        `previous [R, H]`, rotated at `slot + step`; it attends to the step-0 cache's slots
        up to `slot` and to the keys/values of its chain's steps 1..step (`chain`: the
        earlier steps' `[2, R, heads, 1, d]`). Returns the output `[R, H]` and the chain with
        this step's keys/values appended."""
        dtype = self.fc.weight.dtype
        q, k, v = self._qkv(ids[:, None], previous[:, None], (slot + step)[:, None])
        chain = [*chain, torch.stack([k, v])]
        scale = 1.0 / math.sqrt(q.shape[-1])
        visible = torch.arange(cache.shape[-2], device=slot.device) <= slot[:, None]  # [R, C]
        scores = (torch.matmul(q, cache[0].transpose(-1, -2)) * scale).masked_fill(~visible[:, None, None], -math.inf)
        diagonal = [(q * kv[0]).sum(-1, keepdim=True) * scale for kv in chain]
        probs = torch.cat([scores, *diagonal], -1).softmax(-1, dtype=_work_dtype(dtype)).to(dtype)
        length = cache.shape[-2]
        attn = torch.matmul(probs[..., :length], cache[1])
        for i, kv in enumerate(chain):
            attn = attn + probs[..., length + i : length + i + 1] * kv[1]
        return self._output(previous[:, None], attn)[:, 0], chain

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits of output hidden states `[..., H] -> [..., V_draft]`."""
        return self.head(self.norm(hidden))

    def step_logits(self, batch: DraftBatch, steps: int) -> list[Tensor]:
        """`[R, L, V_draft]` per step: slot t of step k predicts token `t + k + 2` (eager helper)."""
        outputs = self(batch.input_ids, batch.hidden_states, batch.document_ids, batch.position_ids, steps)
        return [self.logits(h) for h in outputs]


class Eagle3Runtime(DraftRuntimeBase):
    """The EAGLE-3 TTT runtime (ref §11.3): `draft_loss(batch, n_slots)` over a `DraftBatch`.

    `draft_vocab` maps the teacher to the draft vocabulary (None: the draft vocabulary is
    the policy's); `dp_group` sums each step's denominator over data-parallel ranks.
    """

    def __init__(
        self,
        config: Eagle3Config,
        drafter: Eagle3Drafter,
        aux_layers: tuple[int, ...],
        draft_vocab: DraftVocab | None = None,
        dp_group: Any = None,
    ) -> None:
        super().__init__(config.loss_weight, aux_layers, dp_group)
        if draft_vocab is not None:
            if draft_vocab.size != drafter.draft_vocab_size:
                raise ValueError(
                    f"d2t maps {draft_vocab.size} draft ids but the drafter's head has "
                    f"{drafter.draft_vocab_size} (draft_vocab_size)"
                )
            draft_vocab.check_vocab(drafter.vocab_size)
        elif drafter.draft_vocab_size != drafter.vocab_size:
            raise ValueError(
                f"a draft vocabulary of {drafter.draft_vocab_size} ids (the policy's has {drafter.vocab_size}) "
                "needs a d2t map"
            )
        self.drafter, self.config, self.draft_vocab = drafter, config, draft_vocab

    # `SpeculativeDrafter`: a chain of γ steps from the last committed slot over a step-0 cache of
    # every committed slot; the state is (the step-0 cache, the output at each row's last slot)

    def prefill(
        self, ids: Tensor, lengths: Tensor, first: Tensor, aux: Tensor, *, cache_len: int, pad: int
    ) -> DrafterState:
        """Step 0 over the prompts' slots (token `x_{t+1}` at slot t, `first` after the last)."""
        rows, prompt = ids.shape
        slot = torch.arange(prompt, device=ids.device)
        last = lengths - 1  # the slot of each prompt's last token
        drafter = self.drafter
        after = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad)], 1)  # x_{t+1} at slot t
        after = torch.where(slot == last[:, None], first[:, None], after)
        heads = drafter.num_heads
        shape = (2, rows, heads, cache_len, drafter.hidden_size // heads)
        empty = torch.zeros(shape, dtype=drafter.fc.weight.dtype, device=ids.device)
        out, cache = drafter.context(after, aux, slot.expand(rows, prompt), empty)
        return cache, out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def propose(self, state: DrafterState, pos: Tensor, uniforms: Tensor, sample: Sample) -> tuple[Tensor, Tensor]:
        """The chain: each step's draft the next step's token."""
        drafter, target_ids = self.drafter, None if self.draft_vocab is None else self.draft_vocab.target_ids
        cache, out = state
        slot, chain, drafts, lqs = pos - 1, [], [], []
        for k in range(uniforms.shape[1]):
            if k:
                out, chain = drafter.chain(drafts[-1], out, slot, k, cache, chain)
            draft, lq = sample(drafter.logits(out), target_ids, uniforms[:, k])
            drafts.append(draft)
            lqs.append(lq)
        return torch.stack(drafts, 1), torch.stack(lqs, 1)

    def commit(self, state: DrafterState, emitted: Tensor, aux: Tensor, pos: Tensor, accepted: Tensor) -> DrafterState:
        """Step 0 over the round's slots; the output at the last one kept."""
        index = torch.arange(emitted.shape[1], device=pos.device)
        out, cache = self.drafter.context(emitted, aux, pos[:, None] + index, state[0])
        return cache, out.gather(1, accepted[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def draft_loss(self, batch: DraftBatch, n_slots: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
        """The TTT loss of one micro-batch, divided by `n_slots`, and its metrics (0-d
        tensors; `@k` num/den pairs sum across micro-batches and ranks):
        `draft_ttt_loss_{num,den}@k` (masked KL sum, local supervised count),
        `draft_full_acc_{num,den}@k` (argmax agreement with the teacher on supervised slots),
        `draft_cond_acc_{num,den}@k` (the same among slots whose steps < k all agreed) and
        `draft_loss` (the returned loss, detached)."""
        check_draft_batch(batch, n_slots, self.drafter.aux_hidden_size, self.drafter.vocab_size)
        cfg, steps = self.config, self.config.ttt_steps
        ids, documents = batch.input_ids, batch.document_ids
        rows, length = ids.shape
        total = rows * length
        teacher = draft_vocab_logits(batch.teacher_logits.detach(), self.draft_vocab)
        teacher = teacher.reshape(total, -1)  # slot t's teacher row predicts token t + 1
        with torch.no_grad():
            teacher_negent = vocab_reduce(teacher, entropy=True, chunk_size=cfg.token_chunk_size).negent  # Σ p log p
            teacher_top = teacher.argmax(-1)
        supervised = batch.loss_mask.detach() > 0
        outputs = self.drafter(ids, batch.hidden_states.detach(), documents, batch.position_ids, steps)

        nums, dens, full_num, cond_num, cond_den = [], [], [], [], []
        agreed = None  # running AND of argmax agreement along each slot's chain
        for k, out in enumerate(outputs):
            n = total - k - 1  # flattened slots whose teacher row t + k + 1 exists (the rest are unsupervised)
            # token t + k + 2 is in slot t's document and supervised (both shifts stay inside it)
            in_doc = same_document(documents, k + 2)
            mask = (shift_left(supervised, k + 2, False) & in_doc).reshape(total)[:n]
            logits = self.drafter.logits(out.reshape(total, -1)[:n])  # [n, V_draft]
            stats = vocab_reduce(logits, teacher=teacher[k + 1 :], chunk_size=cfg.token_chunk_size)
            kl = stats.lse - stats.cross + teacher_negent[k + 1 :]
            nums.append(torch.where(mask, kl, 0.0).sum())
            dens.append(mask.sum().float())
            match = (logits.detach().argmax(-1) == teacher_top[k + 1 :]) & in_doc.reshape(total)[:n]
            prev = torch.ones_like(mask) if agreed is None else agreed[:n]
            full_num.append((mask & match).sum().float())
            cond_num.append((mask & prev & match).sum().float())
            cond_den.append((mask & prev).sum().float())
            agreed = prev & match

        den_global = all_reduce_sum(torch.stack(dens) + EAGLE3_LOSS_DEN_EPS, self.dp_group).detach()
        loss = sum(cfg.ttt_step_loss_decay**k * nums[k] / den_global[k] for k in range(steps)) / n_slots
        metrics: dict[str, Tensor] = {}
        for k in range(steps):
            metrics[f"draft_ttt_loss_num@{k}"] = nums[k].detach()
            metrics[f"draft_ttt_loss_den@{k}"] = dens[k]
            metrics[f"draft_full_acc_num@{k}"] = full_num[k]
            metrics[f"draft_full_acc_den@{k}"] = dens[k]
            metrics[f"draft_cond_acc_num@{k}"] = cond_num[k]
            metrics[f"draft_cond_acc_den@{k}"] = cond_den[k]
        metrics["draft_loss"] = loss.detach()
        return loss, metrics


def build_eagle3_runtime(
    config: Eagle3Config,
    policy_model_config: Any,
    policy_embedding_weight: Tensor | None = None,
    d2t: Tensor | DraftVocab | None = None,
    dp_group: Any = None,
    *,
    policy_head_weight: Tensor | None = None,
) -> Eagle3Runtime:
    """An `Eagle3Runtime` for a policy described by `policy_model_config` (any object with
    `vocab_size`, `hidden_size`, `num_layers`, `num_heads` and optionally `mlp_ratio`,
    `dtype`; e.g. `compiled_loss.config.ModelConfig`).

    `policy_embedding_weight [V, H]` is copied into the drafter's frozen embedding (else it
    is randomly initialised, still frozen); `policy_head_weight [V, H]` (optional)
    initialises the draft LM head from the policy head's rows of the draft vocabulary
    (`index_select(arange(V_draft) + d2t)`, as the reference's Megatron path does). `d2t`
    maps draft id i to target id `i + d2t[i]` (checked once, here).
    """
    vocab, policy_hidden = policy_model_config.vocab_size, policy_model_config.hidden_size
    hidden = config.hidden_size or policy_hidden
    heads = config.num_heads or policy_model_config.num_heads
    intermediate = config.intermediate_size or getattr(policy_model_config, "mlp_ratio", 4) * hidden
    aux_layers = resolve_aux_layers(config.aux_layers, policy_model_config.num_layers)
    draft_vocab = resolve_draft_vocab(d2t, config.draft_vocab_size, vocab)
    draft_size = vocab if draft_vocab is None else draft_vocab.size
    drafter = Eagle3Drafter(
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        draft_vocab_size=draft_size,
        aux_hidden_size=len(aux_layers) * policy_hidden,
        rope_theta=config.rope_theta,
    )
    dtype = getattr(torch, getattr(policy_model_config, "dtype", "float32"))
    drafter.to(dtype)
    with torch.no_grad():
        if policy_embedding_weight is not None:
            if tuple(policy_embedding_weight.shape) != (vocab, hidden):
                raise ValueError(
                    f"policy_embedding_weight must be [{vocab}, {hidden}] (vocab_size, the drafter's hidden_size), "
                    f"got {tuple(policy_embedding_weight.shape)}"
                )
            drafter.embed.weight.copy_(policy_embedding_weight.detach())
        if policy_head_weight is not None:
            if tuple(policy_head_weight.shape) != (vocab, hidden):
                raise ValueError(
                    f"policy_head_weight must be [{vocab}, {hidden}], got {tuple(policy_head_weight.shape)}"
                )
            rows = torch.arange(draft_size) if draft_vocab is None else draft_vocab.target_ids.cpu()
            drafter.head.weight.copy_(policy_head_weight.detach().index_select(0, rows.to(policy_head_weight.device)))
    if policy_embedding_weight is not None:
        device = policy_embedding_weight.device
        drafter.to(device)
        if draft_vocab is not None and draft_vocab.target_ids.device != device:
            draft_vocab = dataclasses.replace(
                draft_vocab, d2t=draft_vocab.d2t.to(device), target_ids=draft_vocab.target_ids.to(device)
            )
    return Eagle3Runtime(config, drafter, aux_layers, draft_vocab, dp_group)
