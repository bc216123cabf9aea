"""The registry of kinds (`compiled_loss.config.LOSS_KINDS`, `DRAFT_KINDS`): each runner
loss's `LossKind.fill` fills data keys its loss's `InputSpec` names, and the audit's lists
come from the registry."""

from __future__ import annotations

import random
import typing

import pytest
import torch

from compiled_loss.app import compose_config
from compiled_loss.app.batches import sample_batch
from compiled_loss.audit.cli import DRAFTS, LOSSES
from compiled_loss.config import DRAFT_KINDS, LOSS_KINDS, loss_kind, loss_names
from compiled_loss.config.losses import LOSS_PRESETS
from compiled_loss.interfaces import InputSpec


class _Outputs:
    """`ModelOutputs` of random tensors."""

    def __init__(self, ids: torch.Tensor, vocab: int) -> None:
        self.ids, self.vocab, self.topk = ids, vocab, 4

    def policy_logprobs(self) -> torch.Tensor:
        return -torch.rand(self.ids.shape)

    def reference_logprobs(self) -> torch.Tensor:
        return -torch.rand(self.ids.shape)

    def teacher_logits(self) -> torch.Tensor:
        return torch.randn(*self.ids.shape, self.vocab)

    def policy_outputs(self) -> torch.Tensor:
        return torch.randn(*self.ids.shape, 1)


@pytest.mark.parametrize("name", [cls().name for cls in LOSS_KINDS])
def test_a_kind_fills_the_keys_its_loss_reads(name):
    cfg = compose_config(f"loss={name}")
    kind = loss_kind(cfg.loss)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(0), pairs=kind.pairs, clean=kind.clean)
    filled = kind.fill(batch, _Outputs(batch["input_ids"], cfg.model.vocab_size))
    spec = InputSpec.of(cfg.loss_fn)
    hints = typing.get_type_hints(spec.data, include_extras=True)
    assert set(filled) - set(batch) <= set(hints)  # nothing the loss does not read
    assert set(batch) <= set(filled)  # the rows' own keys kept
    required = {key for key, hint in hints.items() if typing.get_origin(hint) is not typing.NotRequired}
    if kind.reward_shift:  # the driver's running mean, added per batch
        required.discard("reward_shift")
    if spec.opd_full is not None:  # read by the policy-gradient objective only
        required.discard("generation_logprobs")
    assert sorted(required - set(filled)) == []  # every key the loss requires, with the rows' own


def test_the_audit_lists_come_from_the_registry():
    assert LOSSES == tuple(loss_names())
    assert set(LOSSES) == {cls().name for cls in LOSS_KINDS} | {p for ps in LOSS_PRESETS.values() for p in ps}
    assert DRAFTS == tuple(cls().name for cls in DRAFT_KINDS)
