"""Reference acceptance checks for the draft wrappers and their layout utilities.

Ports the CPU-applicable checks of the behaviour reference:
- §12.2 `test_draft_loss_wrapper.py` (DraftLossWrapper, roll_packed_seq_dim,
  pack_rolled_draft_token_mask, packed == unpacked draft loss); the mocked tensor-parallel
  test is replaced by a hand-computed soft cross-entropy and gradient check.
- §12.3 `test_draft_runtime_loss_wrapper.py` (upstream variant, no `draft_loss_scale`).
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from common import cumsum, pack_rows, padding_slots
from tolerances import close

from compiled_loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, DraftCrossEntropyLossFn
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.utils import pack_rolled_draft_token_mask, roll_packed_seq_dim
from compiled_loss.wrapper import DraftLossWrapper, DraftRuntimeLossWrapper, wrap_loss_fn_with_input_preparation


def _soft_ce(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Per-row H(softmax(teacher), log_softmax(student)) in float64."""
    p = torch.softmax(teacher.double(), -1)
    return -(p * torch.log_softmax(student.double(), -1)).sum(-1)


# ---------------------------------------------------------------------------------------
# §12.2 DraftLossWrapper
# ---------------------------------------------------------------------------------------


def _fake_draft(value: float):
    calls = []

    def __call__(self, **kwargs):
        calls.append(kwargs)
        return torch.tensor(value)

    return __call__, calls


def test_draft_loss_wrapper_combines_policy_and_draft_loss(monkeypatch):
    fake, calls = _fake_draft(2.0)
    monkeypatch.setattr(DraftCrossEntropyLossFn, "__call__", fake)
    data = {"token_mask": torch.ones(1, 2)}
    seen = []

    def policy_loss_fn(logits, data, gs, gt):
        seen.append((logits, gs, gt))
        return torch.tensor(3.0), {"loss": torch.tensor(3.0), "policy_metric": torch.tensor(1.0)}

    def prepare_fn(**kwargs):
        return {"prepared": torch.tensor(1.0)}, kwargs["data"]

    wrapper = DraftLossWrapper(policy_loss_fn, prepare_fn, data, loss_weight=0.5)
    logits = torch.randn(1, 2, 3)
    g = torch.tensor(1)
    loss, metrics = wrapper(logits, data, g, g)

    assert loss.item() == 4.0
    assert metrics["draft_loss"].item() == 2.0
    assert metrics["total_loss"].item() == 4.0
    assert metrics["policy_metric"].item() == 1.0
    assert metrics["loss"].item() == 3.0
    assert metrics["draft_loss"].dim() == 0 and metrics["total_loss"].dim() == 0
    # the draft loss got the prepared inputs and the POLICY denominators
    assert len(calls) == 1 and calls[0]["prepared"].item() == 1.0
    assert calls[0]["global_valid_toks"] is g and calls[0]["global_valid_seqs"] is g
    assert seen[0][0] is logits


def test_draft_loss_wrapper_reports_draft_loss_when_weight_is_zero(monkeypatch):
    fake, _ = _fake_draft(1.5)
    monkeypatch.setattr(DraftCrossEntropyLossFn, "__call__", fake)
    data = {}
    wrapper = DraftLossWrapper(
        lambda *a: (torch.tensor(5.0), {"loss": torch.tensor(5.0)}),
        lambda **kw: ({}, kw["data"]),
        data,
        loss_weight=0.0,
    )
    loss, metrics = wrapper(torch.randn(1, 2, 3), data, torch.tensor(1), torch.tensor(1))
    assert loss.item() == 5.0
    assert metrics["draft_loss"].item() == 1.5
    assert metrics["total_loss"].item() == 5.0


def test_draft_loss_wrapper_validation():
    policy = lambda *a: (torch.tensor(0.0), {"loss": torch.tensor(0.0)})  # noqa: E731
    with pytest.raises(ValueError, match="student_logits"):
        DraftLossWrapper(policy, None, {}, cu_seqlens_q=(0, 4), cu_seqlens_q_padded=(0, 4))
    with pytest.raises(ValueError, match="defer_normalization"):
        DraftLossWrapper(
            policy, None, {}, cu_seqlens_q=(0, 4), student_logits=torch.zeros(1, 4, 3), defer_normalization=True
        )
    with pytest.raises(ValueError, match="prepare_fn"):
        DraftLossWrapper(policy, None, {})
    wrapper = DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=None), {})
    with pytest.raises(ValueError, match="global_valid_toks"):
        wrapper(torch.zeros(1, 2, 3), {}, torch.tensor(1), None)


