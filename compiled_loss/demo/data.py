"""The synthetic task: learnable, verifiable, with no download.

The task: continue an arithmetic progression modulo `modulus`. A prompt is `BOS a, a+d, …`
(`prompt_terms_min`–`prompt_terms_max` terms, stride `d` in `[1, max_stride]`); the correct
response continues the progression until the sequence holds `total_terms` terms, then
`EOS`. A sampled response earns the fraction of the correct response's tokens (EOS
included) it reproduces at their positions, divided by the longer of the two: 1 for the
exact answer, less for a wrong token, a missing EOS or tokens past it.

Rows come from two sources:

- on-policy (`task_prompts`, then `compiled_loss.app.sampler`): the policy samples
  `group_size` responses per prompt; `sampled_batch` turns them into rows with the
  sampler's own log-probs as `generation_logprobs`, `score` gives the rewards;
  `correct_batch` holds the correct responses (supervised warm start);
- pre-made (`premade_rows`, for a value head — which cannot sample — the compile audit
  and tests, through `compiled_loss.app.batches.sample_batch`): responses of long-tailed
  length (log-normal, clamped) drawn with a per-response error rate, so rewards vary
  within a group.

What a trainer adds to the rows — GRPO advantages, DPO pairs, the model outputs each loss
reads — is the application's (`compiled_loss.app.batches`).
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from compiled_loss.config import TASK_SPECIAL_TOKENS, DataConfig

Tensor = torch.Tensor

PAD, BOS, EOS = range(TASK_SPECIAL_TOKENS)
FIRST_VALUE = TASK_SPECIAL_TOKENS


def _check_vocab(cfg: DataConfig, vocab_size: int) -> None:
    if cfg.vocab_needed() > vocab_size:
        raise ValueError(
            f"data.modulus ({cfg.modulus}) + {TASK_SPECIAL_TOKENS} special tokens exceeds model.vocab_size "
            f"({vocab_size})"
        )


def _term(cfg: DataConfig, start: int, stride: int, i: int) -> int:
    return FIRST_VALUE + (start + i * stride) % cfg.modulus


# ---- on-policy: prompts, correct responses, rewards -------------------------------------------


def prompt_width(cfg: DataConfig) -> int:
    """The prompt bucket: BOS and the most prompt terms."""
    return 1 + cfg.prompt_terms_max


def response_width(cfg: DataConfig) -> int:
    """The response bucket: the longest correct response (after the shortest prompt) and EOS."""
    return cfg.total_terms - cfg.prompt_terms_min + 1


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Task prompts, right-padded with PAD: `input_ids [n, prompt_width]`, `lengths [n]`, and
    their correct responses `targets [n, response_width]` (continuation and EOS, then PAD),
    `target_lengths [n]` (EOS included)."""

    input_ids: Tensor
    lengths: Tensor
    targets: Tensor
    target_lengths: Tensor

    def repeat(self, times: int) -> Prompts:
        """Each prompt `times` times in a row (a GRPO group per prompt)."""
        return Prompts(*(t.repeat_interleave(times, 0) for t in dataclasses.astuple(self)))

    def rows(self, index: slice) -> Prompts:
        return Prompts(*(t[index] for t in dataclasses.astuple(self)))


def task_prompts(cfg: DataConfig, vocab_size: int, rng: random.Random, count: int) -> Prompts:
    """`count` prompts of the task and their correct responses."""
    _check_vocab(cfg, vocab_size)
    width, response = prompt_width(cfg), response_width(cfg)
    ids, lengths, targets, target_lengths = [], [], [], []
    for _ in range(count):
        start, stride = rng.randrange(cfg.modulus), rng.randint(1, cfg.max_stride)
        terms = rng.randint(cfg.prompt_terms_min, cfg.prompt_terms_max)
        prompt = [BOS] + [_term(cfg, start, stride, i) for i in range(terms)]
        target = [_term(cfg, start, stride, i) for i in range(terms, cfg.total_terms)] + [EOS]
        ids.append(prompt + [PAD] * (width - len(prompt)))
        targets.append(target + [PAD] * (response - len(target)))
        lengths.append(len(prompt))
        target_lengths.append(len(target))
    return Prompts(torch.tensor(ids), torch.tensor(lengths), torch.tensor(targets), torch.tensor(target_lengths))


