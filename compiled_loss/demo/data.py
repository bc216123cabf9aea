"""Synthetic RL data on a learnable task, with everything each loss needs (no download).

The task: continue an arithmetic progression modulo `modulus`. A prompt is `BOS a, a+d, …`
(a few terms, stride `d` in `[1, max_stride]`); the correct response continues it and ends
with `EOS`. Response lengths are
long-tailed (log-normal, clamped). Responses are "sampled" with a per-response error rate
(each token is wrong with that probability), so rewards — the fraction of correct
response tokens — vary within a GRPO group.

`rollout` then annotates a batch for one loss family with model outputs: the previous
policy's log-probs come from the policy being trained, the generation and reference
log-probs from a frozen reference copy of its initial weights (standing in for the
inference engine that sampled the data), so ratios, importance weights and KL terms are
real. Token-indexed log-probs carry NeMo-RL's dummy 0 in column 0; DPO's reference
log-probs are pre-rolled left by one (ref §1.2).
"""

from __future__ import annotations

import math
import random

import torch

from compiled_loss.config import TASK_SPECIAL_TOKENS, DataConfig, Family
from compiled_loss.inputs import get_next_token_logprobs_from_logits

Tensor = torch.Tensor

PAD, BOS, EOS = range(TASK_SPECIAL_TOKENS)
FIRST_VALUE = TASK_SPECIAL_TOKENS


def _response_length(cfg: DataConfig, rng: random.Random) -> int:
    length = round(cfg.response_median * math.exp(rng.gauss(0.0, cfg.response_sigma)))
    return max(1, min(cfg.response_max, length))


def sample_batch(
    cfg: DataConfig, vocab_size: int, rng: random.Random, pairs: bool = False, clean: bool = False
) -> dict[str, Tensor]:
    """One global batch of task sequences.

    Rows come in groups of `group_size` responses per prompt (or, with `pairs`, one
    (chosen, rejected) pair per prompt: a correct and a corrupted response; with `clean`,
    every response is correct — supervised demonstrations). Returns
    `input_ids`, `input_lengths`, `token_mask` (response tokens and EOS), `sample_mask`,
    `rewards` and group-normalised `advantages` `[B, S]`.
    """
    if cfg.vocab_needed() > vocab_size:
        raise ValueError(
            f"data.modulus ({cfg.modulus}) + {TASK_SPECIAL_TOKENS} special tokens exceeds model.vocab_size "
            f"({vocab_size})"
        )
    rows: list[list[int]] = []
    prompt_lengths: list[int] = []
    rewards: list[float] = []
    per_prompt = 2 if pairs else cfg.group_size
    for _ in range(cfg.prompts):
        start, stride = rng.randrange(cfg.modulus), rng.randint(1, cfg.max_stride)
        terms = rng.randint(cfg.prompt_terms_min, cfg.prompt_terms_max)
        prompt = [BOS] + [FIRST_VALUE + (start + i * stride) % cfg.modulus for i in range(terms)]
        for j in range(per_prompt):
            if pairs:
                error_rate = 0.0 if j == 0 else 0.5 + 0.5 * rng.random()
            else:
                error_rate = 0.0 if clean else rng.uniform(0.0, cfg.error_rate_max)
            response, correct = [], 0
            for i in range(_response_length(cfg, rng)):
                token = FIRST_VALUE + (start + (terms + i) * stride) % cfg.modulus
                if rng.random() < error_rate:
                    token = FIRST_VALUE + rng.randrange(cfg.modulus)
                correct += token == FIRST_VALUE + (start + (terms + i) * stride) % cfg.modulus
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
    groups = reward.view(cfg.prompts, per_prompt)
    centred = groups - groups.mean(-1, keepdim=True)
    advantages = (centred / (groups.std(-1, keepdim=True, correction=0) + 1e-6)).reshape(-1)
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


@torch.no_grad()
def _forward(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    rows, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(rows, width)
    return model(input_ids, positions, torch.zeros_like(input_ids), full_vocab=True).float()


def _token_logprobs(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    """`[B, S]` log-probs of each token given its prefix, 0 in column 0 (ref §1.2)."""
    lp = get_next_token_logprobs_from_logits(input_ids, _forward(model, input_ids))
    return torch.nn.functional.pad(lp, (1, 0))


def rollout(
    batch: dict[str, Tensor],
    family: Family,
    *,
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    teacher: torch.nn.Module | None = None,
    topk: int = 16,
) -> dict[str, Tensor]:
    """Annotate a batch with the model outputs `family`'s loss reads (no gradients)."""
    out = dict(batch)
    ids = batch["input_ids"]
    if family == "policy_gradient":
        out["prev_logprobs"] = _token_logprobs(policy, ids)
        reference_lp = _token_logprobs(reference, ids)
        out["generation_logprobs"] = reference_lp
        out["reference_policy_logprobs"] = reference_lp
    elif family == "dpo":
        out["reference_policy_logprobs"] = torch.roll(_token_logprobs(reference, ids), -1, 1)
    elif family == "distillation":
        if teacher is None:
            raise ValueError("rollout(family='distillation') needs a teacher model")
        top = torch.topk(_forward(teacher, ids), topk, dim=-1)
        out["teacher_topk_logits"], out["teacher_topk_indices"] = top.values, top.indices
    elif family == "value":
        out["values"] = _forward(policy, ids).squeeze(-1)
        out["returns"] = batch["rewards"][:, None] * batch["token_mask"]
    elif family != "nll":
        raise ValueError(f"unknown loss family {family!r}")
    return out