@pytest.mark.parametrize("chunk", [4096, 3])
def test_draft_cross_entropy_matches_hand_soft_ce(chunk):
    """Replaces the mocked TP-path test: value and gradient against a hand soft-CE."""
    torch.manual_seed(3)
    teacher = torch.randn(2, 5, 7) * 2
    student = (torch.randn(2, 5, 7) * 2).requires_grad_()
    token_mask = torch.tensor([[1.0, 0, 1, 1, 0], [1, 1, 1, 0, 1]])
    sample_mask = torch.tensor([1.0, 0.0])
    g_t = torch.tensor(7.0)

    loss = DraftCrossEntropyLossFn(token_chunk_size=chunk)(
        teacher_logits=teacher,
        student_logits=student,
        token_mask=token_mask,
        data={"sample_mask": sample_mask},
        global_valid_seqs=torch.tensor(1.0),
        global_valid_toks=g_t,
    )
    mask = token_mask * sample_mask[:, None]
    expected = (mask.double() * _soft_ce(teacher, student.detach())).sum() / 7.0
    assert loss.dim() == 0
    torch.testing.assert_close(loss.double(), expected, **close(torch.float32, "same"))
    assert loss.item() > 0

    loss.backward()
    q = torch.softmax(student.detach().double(), -1)
    p = torch.softmax(teacher.double(), -1)
    expected_grad = (q - p) * mask.double()[..., None] / 7.0
    torch.testing.assert_close(student.grad.double(), expected_grad, **close(torch.float32, "reordered"))
    assert torch.all(student.grad[1] == 0)  # sample_mask 0 row

    # normalisation is by the given G_t, not the mask count: doubling G_t halves the loss
    loss2 = DraftCrossEntropyLossFn(token_chunk_size=chunk)(
        teacher_logits=teacher,
        student_logits=student.detach(),
        token_mask=token_mask,
        data={"sample_mask": sample_mask},
        global_valid_seqs=None,
        global_valid_toks=14.0,
    )
    torch.testing.assert_close(loss2.double(), expected / 2, **close(torch.float32, "same"))


def test_draft_cross_entropy_teacher_gets_no_gradient():
    torch.manual_seed(4)
    teacher = torch.randn(1, 3, 5, requires_grad=True)
    student = torch.randn(1, 3, 5, requires_grad=True)
    loss = DraftCrossEntropyLossFn()(
        teacher_logits=teacher,
        student_logits=student,
        token_mask=torch.ones(1, 3),
        data={"sample_mask": torch.ones(1)},
        global_valid_seqs=None,
        global_valid_toks=3.0,
    )
    loss.backward()
    assert teacher.grad is None or torch.all(teacher.grad == 0)
    assert student.grad.abs().sum() > 0


def test_roll_packed_seq_dim_respects_segment_boundaries():
    tensor = torch.arange(1, 9, dtype=torch.float32).reshape(1, 8, 1)
    expected = torch.tensor([2.0, 3, 4, 0, 6, 7, 8, 0]).reshape(1, 8, 1)
    for cu in (torch.tensor([0, 4, 8]), (0, 4, 8)):
        assert torch.equal(roll_packed_seq_dim(tensor, cu, seq_dim=1), expected)
    # any seq_dim, trailing feature dims rolled together
    feats = torch.arange(1, 9).reshape(8, 1).repeat(1, 3)
    out = roll_packed_seq_dim(feats, (0, 4, 8), seq_dim=0)
    assert torch.equal(out, torch.tensor([2, 3, 4, 0, 6, 7, 8, 0])[:, None].repeat(1, 3))
    # uneven segments
    out = roll_packed_seq_dim(torch.arange(1, 8)[None], (0, 2, 7), seq_dim=1)
    assert out.tolist() == [[2, 0, 4, 5, 6, 7, 0]]


def test_pack_rolled_draft_token_mask_inflated_length():
    out = pack_rolled_draft_token_mask(
        torch.tensor([[0, 1, 1]]), torch.tensor([1]), torch.tensor([0, 5]), torch.tensor([0, 8])
    )
    assert out.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]


