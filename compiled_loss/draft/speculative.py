"""What a draft runtime implements to propose tokens to a speculative sampler
(`compiled_loss.app.speculative`): `SpeculativeDrafter`.

The sampler owns the policy, its cache, the acceptance test and the randomness; the
drafter owns its state between rounds (a tuple of tensors, static-shaped, carried through
the compiled round):

- `prefill` sets the state up from the prompts the policy prefilled and each row's first
  token;
- `propose` drafts `γ` tokens after each row's last token, drawing each with the sampler's
  `sample` (its distribution on the policy's vocabulary and the draft's uniforms);
- `commit` writes the round's verified slots into the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

Tensor = torch.Tensor

DrafterState = tuple[Tensor, ...]
"""A drafter's state between rounds (the tensors its `prefill` made, its `commit` updates)."""

Sample = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, Tensor]]
"""`sample(logits, target_ids, uniforms) -> (tokens, logp)`: draw from draft-vocabulary
`logits` `[R, ..., V_draft]` (`target_ids`: the policy ids of the draft vocabulary, None when
they are the policy's) with `uniforms` `[R, ...]`: the draws (policy ids) and their
distribution's log-probs `[R, ..., V]` on the policy's vocabulary."""


def to_policy_vocab(logits: Tensor, target_ids: Tensor | None, vocab: int) -> Tensor:
    """Draft-vocabulary logits `[..., V_draft]` on the policy's vocabulary `[..., V]` (`-inf`
    at the ids the draft vocabulary lacks)."""
    if target_ids is None:
        return logits
    return logits.new_full((*logits.shape[:-1], vocab), -math.inf).index_copy(-1, target_ids, logits)


@runtime_checkable
class SpeculativeDrafter(Protocol):
    """A co-trained drafter a speculative sampler proposes with (see the module docstring).
    Positions: a row's last token `y` is at `pos`; `aux` is the policy's auxiliary hidden
    states (its `aux_layers`) of the slots it just processed."""

    aux_layers: tuple[int, ...]

    def prefill(
        self, ids: Tensor, lengths: Tensor, first: Tensor, aux: Tensor, *, cache_len: int, pad: int
    ) -> DrafterState:
        """The state after the policy prefilled the prompts `ids` `[R, P]` (`lengths` tokens,
        padded with `pad`; `aux` `[R, P, A·H]`) and drew each row's first token `first` `[R]`,
        for caches of `cache_len` slots."""
        ...

    def propose(self, state: DrafterState, pos: Tensor, uniforms: Tensor, sample: Sample) -> tuple[Tensor, Tensor]:
        """The drafts `[R, γ]` after each row's token at `pos` and their distributions'
        log-probs `[R, γ, V]`, each drawn by `sample` with its `uniforms` `[R, γ]`."""
        ...

    def commit(self, state: DrafterState, emitted: Tensor, aux: Tensor, pos: Tensor, accepted: Tensor) -> DrafterState:
        """The state with the round's slots `pos .. pos + γ` written: the tokens `emitted`
        `[R, γ + 1]` after them and the policy's `aux` of them, `accepted` `[R]` drafts kept."""
        ...