def _rows(prompts: Prompts, responses: Tensor, response_lengths: Tensor) -> dict[str, Tensor]:
    """Prompt + response rows `[n, P + R]` (responses PAD after their end), their lengths and
    the responses' token mask."""
    columns = prompts.lengths[:, None] + torch.arange(responses.shape[1])
    ids = torch.nn.functional.pad(prompts.input_ids, (0, responses.shape[1]), value=PAD).scatter(1, columns, responses)
    lengths = prompts.lengths + response_lengths
    index = torch.arange(ids.shape[1])
    token_mask = ((index >= prompts.lengths[:, None]) & (index < lengths[:, None])).float()
    return {"input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.ones(len(ids))}


def correct_batch(prompts: Prompts) -> dict[str, Tensor]:
    """The prompts with their correct responses (supervised demonstrations; reward 1)."""
    batch = _rows(prompts, prompts.targets, prompts.target_lengths)
    return {**batch, "rewards": torch.ones(len(prompts.lengths))}


def score(prompts: Prompts, responses: Tensor, response_lengths: Tensor) -> Tensor:
    """Rewards `[n]`: the correct response's tokens (EOS included) a response reproduces at
    their positions, over the longer of the two (responses `[n, R]`, PAD after their end;
    `response_lengths` count the EOS when one was sampled)."""
    index = torch.arange(responses.shape[1])
    correct = ((responses == prompts.targets) & (index < prompts.target_lengths[:, None])).sum(1)
    return correct / torch.maximum(response_lengths, prompts.target_lengths)


def sampled_batch(
    prompts: Prompts, responses: Tensor, response_lengths: Tensor, logprobs: Tensor, rewards: Tensor, advantages: Tensor
) -> dict[str, Tensor]:
    """Rows of sampled responses (`[n, R]` tokens and the sampler's log-probs, PAD / 0 after
    their end) with `rewards [n]`, `advantages` broadcast to `[n, S]` and the sampler's
    log-probs as `generation_logprobs [n, S]` (at each response token's column)."""
    batch = _rows(prompts, responses, response_lengths)
    width = batch["input_ids"].shape[1]
    columns = prompts.lengths[:, None] + torch.arange(responses.shape[1])
    generation = torch.zeros(len(responses), width).scatter(1, columns, logprobs.float())
    return {
        **batch,
        "rewards": rewards,
        "advantages": advantages[:, None].expand(-1, width).contiguous(),
        "generation_logprobs": generation,
    }


# ---- pre-made rows ---------------------------------------------------------------------------


def _response_length(cfg: DataConfig, rng: random.Random) -> int:
    length = round(cfg.response_median * math.exp(rng.gauss(0.0, cfg.response_sigma)))
    return max(1, min(cfg.response_max, length))


def premade_rows(
    cfg: DataConfig, vocab_size: int, rng: random.Random, pairs: bool = False, clean: bool = False
) -> dict[str, Tensor]:
    """One global batch of pre-made task sequences (long-tailed lengths, see the module
    docstring).

    Rows come in groups of `group_size` responses per prompt (or, with `pairs`, one
    (chosen, rejected) pair per prompt: a correct and a corrupted response; with `clean`,
    every response is correct — supervised demonstrations). Returns
    `input_ids`, `input_lengths`, `token_mask` (response tokens and EOS), `sample_mask` and
    `rewards` (the fraction of correct response tokens).
    """
    _check_vocab(cfg, vocab_size)
    rows: list[list[int]] = []
    prompt_lengths: list[int] = []
    rewards: list[float] = []
    per_prompt = 2 if pairs else cfg.group_size
    for _ in range(cfg.prompts):
        start, stride = rng.randrange(cfg.modulus), rng.randint(1, cfg.max_stride)
        terms = rng.randint(cfg.prompt_terms_min, cfg.prompt_terms_max)
        prompt = [BOS] + [_term(cfg, start, stride, i) for i in range(terms)]
        for j in range(per_prompt):
            if pairs:
                error_rate = 0.0 if j == 0 else 0.5 + 0.5 * rng.random()
            else:
                error_rate = 0.0 if clean else rng.uniform(0.0, cfg.error_rate_max)
            response, correct = [], 0
            for i in range(_response_length(cfg, rng)):
                token = _term(cfg, start, stride, terms + i)
                if rng.random() < error_rate:
                    token = FIRST_VALUE + rng.randrange(cfg.modulus)
                correct += token == _term(cfg, start, stride, terms + i)
                response.append(token)
            rows.append(prompt + response + [EOS])
            prompt_lengths.append(len(prompt))
            rewards.append(correct / len(response))
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    columns = torch.arange(width)
    in_response = columns[None, :] >= torch.tensor(prompt_lengths)[:, None]
    token_mask = (in_response & (columns[None, :] < lengths[:, None])).float()
    return {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(rows)),
        "rewards": torch.tensor(rewards),
    }
