"""The on-policy task: prompts and their correct responses, rewards from sampled tokens, and
the rows a sampled batch becomes."""

from __future__ import annotations

import random

import pytest
import torch

from compiled_loss.config import DataConfig
from compiled_loss.demo.data import (
    BOS,
    EOS,
    FIRST_VALUE,
    PAD,
    correct_batch,
    sampled_batch,
    score,
    task_prompts,
)

DATA = DataConfig(modulus=10, prompt_terms_min=2, prompt_terms_max=3, total_terms=5, max_stride=2)


def _prompts(count: int = 4, seed: int = 0):
    return task_prompts(DATA, 64, random.Random(seed), count)


def test_prompts_and_their_correct_responses():
    p = _prompts(8)
    assert p.input_ids.shape == (8, 4) and p.targets.shape == (8, 4)  # BOS + 3 terms; 5 - 2 terms + EOS
    for ids, length, target, target_length in zip(p.input_ids, p.lengths, p.targets, p.target_lengths):
        terms = (ids[1:length] - FIRST_VALUE).tolist() + (target[: target_length - 1] - FIRST_VALUE).tolist()
        assert ids[0] == BOS and len(terms) == DATA.total_terms and target[target_length - 1] == EOS
        stride = (terms[1] - terms[0]) % DATA.modulus
        assert all((b - a) % DATA.modulus == stride for a, b in zip(terms, terms[1:])) and 1 <= stride <= 2
        assert (ids[length:] == PAD).all() and (target[target_length:] == PAD).all()


def test_rewards_count_correct_tokens_and_eos_over_the_longer_response():
    p = _prompts(8)
    row = int((p.lengths == 4).nonzero()[0, 0])  # a prompt of 3 terms: 2 tokens and EOS, 1 slot to spare
    p = p.rows(slice(row, row + 1))
    target, n = p.targets[0], int(p.target_lengths[0])
    wrong = FIRST_VALUE + (int(target[0]) - FIRST_VALUE + 1) % DATA.modulus

    def reward(tokens: list[int]) -> float:
        padded = torch.tensor(tokens + [PAD] * (p.targets.shape[1] - len(tokens)))[None]
        return float(score(p, padded, torch.tensor([len(tokens)])))

    exact = target[:n].tolist()
    assert reward(exact) == 1.0
    assert reward([wrong] + exact[1:]) == pytest.approx((n - 1) / n)
    assert reward(exact[:-1]) == pytest.approx((n - 1) / n)  # EOS missing (the bucket ended)
    assert reward(exact[:-1] + [exact[0], EOS]) == pytest.approx((n - 1) / (n + 1))  # one token too many
    assert reward([EOS]) == 0.0


def _sampled(prompts, tokens: list[list[int]]):
    width = prompts.targets.shape[1]
    padded = torch.tensor([t + [PAD] * (width - len(t)) for t in tokens])
    lengths = torch.tensor([len(t) for t in tokens])
    logprobs = torch.where(padded != PAD, -0.5, 0.0)
    rewards = score(prompts, padded, lengths)
    return sampled_batch(prompts, padded, lengths, logprobs, rewards, rewards - rewards.mean())


def test_sampled_rows_hold_prompt_response_and_the_samplers_logprobs():
    p = _prompts(2).repeat(2)
    exact = [p.targets[i, : p.target_lengths[i]].tolist() for i in range(4)]
    batch = _sampled(p, [exact[0], exact[1][:2], exact[2], [EOS]])
    for row in range(4):
        length, prompt, total = int(batch["input_lengths"][row]), int(p.lengths[row]), len(batch["input_ids"][row])
        assert batch["input_ids"][row, :prompt].tolist() == p.input_ids[row, :prompt].tolist()
        assert batch["token_mask"][row].tolist() == [0.0] * prompt + [1.0] * (length - prompt) + [0.0] * (
            total - length
        )
        assert (batch["generation_logprobs"][row] == torch.where(batch["token_mask"][row] > 0, -0.5, 0.0)).all()
        assert (batch["input_ids"][row, length:] == PAD).all()
    assert batch["rewards"].tolist()[0] == 1.0 and batch["advantages"].shape == batch["input_ids"].shape
    correct = correct_batch(p)
    assert torch.equal(correct["input_ids"][0], batch["input_ids"][0]) and (correct["rewards"] == 1).all()
