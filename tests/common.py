"""Shared test helpers (reference test fixtures, ref §12 conventions)."""

from __future__ import annotations

import math

import torch


def exact_logits(target_lp: torch.Tensor, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits `[B, S, V]` whose log-softmax at `input_ids[:, t+1]` equals `target_lp[:, t]`.

    As NeMo-RL's `_create_exact_logits`: fill -100, target logit 0 plus one distractor
    logit `log(exp(-lp) - 1)`; lp = 0 gives a target logit of 100.
    """
    rows, width = input_ids.shape
    logits = torch.full((rows, width, vocab), -100.0)
    for b in range(rows):
        for t in range(width - 1):
            token, lp = int(input_ids[b, t + 1]), float(target_lp[b, t])
            if lp == 0:
                logits[b, t, token] = 100.0
            else:
                logits[b, t, token] = 0.0
                logits[b, t, (token + 1) % vocab] = math.log(math.expm1(-lp))
    return logits


def clipped_pg_data(rows: int = 1, width: int = 4, vocab: int = 8) -> dict[str, torch.Tensor]:
    """NeMo-RL's `_setup_clipped_pg_test_data`: token_mask 1 except column 0, sample_mask
    1, advantages/prev/ref/gen zeros; tests write the masked positions `[:, 1:]`."""
    token_mask = torch.ones(rows, width)
    token_mask[:, 0] = 0
    return {
        "input_ids": torch.arange(rows * width).reshape(rows, width) % vocab,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.zeros(rows, width),
        "prev_logprobs": torch.zeros(rows, width),
        "generation_logprobs": torch.zeros(rows, width),
        "reference_policy_logprobs": torch.zeros(rows, width),
    }