def test_pack_rolled_draft_token_mask_matches_unpacked_draft_mask():
    token_mask = torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    sample_mask = torch.tensor([1.0, 0.0, 1.0])
    out = pack_rolled_draft_token_mask(token_mask, sample_mask, (0, 4, 9, 12), (0, 8, 14, 18))
    expected = torch.zeros(1, 18)
    # row 0 (L=4): roll(token_mask[:4]) = [1,1,1,0]
    expected[0, 0:4] = torch.tensor([1.0, 1, 1, 0])
    # row 1 sample-masked; row 2 (L=3): [1,1,0], then padding
    expected[0, 14:16] = torch.tensor([1.0, 1])
    assert torch.equal(out, expected)


def _build_draft_batch(draft_vocab: int, padded_lens=(8, 8, 4), mask_start: int = 2, sample_mask=(1.0, 1.0, 0.0)):
    torch.manual_seed(17)
    vocab = 11
    seq_lens = [5, 7, 4]
    cu, cup = cumsum(seq_lens), cumsum(list(padded_lens))
    rows, width = 3, max(seq_lens)
    logits = torch.zeros(rows, width, vocab)
    student = torch.zeros(rows, width, draft_vocab)
    token_mask = torch.zeros(rows, width)
    for i, n in enumerate(seq_lens):
        logits[i, :n] = torch.randn(n, vocab)
        student[i, :n] = torch.randn(n, draft_vocab)
        token_mask[i, mask_start:n] = 1.0
    sample_mask = torch.tensor(sample_mask)
    packed_logits = pack_rows(logits, seq_lens, cup, torch.randn(cup[-1], vocab) * 5)
    packed_student = pack_rows(student, seq_lens, cup, torch.randn(cup[-1], draft_vocab) * 5)
    data = {"token_mask": token_mask, "sample_mask": sample_mask, "student_logits": student}
    g_t = (token_mask * sample_mask[:, None]).sum()
    return dict(
        logits=logits,
        student=student,
        data=data,
        packed_logits=packed_logits,
        packed_student=packed_student,
        cu=cu,
        cup=cup,
        g_t=g_t,
        seq_lens=seq_lens,
    )


def _zero_policy_loss(next_token_logits, data, global_valid_seqs, global_valid_toks, **kw):
    return torch.zeros(()), {"loss": torch.zeros(())}


def _hand_draft_loss(b, d2t) -> torch.Tensor:
    """mask[i, t] = token_mask[i, t+1]·sample_mask[i] (t + 1 < L_i) supervises student[i, t]
    with teacher = policy logits at t+1 (draft vocab via d2t); / G_t."""
    vocab = b["logits"].shape[-1]
    ids = torch.arange(vocab) if d2t is None else torch.arange(d2t.shape[0]) + d2t
    total = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(b["seq_lens"]):
        for t in range(n - 1):
            m = b["data"]["token_mask"][i, t + 1] * b["data"]["sample_mask"][i]
            if m:
                total += m * _soft_ce(b["logits"][i, t + 1, ids], b["student"][i, t])
    return total / b["g_t"].double()


