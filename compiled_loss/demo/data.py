"""Synthetic data on a learnable, verifiable task, with everything each loss needs (no download).

The task: continue an arithmetic progression modulo `modulus`. A prompt is `BOS a, a+d, …`
(`prompt_terms_min`–`prompt_terms_max` terms, stride `d` in `[1, max_stride]`); the correct
response continues the progression until the sequence holds `total_terms` terms, then
`EOS`. A sampled response earns the fraction of the correct response's tokens (EOS
included) it reproduces at their positions, divided by the longer of the two: 1 for the
exact answer, less for a wrong token, a missing EOS or tokens past it.

Rows come from two sources:

- on-policy (`task_prompts`, then `compiled_loss.demo.sampler`): the policy samples
  `group_size` responses per prompt; `sampled_batch` turns them into rows with the
  sampler's own log-probs as `generation_logprobs`, `score` gives the rewards,
  `grpo_advantages` the group-relative advantages (NeMo-RL's baseline, leave-one-out and
  std-normalisation options), `preference_pairs` DPO's (best, worst) pair of each group;
  `correct_batch` holds the correct responses (supervised warm start);
- pre-made (`sample_batch`, for a value head — which cannot sample — the compile audit
  and tests): responses of long-tailed length (log-normal, clamped) drawn with a
  per-response error rate, so rewards vary within a group.

`rollout` annotates a batch for one loss family with model outputs: the previous policy's
log-probs from the policy being trained, the reference log-probs from the frozen
reference, and — where the batch has none of its own — the generation log-probs from the
reference too (standing in for the engine that sampled pre-made data), so ratios,
importance weights and KL terms are real. Token-indexed log-probs carry NeMo-RL's dummy 0
in column 0; DPO's reference log-probs are pre-rolled left by one (ref §1.2).
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from compiled_loss.config import TASK_SPECIAL_TOKENS, DataConfig, Family, LogprobConfig
from compiled_loss.inputs import OPD_FULL_TEACHER_PAYLOAD_FIELD, get_next_token_logprobs_from_logits
from compiled_loss.vocab import mask_out_neg_inf_logprobs

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


# ---- on-policy: prompts, correct responses, rewards, advantages, pairs ----------------------


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


def grpo_advantages(rewards: Tensor, group_size: int, *, leave_one_out: bool = False, normalize: bool = True) -> Tensor:
    """NeMo-RL's GRPO advantages `[n]` for rewards in consecutive groups of `group_size`
    (`calculate_baseline_and_std_per_prompt`, then `normalize_advantages_with_epsilon`):
    reward − the group's mean (`leave_one_out`: the mean of the OTHER responses, RLOO);
    `normalize` divides by the std of the same responses (+1e-6) where it is > 0. A group
    of one response gets advantage 0."""
    if group_size == 1:
        return torch.zeros_like(rewards)
    groups = rewards.double().view(-1, group_size)
    if leave_one_out:
        baseline = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
        square = (groups.square().sum(-1, keepdim=True) - groups.square()) / (group_size - 1)
    else:
        baseline = groups.mean(-1, keepdim=True).expand_as(groups)
        square = groups.square().mean(-1, keepdim=True).expand_as(groups)
    std = (square - baseline.square()).sqrt().nan_to_num(0.0)
    advantages = groups - baseline
    if normalize:
        advantages = torch.where(std > 0, advantages / (std + 1e-6), advantages)
    return advantages.reshape(-1).to(rewards.dtype)


def preference_pairs(batch: dict[str, Tensor], group_size: int) -> dict[str, Tensor]:
    """DPO rows from sampled groups: each group's best and worst response by reward
    (chosen, rejected; the first of equals), interleaved; a pair whose rewards tie gets
    `sample_mask` 0."""
    rewards = batch["rewards"].view(-1, group_size)
    base = torch.arange(len(rewards)) * group_size
    best, worst = base + rewards.argmax(-1), base + rewards.argmin(-1)
    order = torch.stack([best, worst], 1).reshape(-1)
    pairs = {k: v[order] for k, v in batch.items() if k not in ("advantages", "generation_logprobs")}
    tied = (rewards.amax(-1) == rewards.amin(-1)).repeat_interleave(2)
    pairs["sample_mask"] = torch.where(tied, 0.0, pairs["sample_mask"])
    return pairs


# ---- pre-made rows ---------------------------------------------------------------------------


def _response_length(cfg: DataConfig, rng: random.Random) -> int:
    length = round(cfg.response_median * math.exp(rng.gauss(0.0, cfg.response_sigma)))
    return max(1, min(cfg.response_max, length))


def sample_batch(
    cfg: DataConfig, vocab_size: int, rng: random.Random, pairs: bool = False, clean: bool = False
) -> dict[str, Tensor]:
    """One global batch of pre-made task sequences (long-tailed lengths, see the module
    docstring).

    Rows come in groups of `group_size` responses per prompt (or, with `pairs`, one
    (chosen, rejected) pair per prompt: a correct and a corrupted response; with `clean`,
    every response is correct — supervised demonstrations). Returns
    `input_ids`, `input_lengths`, `token_mask` (response tokens and EOS), `sample_mask`,
    `rewards` (the fraction of correct response tokens) and GRPO `advantages` `[B, S]`.
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
    reward = torch.tensor(rewards)
    advantages = grpo_advantages(reward, per_prompt)
    return {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(rows)),
        "rewards": reward,
        "advantages": advantages[:, None].expand(-1, width).contiguous(),
    }


