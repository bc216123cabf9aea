"""DraftLossWrapper behaves as NeMo-RL code expects beyond its signature: it combines the
policy loss it RECEIVED, builds its draft loss through the module-level name NeMo-RL's
tests patch, and checks `d2t` once rather than with a host sync per call."""

from __future__ import annotations

import torch
from common import HostSyncs

import compiled_loss.wrapper
from compiled_loss.loss_functions import DraftCrossEntropyLossFn
from compiled_loss.vocab import DraftVocab
from compiled_loss.wrapper import DraftLossWrapper

D2T = torch.tensor([0, 2, 4, 5, 6])  # draft index i -> target id i + d2t[i]: [0, 3, 6, 8, 10]


def _packed_case(policy_loss_fn, loss_weight=0.5, d2t=D2T):
    torch.manual_seed(0)
    cu, cup = (0, 5, 8), (0, 6, 10)
    data = {"token_mask": torch.tensor([[0.0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]), "sample_mask": torch.ones(2)}
    student = torch.randn(1, 10, 5, requires_grad=True)
    wrapper = DraftLossWrapper(
        policy_loss_fn,
        None,
        data,
        loss_weight=loss_weight,
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cup,
        d2t=d2t,
        student_logits=student,
    )
    return wrapper, data, torch.randn(1, 10, 11, requires_grad=True)


def _policy_without_loss_metric(logits, data, g_seqs, g_toks):
    """A policy loss function whose metrics carry no "loss" key."""
    loss = 0.25 * logits.sum() / g_toks
    return loss, {"policy_metric": loss.detach() * 2}


def test_total_loss_is_the_received_policy_loss_plus_weighted_draft_loss():
    wrapper, data, logits = _packed_case(_policy_without_loss_metric)
    g_seqs, g_toks = torch.tensor(2.0), torch.tensor(5.0)
    loss, metrics = wrapper(logits, data, g_seqs, g_toks)
    policy, _ = _policy_without_loss_metric(logits, data, g_seqs, g_toks)
    assert metrics["draft_loss"] > 0
    torch.testing.assert_close(loss, policy + 0.5 * metrics["draft_loss"])
    torch.testing.assert_close(metrics["total_loss"], loss.detach())
    assert "loss" not in metrics and "policy_metric" in metrics


def test_zero_weight_still_reports_draft_and_total_loss():
    wrapper, data, logits = _packed_case(_policy_without_loss_metric, loss_weight=0.0)
    loss, metrics = wrapper(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    policy, _ = _policy_without_loss_metric(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    assert metrics["draft_loss"] > 0
    torch.testing.assert_close(metrics["total_loss"], policy.detach())
    torch.testing.assert_close(loss, policy)


def test_draft_loss_is_built_through_the_patchable_module_name(monkeypatch):
    built = []

    class Recorder(DraftCrossEntropyLossFn):
        def __init__(self, *args, **kwargs):
            built.append((args, kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(compiled_loss.wrapper, "DraftCrossEntropyLossFn", Recorder)
    wrapper = DraftLossWrapper(_policy_without_loss_metric, lambda **kw: ({}, kw["data"]), {}, token_chunk_size=7)
    assert built == [((), {"vocab_parallel_group": None, "token_chunk_size": 7})]
    assert isinstance(wrapper.draft_loss_fn, Recorder)


def test_d2t_is_checked_once_not_per_call(monkeypatch):
    builds = []
    build = DraftVocab.build
    monkeypatch.setattr(DraftVocab, "build", staticmethod(lambda d2t: builds.append(1) or build(d2t)))
    wrapper, data, logits = _packed_case(_policy_without_loss_metric)
    with HostSyncs() as syncs:
        for _ in range(3):
            wrapper(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    assert (len(builds), syncs.calls) == (1, [])


def test_d2t_outside_the_target_vocabulary_fails_at_the_first_call():
    wrapper, data, logits = _packed_case(_policy_without_loss_metric, d2t=torch.tensor([0, 2, 4, 5, 7]))
    try:
        wrapper(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    except ValueError as e:
        assert str(e) == "d2t maps draft index 4 to target id 11 outside the target vocabulary [0, 11) (1 such entries)"
    else:
        raise AssertionError("no error")
