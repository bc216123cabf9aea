"""On-policy generation: a compiled sampler over the embedded LM's static key/value cache.

Shapes are fixed up front (gpt-fast's way): `rows` prompts right-padded to the prompt
bucket `P` (`prompt_width`), and `R` (`response_width`) response slots in a cache of
`P + R` positions. One compiled graph runs the prompts (`TinyLM.prefill`) and picks each
row's first token; one more runs a decoding step (`TinyLM.decode`: the previous token's
keys and values written to its row's slot, attention over the slots before it) and picks
the next. The decoding graph is called `R - 1` times per batch with the same shapes, so
both compile once per run; rows that ended (EOS, or the bucket's end) keep running and
emit PAD. Measured on 2 CPU cores (the default run's 128 rows of the tiny model, P = 9,
R = 14, Inductor): a batch takes 53 ms over the cache against 392 ms recomputing every
position at each step (a static `[rows, P + R]` forward per token), so the sampler keeps
the cache.

Each token is drawn by inverse CDF from the logits divided by `logprob.temperature` under
the `logprob.top_k` / `logprob.top_p` filter — the distribution the loss's log-probs
describe — with one uniform per row and step that the caller supplies
(`sampling_uniforms`: a function of the seed, the step and the row's index in the global
batch, so a data-parallel replica draws the rows a single process would, and a resumed
run draws what an uninterrupted one did). The sampler returns its own log-probs of the
tokens it drew: a trainer's `generation_logprobs`.

A diverged policy (NaN or inf in a row's logits) has no distribution to draw from: the
compiled draw keeps every id inside the vocabulary and marks the row's log-prob NaN, and
the host raises `FloatingPointError` once the batch's tokens are back (no further sync).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from compiled_loss.config import Config
from compiled_loss.demo.data import EOS, PAD, Prompts, prompt_width, response_width
from compiled_loss.demo.hf import Policy
from compiled_loss.train import CompileRecorder, compile_loss
from compiled_loss.vocab import sampling_threshold

Tensor = torch.Tensor


def sampling_uniforms(seed: int, step: int, rows: int, slots: int) -> Tensor:
    """`[rows, slots]` uniforms in [0, 1) for step `step` of a run seeded `seed` (rows in
    the global batch's order)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.rand(rows, slots, generator=generator)


def log_probs(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float) -> Tensor:
    """`[..., V]` fp32 log-probs of `softmax(logits / temperature)` under the top-k / top-p
    filter (`-inf` at the filtered ids): the distribution the sampler draws from."""
    x = logits.float().flatten(0, -2) / temperature
    if (top_k is not None and top_k > 0) or top_p != 1.0:
        x = torch.where(x >= sampling_threshold(x, top_k, top_p)[:, None], x, float("-inf"))
    return torch.log_softmax(x, -1).view(logits.shape)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One id per row of `probs [..., V]` (any non-negative weights) by inverse CDF with
    `uniforms [...]` in [0, 1); a row that is not finite gets an id inside the vocabulary."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]  # the largest point below the total keeps the draw on an id of positive weight
    point = torch.minimum(uniforms[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # a NaN / inf row has a NaN cdf: searchsorted answers V there, one past the vocabulary
    return torch.searchsorted(cdf, point, right=True).clamp(max=probs.shape[-1] - 1)[..., 0]


def _pick(
    logits: Tensor, uniforms: Tensor, *, temperature: float, top_k: int | None, top_p: float, alive: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row `[R]` drawn by inverse CDF with `uniforms [R]` from
    `softmax(logits / temperature)` under the top-k / top-p filter, its log-prob, and which
    rows are still alive after it. Rows no longer `alive` get PAD and log-prob 0; a row
    whose logits are not finite gets an id inside the vocabulary and log-prob NaN."""
    logp = log_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = draw(logp.exp(), uniforms)
    picked = torch.where(logp.exp().sum(-1).isfinite(), logp.gather(-1, tokens[:, None])[:, 0], float("nan"))
    return torch.where(alive, tokens, PAD), torch.where(alive, picked, 0.0), alive & (tokens != EOS)


def _first(model: Policy, input_ids: Tensor, lengths: Tensor, uniforms: Tensor, *, cache_len: int, pick):
    """Prefill the prompts and draw each row's first response token."""
    logits, cache = model.prefill(input_ids, lengths, cache_len)
    tokens, logprobs, alive = pick(logits, uniforms, alive=torch.ones_like(lengths, dtype=torch.bool))
    return tokens, logprobs, alive, lengths, cache


def _next(model: Policy, tokens: Tensor, positions: Tensor, alive: Tensor, cache: Tensor, uniforms: Tensor, *, pick):
    """Feed each row's last token (at `positions`) and draw the next."""
    logits, cache = model.decode(tokens, positions, cache)
    tokens, logprobs, alive = pick(logits, uniforms, alive=alive)
    return tokens, logprobs, alive, positions + 1, cache


def check_finite(logprobs: Tensor, step: int | None) -> None:
    """`FloatingPointError` naming the first row and response slot whose sampled log-prob
    `logprobs [n, R]` (on the host) is NaN: the policy's logits there were not finite."""
    diverged = logprobs.isnan()
    if diverged.any():  # host
        row, slot = diverged.nonzero()[0].tolist()  # host
        who = "Sampler" if step is None else f"Sampler (step {step})"
        raise FloatingPointError(
            f"{who}: the policy's logits for row {row} at response slot {slot} are not finite (NaN or inf): "
            "the policy has diverged, there is no distribution to sample from"
        )


@dataclasses.dataclass(frozen=True)
class Samples:
    """Sampled responses: `tokens [n, R]` (PAD after the end), the sampler's `logprobs
    [n, R]` of them (0 after the end) and `lengths [n]` (EOS included when drawn)."""

    tokens: Tensor
    logprobs: Tensor
    lengths: Tensor


class Sampler:
    """`sampler(prompts, uniforms) -> Samples` for `rows` prompts of the task (see the module
    docstring); compiled as the run's `compile` group says (`recorder` reports it)."""

    def __init__(self, cfg: Config, model: Policy, rows: int) -> None:
        self.model, self.rows = model, rows
        self.prompt_len, self.response_len = prompt_width(cfg.data), response_width(cfg.data)
        lp = cfg.logprob
        pick = functools.partial(_pick, temperature=lp.temperature, top_k=lp.top_k, top_p=lp.top_p)
        first = functools.partial(_first, cache_len=self.prompt_len + self.response_len, pick=pick)
        step = functools.partial(_next, pick=pick)
        c = cfg.compile
        self.recorder = CompileRecorder(c.backend, "sampler", c.mode) if c.enabled else None
        if self.recorder is not None:
            first = compile_loss(first, recorder=self.recorder, fullgraph=c.fullgraph, dynamic=False)
            step = compile_loss(step, recorder=self.recorder, fullgraph=c.fullgraph, dynamic=False)
        self._first, self._next = first, step

    @property
    def compiles(self) -> int:
        return self.recorder.report.compiles if self.recorder else 0

    @torch.no_grad()
    def __call__(self, prompts: Prompts, uniforms: Tensor, *, step: int | None = None) -> Samples:
        """Sample a response to each prompt; `FloatingPointError` when the policy's logits
        are not finite (a diverged policy), naming the training `step` when given."""
        if tuple(prompts.input_ids.shape) != (self.rows, self.prompt_len):
            raise ValueError(
                f"Sampler takes {self.rows} prompts of width {self.prompt_len}, got {tuple(prompts.input_ids.shape)}"
            )
        device = next(self.model.parameters()).device
        columns = [u.clone() for u in uniforms.to(device).t()]  # one contiguous [rows] tensor per slot
        tokens, logprobs, alive, positions, cache = self._first(
            self.model, prompts.input_ids.to(device), prompts.lengths.to(device), columns[0]
        )
        drawn, drawn_logprobs = [tokens], [logprobs]
        for column in columns[1:]:
            tokens, logprobs, alive, positions, cache = self._next(self.model, tokens, positions, alive, cache, column)
            drawn.append(tokens)
            drawn_logprobs.append(logprobs)
        tokens_nr, logprobs_nr = torch.stack(drawn, 1).cpu(), torch.stack(drawn_logprobs, 1).cpu()
        check_finite(logprobs_nr, step)
        ended = tokens_nr == EOS
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, self.response_len)
        return Samples(tokens_nr, logprobs_nr, lengths)