@pytest.mark.parametrize("draft_vocab,d2t", [(11, None), (5, torch.tensor([0, 2, 4, 5, 6]))], ids=["full", "d2t"])
@pytest.mark.parametrize("cu_as_tensor", [False, True], ids=["tuple", "tensor"])
def test_packed_draft_loss_matches_unpacked(draft_vocab, d2t, cu_as_tensor):
    b = _build_draft_batch(draft_vocab)
    assert b["cu"] == (0, 5, 12, 16) and b["cup"] == (0, 8, 16, 20)
    reference = DraftLossWrapper(
        _zero_policy_loss,
        functools.partial(prepare_loss_input, d2t=d2t),
        b["data"],
    )
    ref_loss, ref_metrics = reference(b["logits"], b["data"], None, b["g_t"])

    cu, cup = b["cu"], b["cup"]
    if cu_as_tensor:
        cu, cup = torch.tensor(cu), torch.tensor(cup)
    student = b["packed_student"].clone().requires_grad_()
    packed = DraftLossWrapper(
        _zero_policy_loss,
        None,
        b["data"],
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=cup,
        d2t=d2t,
        student_logits=student,
    )
    loss, metrics = packed(b["packed_logits"], b["data"], None, b["g_t"])

    torch.testing.assert_close(loss, ref_loss, **close(torch.float32, "reordered"))
    torch.testing.assert_close(metrics["draft_loss"], ref_metrics["draft_loss"], **close(torch.float32, "reordered"))
    assert metrics["draft_loss"].item() > 0.0
    torch.testing.assert_close(metrics["total_loss"], metrics["draft_loss"])
    torch.testing.assert_close(loss.double(), _hand_draft_loss(b, d2t), **close(torch.float32, "reordered"))

    # gradient reaches only the supervised student slots of the packed layout
    loss.backward()
    grad = student.grad[0]
    assert torch.all(grad[padding_slots(b["seq_lens"], b["cup"], 7)] == 0)
    assert torch.all(grad[16:20] == 0)  # sample_mask 0 sequence
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("draft_vocab,d2t", [(11, None), (5, torch.tensor([0, 2, 4, 5, 6]))], ids=["full", "d2t"])
def test_packed_draft_loss_does_not_leak_across_unpadded_segments(draft_vocab, d2t):
    """Stronger than the reference case: no per-sequence padding (cu == cu_padded), every
    token supervised (token_mask[i, 0] = 1), all samples kept, so a roll that is not
    segment-aware would supervise each segment's last token with the next one's first."""
    b = _build_draft_batch(draft_vocab, padded_lens=(5, 7, 4), mask_start=0, sample_mask=(1.0, 1.0, 1.0))
    ref_loss, _ = DraftLossWrapper(
        _zero_policy_loss,
        functools.partial(prepare_loss_input, d2t=d2t),
        b["data"],
    )(b["logits"], b["data"], None, b["g_t"])
    student = b["packed_student"].clone().requires_grad_()
    loss, metrics = DraftLossWrapper(
        _zero_policy_loss,
        None,
        b["data"],
        cu_seqlens_q=b["cu"],
        cu_seqlens_q_padded=b["cup"],
        d2t=d2t,
        student_logits=student,
    )(b["packed_logits"], b["data"], None, b["g_t"])
    torch.testing.assert_close(loss, ref_loss, **close(torch.float32, "reordered"))
    torch.testing.assert_close(loss.double(), _hand_draft_loss(b, d2t), **close(torch.float32, "reordered"))
    loss.backward()
    last_slots = [e - 1 for e in b["cup"][1:]]
    assert torch.all(student.grad[0, last_slots] == 0)
    assert torch.all(student.grad[0, [s for s in range(16) if s not in last_slots]].abs().sum(-1) > 0)


def test_draft_loss_wrapper_unpacked_with_real_policy_loss():
    """Unpacked end to end: ClippedPG policy + 0.3 × draft soft-CE; the draft term adds
    nothing to the policy-logit gradient (teacher detached)."""
    torch.manual_seed(5)
    rows, width, vocab = 2, 6, 9
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width)),
        "token_mask": torch.tensor([[0.0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]),
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, width),
        "prev_logprobs": -torch.rand(rows, width),
        "generation_logprobs": -torch.rand(rows, width),
        "reference_policy_logprobs": -torch.rand(rows, width),
    }
    student = torch.randn(rows, width, vocab, requires_grad=True)
    data["student_logits"] = student
    g_t = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    g_s = data["sample_mask"].sum()
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    policy = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, prepare_fn=prepare_loss_input)

    logits = torch.randn(rows, width, vocab, requires_grad=True)
    wrapper = DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=None), data, loss_weight=0.3)
    loss, metrics = wrapper(logits, data, g_s, g_t)
    loss.backward()

    ref_logits = logits.detach().clone().requires_grad_()
    ref_loss, ref_metrics = policy(ref_logits, data, g_s, g_t)
    ref_loss.backward()

    mask = torch.roll(data["token_mask"], -1, 1)
    mask[:, -1] = 0
    teacher = torch.cat([logits.detach()[:, 1:], torch.zeros(rows, 1, vocab)], 1)
    draft = (mask.double() * _soft_ce(teacher, student.detach())).sum() / g_t.double()

    torch.testing.assert_close(metrics["draft_loss"].double(), draft, **close(torch.float32, "reordered"))
    torch.testing.assert_close(loss.double(), ref_loss.double() + 0.3 * draft, **close(torch.float32, "reordered"))
    torch.testing.assert_close(metrics["total_loss"], metrics["loss"] + 0.3 * metrics["draft_loss"])
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"])
    assert torch.equal(logits.grad, ref_logits.grad)
    q = torch.softmax(student.detach().double(), -1)
    p = torch.softmax(teacher.double(), -1)
    expected = 0.3 * (q - p) * mask.double()[..., None] / g_t.double()
    torch.testing.assert_close(student.grad.double(), expected, **close(torch.float32, "reordered"))


