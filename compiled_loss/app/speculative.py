"""Speculative sampling with the co-trained drafter: the policy's own distribution, fewer
policy forwards.

A round proposes `γ` (`run.speculative_tokens`) tokens after each row's last token `y`
(at position `pos`) with the drafter, verifies them in ONE policy forward of `γ + 1`
tokens (`TinyLM.extend`: `y` and the drafts, over the static key/value cache) and keeps
them by standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
draft `d_j`, drawn from the drafter's distribution `q_j`, is accepted with probability
`min(1, p_j(d_j) / q_j(d_j))` under the policy's distribution `p_j`; at the first
rejection the row draws from `max(0, p_j - q_j)` (normalised), and when all `γ` are
accepted it draws a bonus token from `p_γ`. Both distributions are the sampler's
(`logits / logprob.temperature` under the `logprob.top_k` / `logprob.top_p` filter), so
the tokens follow the policy's distribution exactly — at top_k=1 they are the greedy
tokens — and each token's log-prob is the policy's own, read from the verifying forward:
a trainer's `generation_logprobs`, as without speculation. A row gains `n + 1` tokens per
round (`n` accepted drafts): the acceptance length `τ` is their mean over the rows alive.

The drafters propose as they train, through the `SpeculativeDrafter` protocol
(`compiled_loss.draft.speculative`: `prefill`, `propose`, `commit`) each runtime implements:

- EAGLE-3 (`draft=eagle3`): a chain of `γ` steps from the last slot the policy processed
  (`Eagle3Drafter.chain`), each step's draft the next step's token, over a step-0 cache of
  every committed slot (`Eagle3Drafter.context`: token `x_{t+1}` and the policy's
  auxiliary hidden states `h_t`, written for the round's `γ + 1` slots after verification);
- DFlash (`draft=dflash`): one block forward at the anchor `y` over the auxiliary hidden
  states of the slots before it (`DFlashDrafter.forward` on the sampler's cache of them);
  block slots `1..γ` (`γ <= draft.block_size - 1`) give independent proposals.

Shapes are static: every row runs every round (a row that ended emits nothing), the caches
hold `P + R + γ + 1` slots, and the round is one compiled graph called until no row is
alive — the host reads one flag per round to stop, the sampler's only read before its
tokens come back. Randomness is one triple of uniforms per row and response slot (the
draft, the acceptance test, the residual or bonus draw; `speculative_uniforms`), read at
the slot a token would fill, so a data-parallel replica draws the rows a single process
would and a round's discarded drafts do not bias the next.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from compiled_loss.app.sampler import Samples, check_finite, draw, log_probs
from compiled_loss.config import Config
from compiled_loss.demo.data import EOS, PAD, Prompts, prompt_width, response_width
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft.speculative import DrafterState, Sample, SpeculativeDrafter, to_policy_vocab
from compiled_loss.train import CompileRecorder, compile_loss

Tensor = torch.Tensor

_DRAFT, _ACCEPT, _RESIDUAL = range(3)  # the uniforms of a response slot


def speculative_uniforms(seed: int, step: int, rows: int, slots: int) -> Tensor:
    """`[rows, slots, 3]` uniforms in [0, 1) for step `step` of a run seeded `seed`: per row
    (the global batch's order) and response slot, the draft's, the acceptance test's and the
    residual (or bonus) draw's."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.rand(rows, slots, 3, generator=generator)


@dataclasses.dataclass(frozen=True)
class SpeculativeSamples(Samples):
    """`Samples` and the rounds' counts: `tokens_per_round` (tokens the rows gained, summed
    over rows and rounds) and `row_rounds` (the rows alive in each round, summed)."""

    tokens_per_round: int
    row_rounds: int

    @property
    def tau(self) -> float:
        """The acceptance length: tokens per policy forward, over the rows alive."""
        return self.tokens_per_round / max(self.row_rounds, 1)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """A sampler's constants: `γ`, the caches' slots, the response slots, the output width and
    the log-probs of the sampling distribution (`log_probs` under the run's filter)."""

    gamma: int
    cache_len: int
    response: int
    width: int
    logp: Callable[[Tensor], Tensor]


class _Carry(NamedTuple):
    """What a round carries: the drafter's `state`, each row's last token `y` and its position
    `pos`, the response slots `filled`, `alive`, the policy's cache and the output `tokens` /
    `logprobs` `[R, R_resp + γ + 2]` (the last column takes the writes of what is not kept)."""

    state: DrafterState
    y: Tensor
    pos: Tensor
    filled: Tensor
    alive: Tensor
    cache: Any
    tokens: Tensor
    logprobs: Tensor


def _start(
    policy: TinyLM, runtime: SpeculativeDrafter, ids: Tensor, lengths: Tensor, uniforms: Tensor, *, settings: _Settings
) -> _Carry:
    """Prefill the prompts, draw each row's first token from the policy and set up the
    drafter's state (`SpeculativeDrafter.prefill`)."""
    rows = ids.shape[0]
    logits, cache, aux = policy.prefill(ids, lengths, settings.cache_len, runtime.aux_layers)
    lp = settings.logp(logits)
    y = draw(lp.exp(), uniforms[:, 0, _RESIDUAL])
    y_logp = lp.gather(-1, y[:, None])[:, 0]
    state = runtime.prefill(ids, lengths, y, aux, cache_len=settings.cache_len, pad=PAD)
    tokens = torch.full((rows, settings.width), PAD, dtype=ids.dtype, device=ids.device)
    tokens[:, 0] = y
    logprobs = torch.zeros(rows, settings.width, device=ids.device)
    logprobs[:, 0] = y_logp
    alive = (y != EOS) & (settings.response > 1)
    return _Carry(state, y, lengths.clone(), torch.ones_like(lengths), alive, cache, tokens, logprobs)


def _sampling(logp: Callable[[Tensor], Tensor], vocab: int) -> Sample:
    """`Sample` for the drafter: the draft distribution on the policy's vocabulary under the
    sampler's filter, and its draws."""

    def sample(logits: Tensor, target_ids: Tensor | None, u: Tensor) -> tuple[Tensor, Tensor]:
        lq = logp(to_policy_vocab(logits, target_ids, vocab))
        return draw(lq.exp(), u), lq

    return sample


def _round(
    policy: TinyLM, runtime: SpeculativeDrafter, carry: _Carry, uniforms: Tensor, *, settings: _Settings
) -> tuple[_Carry, Tensor, Tensor]:
    """One round for every row: propose, verify in one policy forward, accept. Returns the
    carried tensors (`_Carry`), the tokens each row gained `[R]` and the rows alive in it."""
    state, y, pos, filled, alive, cache, tokens, logprobs = carry
    gamma, logp = settings.gamma, settings.logp
    rows, width = tokens.shape
    response = width - gamma - 2
    vocab = policy.head.weight.shape[0]
    index = torch.arange(gamma + 1, device=y.device)
    slots = (filled[:, None] + index).clamp(max=width - 1)  # the response slot of the token at pos + 1 + j
    u = uniforms.gather(1, slots[..., None].expand(-1, -1, 3))  # [R, γ + 1, 3]
    drafts, lq = runtime.propose(state, pos, u[:, :gamma, _DRAFT], _sampling(logp, vocab))
    logits, cache, aux = policy.extend(torch.cat([y[:, None], drafts], 1), pos, cache, runtime.aux_layers)
    lp = logp(logits)  # [R, γ + 1, V]: position pos + 1 + j
    p, q = lp.exp(), torch.cat([lq.exp(), torch.zeros_like(lq[:, :1])], 1)  # q of the bonus draw: none
    p_draft = p[:, :gamma].gather(-1, drafts[..., None])[..., 0]
    q_draft = q[:, :gamma].gather(-1, drafts[..., None])[..., 0]
    accepted = (u[:, :gamma, _ACCEPT] * q_draft < p_draft).int().cumprod(1).sum(1)  # [R]: n
    at = accepted[:, None, None].expand(-1, 1, vocab)
    p_n, q_n = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)  # p = q to rounding: p itself
    bonus = draw(residual, u.gather(1, accepted[:, None, None].expand(-1, 1, 3))[:, 0, _RESIDUAL])
    emitted = torch.where(index == accepted[:, None], bonus[:, None], torch.cat([drafts, bonus[:, None]], 1))
    emitted_logp = lp.gather(-1, emitted[..., None])[..., 0]
    ends = (emitted == EOS) & (index <= accepted[:, None])
    gained = torch.minimum(accepted + 1, torch.where(ends.any(1), ends.int().argmax(1) + 1, gamma + 1))
    gained = torch.where(alive, torch.minimum(gained, response - filled), 0)
    kept = index < gained[:, None]
    where = torch.where(kept, filled[:, None] + index, width - 1)
    tokens = tokens.scatter(1, where, emitted)
    logprobs = logprobs.scatter(1, where, emitted_logp)
    ended = (ends & kept).any(1)
    was_alive = alive
    filled, alive = filled + gained, alive & ~ended & (filled + gained < response)
    state = runtime.commit(state, emitted, aux, pos, accepted)  # the slots pos .. pos + γ (committed up to pos + n)
    y = torch.where(was_alive, bonus, y)
    pos = pos + gained  # a row that ended stays where it is (gained < n + 1 ends it)
    return _Carry(state, y, pos, filled, alive, cache, tokens, logprobs), gained, was_alive


