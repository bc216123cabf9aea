"""What the application adds to the task's rows: GRPO advantages (NeMo-RL's baseline,
leave-one-out and std-normalisation), DPO pairs from sampled groups, and pre-made batches
(the task's pre-made rows with each group's advantages)."""

from __future__ import annotations

import random

import pytest
import torch
from tolerances import close

from compiled_loss.app.batches import grpo_advantages, preference_pairs, sample_batch
from compiled_loss.config import DataConfig
from compiled_loss.demo.data import EOS, PAD, premade_rows, sampled_batch, score, task_prompts

DATA = DataConfig(modulus=10, prompt_terms_min=2, prompt_terms_max=3, total_terms=5, max_stride=2)


def _nemo_rl_advantages(rewards, group, leave_one_out, normalize):
    """`calculate_baseline_and_std_per_prompt` + `normalize_advantages_with_epsilon`, per group."""
    out = []
    for g in rewards.view(-1, group):
        mask = (torch.ones(group, group) - (torch.eye(group) if leave_one_out else 0)).double()
        if group <= 1:
            baseline, std = g, torch.zeros_like(g)
        else:
            n = group - int(leave_one_out)
            baseline, square = mask @ g / n, mask @ g.square() / n
            std = (square - baseline.square()).sqrt().nan_to_num(0)
        a = g - baseline
        if normalize:
            a = torch.where(std > 0, a / (std + 1e-6), a)
        out.append(a)
    return torch.cat(out)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_grpo_advantages_are_nemo_rls(leave_one_out, normalize, group):
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25, 0.7, 0.7, 0.7, 0.7], dtype=torch.float64)
    got = grpo_advantages(rewards, group, leave_one_out=leave_one_out, normalize=normalize)
    torch.testing.assert_close(
        got, _nemo_rl_advantages(rewards, group, leave_one_out, normalize), **close(torch.float64, "reordered")
    )
    if group == 4:
        # a group of equal rewards teaches nothing: float64 roundings of the mean, over std + 1e-6 (not a
        # table kind: the rounding is amplified by the epsilon)
        assert got[4:].abs().max() < 1e-9


def test_the_mean_baseline_normalised_is_the_z_score():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25])
    z = (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6)
    torch.testing.assert_close(grpo_advantages(rewards, 4), z)


def test_a_premade_batch_is_the_premade_rows_with_each_groups_advantages():
    for pairs, group in ((False, DATA.group_size), (True, 2)):
        batch = sample_batch(DATA, 64, random.Random(0), pairs=pairs)
        rows = premade_rows(DATA, 64, random.Random(0), pairs=pairs)
        assert list(batch) == [*rows, "advantages"] and all(torch.equal(batch[k], v) for k, v in rows.items())
        expected = grpo_advantages(rows["rewards"], group)[:, None].expand_as(rows["token_mask"])
        assert torch.equal(batch["advantages"], expected) and batch["advantages"].is_contiguous()


def _sampled(prompts, tokens: list[list[int]]):
    width = prompts.targets.shape[1]
    padded = torch.tensor([t + [PAD] * (width - len(t)) for t in tokens])
    lengths = torch.tensor([len(t) for t in tokens])
    rewards = score(prompts, padded, lengths)
    return sampled_batch(prompts, padded, lengths, torch.where(padded != PAD, -0.5, 0.0), rewards, rewards)


def test_dpo_pairs_are_each_groups_best_and_worst():
    p = task_prompts(DATA, 64, random.Random(0), 3).repeat(3)
    exact = [p.targets[i, : p.target_lengths[i]].tolist() for i in range(9)]
    tokens = [
        exact[0][:1],
        exact[1],
        [EOS],  # group 0: best row 1, worst row 2
        exact[3],
        exact[4],
        exact[5],  # group 1: all correct, a tie
        [EOS],
        exact[7][:2],
        exact[8],
    ]  # group 2: best row 8, worst row 6
    pairs = preference_pairs(_sampled(p, tokens), 3)
    assert pairs["input_ids"].shape[0] == 6
    assert pairs["rewards"].tolist()[0] == 1.0 and pairs["rewards"].tolist()[4] == 1.0
    assert pairs["rewards"][1] == pairs["rewards"][5] == 0.0
    assert pairs["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert "advantages" not in pairs and "generation_logprobs" not in pairs