# ---------------------------------------------------------------------------------------
# §12.3 DraftRuntimeLossWrapper (upstream variant)
# ---------------------------------------------------------------------------------------


class _FakeDraftRuntime:
    def __init__(self, draft_loss: torch.Tensor, loss_weight: float):
        self._draft_loss = draft_loss
        self.loss_weight = loss_weight
        self.seen_prepared_data = None

    def compute_loss(self, prepared_data):
        self.seen_prepared_data = prepared_data
        return self._draft_loss, {"draft_loss": self._draft_loss.detach().clone()}


def _fake_prepare_fn(next_token_logits, data, loss_fn):
    return {"logprobs": next_token_logits}, data


def _make_policy_loss_fn(policy_param: torch.Tensor):
    def loss_fn(*, data, global_valid_seqs, global_valid_toks, logprobs):
        loss = logprobs.sum() * policy_param
        return loss, {"policy_loss": loss.detach().clone()}

    return loss_fn


def test_draft_runtime_combined_loss_composition_and_metrics_merge():
    policy_param = torch.tensor(2.0, requires_grad=True)
    draft_param = torch.tensor(3.0, requires_grad=True)
    runtime = _FakeDraftRuntime(draft_param * 5.0, loss_weight=0.5)
    wrapper = DraftRuntimeLossWrapper(_make_policy_loss_fn(policy_param), _fake_prepare_fn, runtime)
    data = {"x": 1}
    combined, metrics = wrapper(torch.ones(2, 3), data, None, None)
    assert combined.item() == 19.5  # 12 + 0.5 · 15
    assert metrics["policy_loss"].item() == 12.0
    assert metrics["draft_loss"].item() == 15.0
    assert runtime.seen_prepared_data is data


def test_draft_runtime_zero_weight_isolates_policy_gradients():
    logits = torch.ones(2, 3)
    ref_param = torch.tensor(2.0, requires_grad=True)
    ref_loss, _ = _make_policy_loss_fn(ref_param)(
        data=None, global_valid_seqs=None, global_valid_toks=None, logprobs=logits
    )
    ref_loss.backward()

    policy_param = torch.tensor(2.0, requires_grad=True)
    draft_param = torch.tensor(3.0, requires_grad=True)
    runtime = _FakeDraftRuntime(draft_param * 5.0, loss_weight=0.0)
    wrapper = DraftRuntimeLossWrapper(_make_policy_loss_fn(policy_param), _fake_prepare_fn, runtime)
    combined, _ = wrapper(logits, {}, None, None)
    combined.backward()
    assert combined.item() == 12.0
    assert torch.equal(policy_param.grad, ref_param.grad)
    assert policy_param.grad.item() == 6.0
    assert draft_param.grad.item() == 0.0


def test_draft_runtime_gradients_flow_only_through_draft_term():
    policy_param = torch.tensor(2.0, requires_grad=True)
    draft_param = torch.tensor(3.0, requires_grad=True)
    runtime = _FakeDraftRuntime(draft_param * 5.0, loss_weight=0.25)
    wrapper = DraftRuntimeLossWrapper(_make_policy_loss_fn(policy_param), _fake_prepare_fn, runtime)
    combined, _ = wrapper(torch.ones(2, 3), {}, None, None)
    combined.backward()
    assert combined.item() == 12.0 + 0.25 * 15.0
    assert draft_param.grad.item() == 1.25
    assert policy_param.grad.item() == 6.0


def test_draft_runtime_is_the_upstream_variant_without_draft_loss_scale():
    params = inspect.signature(DraftRuntimeLossWrapper).parameters
    assert list(params) == ["loss_fn", "prepare_fn", "draft_runtime"]
    with pytest.raises(TypeError):
        DraftRuntimeLossWrapper(
            _make_policy_loss_fn(torch.tensor(1.0)),
            _fake_prepare_fn,
            _FakeDraftRuntime(torch.tensor(1.0), 0.5),
            draft_loss_scale=4.0,
        )