class SpeculativeSampler:
    """`sampler(prompts, uniforms) -> SpeculativeSamples` for `rows` prompts of the task with
    the policy `policy` (a `TinyLM`) and the co-trained drafter `runtime` (see the module
    docstring); compiled as the run's `compile` group says (`recorder` reports it).
    `uniforms`: `speculative_uniforms(seed, step, rows, response_width)`."""

    def __init__(self, cfg: Config, policy: TinyLM, runtime: SpeculativeDrafter, rows: int) -> None:
        if not isinstance(runtime, SpeculativeDrafter):  # the runtimes that implement it
            raise TypeError(
                f"SpeculativeSampler drafts with an Eagle3Runtime or a DFlashRuntime, not {type(runtime).__name__}"
            )
        self.policy, self.runtime, self.rows, self.gamma = policy, runtime, rows, cfg.run.speculative_tokens
        self.prompt_len, self.response_len = prompt_width(cfg.data), response_width(cfg.data)
        lp = cfg.logprob
        logp = functools.partial(log_probs, temperature=lp.temperature, top_k=lp.top_k, top_p=lp.top_p)
        cache_len = self.prompt_len + self.response_len + self.gamma + 1
        width = self.response_len + self.gamma + 2
        settings = _Settings(self.gamma, cache_len, self.response_len, width, logp)
        first = functools.partial(_start, settings=settings)
        step = functools.partial(_round, settings=settings)
        c = cfg.compile
        self.recorder = CompileRecorder(c.backend, "speculative sampler", c.mode) if c.enabled else None
        if self.recorder is not None:
            first = compile_loss(first, recorder=self.recorder, fullgraph=c.fullgraph, dynamic=False)
            step = compile_loss(step, recorder=self.recorder, fullgraph=c.fullgraph, dynamic=False)
        self._start, self._round = first, step

    @property
    def compiles(self) -> int:
        return self.recorder.report.compiles if self.recorder else 0

    @torch.no_grad()
    def __call__(self, prompts: Prompts, uniforms: Tensor, *, step: int | None = None) -> SpeculativeSamples:
        """Sample a response to each prompt; `FloatingPointError` when the policy's logits
        are not finite (a diverged policy), naming the training `step` when given."""
        want = (self.rows, self.response_len, 3)
        if tuple(prompts.input_ids.shape) != (self.rows, self.prompt_len) or tuple(uniforms.shape) != want:
            raise ValueError(
                f"SpeculativeSampler takes {self.rows} prompts of width {self.prompt_len} and uniforms {list(want)}, "
                f"got {tuple(prompts.input_ids.shape)} and {list(uniforms.shape)}"
            )
        device = next(self.policy.parameters()).device
        # response slots past the bucket (drafts a round cuts) read the last slot's uniforms
        uniforms = torch.cat([uniforms, uniforms[:, -1:].expand(-1, self.gamma + 2, -1)], 1).to(device)
        carry = self._start(
            self.policy, self.runtime, prompts.input_ids.to(device), prompts.lengths.to(device), uniforms
        )
        gained, rounds = [], []
        for _ in range(self.response_len - 1):
            if not carry.alive.any():  # host: the one read of a round
                break
            carry, got, was_alive = self._round(self.policy, self.runtime, carry, uniforms)
            gained.append(got)
            rounds.append(was_alive)
        tokens_nr = carry.tokens[:, : self.response_len].cpu()  # host
        logprobs_nr = carry.logprobs[:, : self.response_len].cpu()  # host
        check_finite(logprobs_nr, step)
        lengths = carry.filled.cpu()  # host
        counts = [int(torch.stack(c).sum()) for c in (gained, rounds)] if gained else [0, 0]  # host
        return SpeculativeSamples(tokens_nr, logprobs_nr, lengths, *counts)
