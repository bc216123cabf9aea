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
n_slots` with `den_k = all_reduce_dp(Σ mask_k + 1e-5)`, the KL in fp32 through
`vocab_reduce` (`KL = lse - Σ p_teacher·x + Σ p_teacher log p_teacher`). Every shift stays
inside one document (`document_ids`), so one packed row of several sequences and the
unpacked rows of the same sequences give the same loss, metrics and gradients; padding
slots (document -1) are zeroed before any math and reach nothing.

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

from compiled_loss.checks import FLOAT32, check_factor, check_fields, require
from compiled_loss.draft.runtime import DraftBatch, DraftRuntimeBase, aux_layers_default
from compiled_loss.parallel.collectives import all_reduce_sum
from compiled_loss.vocab import DraftVocab, map_teacher_logits_to_draft_vocab, vocab_reduce

Tensor = torch.Tensor

_DEN_EPS = 1e-5  # the reference's `loss_den_k = Σ mask + 1e-5`
_NO_DOCUMENT = -2  # fill of shifted document ids: equals no document (and not padding's -1)


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
    """Policy decoder layers (0-based) whose outputs feed the drafter (None: `aux_layers_default`)."""
    rope_theta: float = 10000.0
    """Base of the drafter's rotary position embedding; > 0."""

    def __post_init__(self) -> None:
        if isinstance(self.aux_layers, list):  # a Hydra / YAML list
            object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        check_fields(self)
        require(self.loss_weight >= 0, f"loss_weight must be >= 0, got {self.loss_weight}")
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
        check_factor("loss_weight", self.loss_weight, "it scales the draft loss")
        for name in ("hidden_size", "num_heads", "intermediate_size", "draft_vocab_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{name} must be >= 1 (or None), got {value}")
        require(self.token_chunk_size >= 1, f"token_chunk_size must be >= 1, got {self.token_chunk_size}")
        require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        layers = self.aux_layers
        require(
            layers is None
            or (
                isinstance(layers, tuple)
                and len(layers) > 0
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
            ),
            f"aux_layers must be None or a non-empty tuple of ints >= 0, got {layers!r}",
        )
        if self.hidden_size is not None and self.num_heads is not None:
            require(
                self.hidden_size % self.num_heads == 0,
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})",
            )

    def resolve_aux_layers(self, num_layers: int) -> tuple[int, ...]:
        """The auxiliary layers for a policy of `num_layers` decoder layers."""
        layers = aux_layers_default(num_layers) if self.aux_layers is None else self.aux_layers
        require(
            all(i < num_layers for i in layers),
            f"aux_layers {layers} must name decoder layers of the policy, [0, {num_layers})",
        )
        return layers


def _shift_left(x: Tensor, offset: int, fill: float | int) -> Tensor:
    """`x[:, t + offset]` at slot t along dim 1, `fill` past the end (static shape)."""
    length = x.shape[1]
    if offset >= length:
        return torch.full_like(x, fill)
    tail = torch.full((x.shape[0], offset, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, offset:], tail], 1)


def _same_document(document_ids: Tensor, offset: int) -> Tensor:
    """`[R, L]` bool: slot `t + offset` exists in the row and belongs to slot t's document
    (never for a padding slot). Documents are contiguous, so every slot in between does too."""
    return (_shift_left(document_ids, offset, _NO_DOCUMENT) == document_ids) & (document_ids >= 0)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the softmax and the rotary angles: fp32, or fp64 for an fp64 drafter."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half form) of `x [R, heads, L, d]` with `cos, sin [R, 1, L, d/2]`."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 draft model: `fc` over the concatenated auxiliary hidden states
    (`A·H_policy → H`), a frozen token embedding `[V, H]` over the policy's vocabulary, ONE
    Llama-style decoder layer whose attention projections read `2H` (the RMS-normalised
    embedding and hidden, concatenated) and whose residual is the hidden stream, a final
    RMSNorm and an LM head over the draft vocabulary. Rotary positions from `position_ids`.

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
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        if hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"hidden_size ({hidden_size}) must split into num_heads ({num_heads}) heads of an even width"
            )
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.fc = nn.Linear(aux_hidden_size, hidden_size, bias=False)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.embed.weight.requires_grad_(False)  # EAGLE-3 keeps the target's embedding frozen
        self.input_norm = nn.RMSNorm(hidden_size, eps=1e-6)  # the token embedding
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=1e-6)  # the hidden stream
        self.q_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
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
        work = _work_dtype(dtype)
        width = self.hidden_size // self.num_heads
        inv_freq = self.rope_theta ** (-torch.arange(0, width, 2, dtype=work, device=positions.device) / width)
        angles = positions.to(work)[:, None, :, None] * inv_freq
        return angles.cos().to(dtype), angles.sin().to(dtype)

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
            ids = torch.where(_same_document(document_ids, step + 1), _shift_left(input_ids, step + 1, 0), 0)
            x = torch.cat([self.input_norm(self.embed(ids).to(dtype)), self.hidden_norm(hidden)], -1)
            cos, sin = self._rope(positions + step, dtype)
            q = _rotate(self._heads(self.q_proj(x)), cos, sin)
            k = _rotate(self._heads(self.k_proj(x)), cos, sin)
            v = self._heads(self.v_proj(x))
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
            rows = attn.shape[0]
            out = hidden + self.o_proj(attn.transpose(1, 2).reshape(rows, length, self.hidden_size))
            mlp_in = self.post_norm(out)
            out = out + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
            outputs.append(out)
            hidden = out
        return outputs

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

    def _check(self, batch: DraftBatch, n_slots: int) -> None:
        """Static (trace-time) shape checks, raised on the host."""
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
        ids = batch.input_ids
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [R, L], got shape {tuple(ids.shape)}")
        rows, length = ids.shape
        expected = {
            "hidden_states": (rows, length, self.drafter.aux_hidden_size),
            "teacher_logits": (rows, length, self.drafter.vocab_size),
            "loss_mask": (rows, length),
            "document_ids": (rows, length),
            "position_ids": (rows, length),
        }
        for name, shape in expected.items():
            value = getattr(batch, name)
            if value is None or tuple(value.shape) != shape:
                got = None if value is None else tuple(value.shape)
                raise ValueError(f"DraftBatch.{name} must have shape {shape}, got {got}")

    def draft_loss(self, batch: DraftBatch, n_slots: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
        """The TTT loss of one micro-batch, divided by `n_slots`, and its metrics (0-d
        tensors; `@k` num/den pairs sum across micro-batches and ranks):
        `draft_ttt_loss_{num,den}@k` (masked KL sum, local supervised count),
        `draft_full_acc_{num,den}@k` (argmax agreement with the teacher on supervised slots),
        `draft_cond_acc_{num,den}@k` (the same among slots whose steps < k all agreed) and
        `draft_loss` (the returned loss, detached)."""
        self._check(batch, n_slots)
        cfg, steps = self.config, self.config.ttt_steps
        ids, documents = batch.input_ids, batch.document_ids
        rows, length = ids.shape
        total = rows * length
        teacher = map_teacher_logits_to_draft_vocab(batch.teacher_logits.detach(), self.draft_vocab)
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
            in_doc = _same_document(documents, k + 2)
            mask = (_shift_left(supervised, k + 2, False) & in_doc).reshape(total)[:n]
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

        den_global = all_reduce_sum(torch.stack(dens) + _DEN_EPS, self.dp_group).detach()
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
    require(hidden % heads == 0, f"hidden_size ({hidden}) must be divisible by num_heads ({heads})")
    intermediate = config.intermediate_size or getattr(policy_model_config, "mlp_ratio", 4) * hidden
    aux_layers = config.resolve_aux_layers(policy_model_config.num_layers)
    draft_vocab = None if d2t is None else (d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t))
    draft_size = config.draft_vocab_size or (draft_vocab.size if draft_vocab is not None else vocab)
    if draft_vocab is not None:
        require(
            draft_vocab.size == draft_size,
            f"draft_vocab_size ({draft_size}) must equal the size of the d2t map ({draft_vocab.size})",
        )
        draft_vocab.check_vocab(vocab)
    else:
        require(
            draft_size == vocab,
            f"draft_vocab_size ({draft_size}) differs from the policy's vocabulary ({vocab}): pass a d2t map",
        )
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