def replica_rows(batch: dict[str, Tensor], replicas: int, replica: int) -> dict[str, Tensor]:
    """A data-parallel replica's contiguous share of a global batch's rows (whole prompts'
    groups when `data.prompts` divides by `replicas`)."""
    rows = batch["input_ids"].shape[0] // replicas
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}


# ---- model outputs ---------------------------------------------------------------------------


@torch.no_grad()
def _forward(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    rows, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(rows, width)
    return model(input_ids, positions, torch.zeros_like(input_ids), full_vocab=True).float()


def model_logprobs(
    model: torch.nn.Module, input_ids: Tensor, sampling: LogprobConfig | None = None, filtered: bool = True
) -> Tensor:
    """`[B, S]` log-probs of each token given its prefix, 0 in column 0 (ref §1.2), of the
    logits divided by `sampling.temperature` and (`filtered`) under its top-k / top-p
    filter: what the loss computes, so ratios start at 1."""
    logits = _forward(model, input_ids)
    params = None
    if sampling is not None:
        logits = logits / sampling.temperature
        params = sampling.sampling_params() if filtered else None
    lp = get_next_token_logprobs_from_logits(input_ids, logits, sampling_params=params)
    return torch.nn.functional.pad(lp, (1, 0))


def rollout(
    batch: dict[str, Tensor],
    family: Family,
    *,
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    teacher: torch.nn.Module | None = None,
    topk: int = 16,
    sampling: LogprobConfig | None = None,
) -> dict[str, Tensor]:
    """Annotate a batch with the model outputs `family`'s loss reads (no gradients).

    With `sampling` (the run's `logprob` config) the log-probs are taken as the loss takes
    them: temperature-scaled, the policy's under the top-k / top-p filter (filtered tokens
    and positions outside the token mask 0), the reference's unfiltered (the reference KL
    reads the unfiltered current log-probs, ref §5.1). A batch that carries its own
    `generation_logprobs` (sampled on-policy) keeps them."""
    out = dict(batch)
    ids = batch["input_ids"]
    if family == "policy_gradient":
        prev = model_logprobs(policy, ids, sampling)
        out["prev_logprobs"] = mask_out_neg_inf_logprobs(prev, batch["token_mask"]) if sampling else prev
        reference_lp = model_logprobs(reference, ids, sampling, filtered=False)
        out.setdefault("generation_logprobs", reference_lp)
        out["reference_policy_logprobs"] = reference_lp
    elif family == "dpo":
        out["reference_policy_logprobs"] = torch.roll(model_logprobs(reference, ids, sampling, filtered=False), -1, 1)
    elif family == "distillation":
        if teacher is None:
            raise ValueError("rollout(family='distillation') needs a teacher model")
        top = torch.topk(_forward(teacher, ids), topk, dim=-1)
        out["teacher_topk_logits"], out["teacher_topk_indices"] = top.values, top.indices
    elif family == "opd_full":  # on-policy distillation: the teacher's full logits; the reference for β != 0
        if teacher is None:
            raise ValueError("rollout(family='opd_full') needs a teacher model")
        out[OPD_FULL_TEACHER_PAYLOAD_FIELD] = _forward(teacher, ids)
        out["reference_policy_logprobs"] = model_logprobs(reference, ids, sampling, filtered=False)
    elif family == "value":
        out["values"] = _forward(policy, ids).squeeze(-1)
        out["returns"] = batch["rewards"][:, None] * batch["token_mask"]
    elif family not in ("nll", "cross_tokenizer"):  # cross-tokenizer teachers: `compiled_loss.demo.cross_tokenizer`
        raise ValueError(f"unknown loss family {family!r}")
    return out
