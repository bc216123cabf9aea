"""Reference acceptance checks for the loss wrappers and layout utilities.

Ports the CPU-applicable checks of the behaviour reference:
- §12.2 `test_draft_loss_wrapper.py` (DraftLossWrapper, roll_packed_seq_dim,
  pack_rolled_draft_token_mask, packed == unpacked draft loss); the mocked tensor-parallel
  test is replaced by a hand-computed soft cross-entropy and gradient check (no TP here).
- §12.3 `test_draft_runtime_loss_wrapper.py` (upstream variant, no `draft_loss_scale`).
- §12.4 `_pack_input_ids` regressions, the `_pack_sequences_for_megatron` CP layout
  example, `test_sequence_packing_fusion` (cp = tp = 1) and
  `test_sequence_packing_gradients` (cp = 1).
- §7.1 the extrema registries.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch

from compiled_loss.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DraftCrossEntropyLossFn,
)
from compiled_loss.loss_input import (
    TrainingSamplingParams,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from compiled_loss.utils import _pack_input_ids, pack_rolled_draft_token_mask, roll_packed_seq_dim
from compiled_loss.wrapper import (
    _SEQ_METRIC_MAX,
    _SEQ_METRIC_MIN,
    DraftLossWrapper,
    DraftRuntimeLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _cumsum(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _pack_rows(unpacked: torch.Tensor, lengths: list[int], cu_padded: tuple[int, ...],
               filler: torch.Tensor) -> torch.Tensor:
    """Differentiable packing `[B, S, ...]` → `[1, T, ...]`: segment i occupies slots
    `[cu_padded[i], cu_padded[i+1])`, its first `min(L_i, S)` slots hold row i's first
    positions, the other slots come from `filler` (`[T, ...]`, arbitrary junk)."""
    width = unpacked.shape[1]
    pieces = []
    for i, length in enumerate(lengths):
        c = min(length, width)
        start, end = cu_padded[i], cu_padded[i + 1]
        pieces.append(unpacked[i, :c])
        pieces.append(filler[start + c:end])
    return torch.cat(pieces, 0)[None]


def _unpack_grad(packed_grad: torch.Tensor, lengths: list[int], cu_padded: tuple[int, ...],
                 width: int) -> torch.Tensor:
    """Map a packed `[1, T, ...]` gradient back to `[B, S, ...]` (zeros past each length)."""
    out = packed_grad.new_zeros((len(lengths), width) + tuple(packed_grad.shape[2:]))
    for i, length in enumerate(lengths):
        c = min(length, width)
        out[i, :c] = packed_grad[0, cu_padded[i]:cu_padded[i] + c]
    return out


def _padding_slots(lengths: list[int], cu_padded: tuple[int, ...], width: int) -> torch.Tensor:
    keep = torch.zeros(cu_padded[-1], dtype=torch.bool)
    for i, length in enumerate(lengths):
        keep[cu_padded[i]:cu_padded[i] + min(length, width)] = True
    return ~keep


def _soft_ce(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Per-row H(softmax(teacher), log_softmax(student)) in float64."""
    p = torch.softmax(teacher.double(), -1)
    return -(p * torch.log_softmax(student.double(), -1)).sum(-1)


def _assert_metrics_close(got: dict, expected: dict, tol: float = 1e-5) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(
            torch.as_tensor(got[key]).double(), torch.as_tensor(expected[key]).double(),
            rtol=tol, atol=tol, msg=lambda m, k=key: f"metric {k!r}: {m}",
        )


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
        lambda **kw: ({}, kw["data"]), data, loss_weight=0.0,
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
        DraftLossWrapper(policy, None, {}, cu_seqlens_q=(0, 4), student_logits=torch.zeros(1, 4, 3),
                         defer_normalization=True)
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
        teacher_logits=teacher, student_logits=student, token_mask=token_mask,
        data={"sample_mask": sample_mask}, global_valid_seqs=torch.tensor(1.0),
        global_valid_toks=g_t,
    )
    mask = token_mask * sample_mask[:, None]
    expected = (mask.double() * _soft_ce(teacher, student.detach())).sum() / 7.0
    assert loss.dim() == 0
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)
    assert loss.item() > 0

    loss.backward()
    q = torch.softmax(student.detach().double(), -1)
    p = torch.softmax(teacher.double(), -1)
    expected_grad = (q - p) * mask.double()[..., None] / 7.0
    torch.testing.assert_close(student.grad.double(), expected_grad, rtol=1e-5, atol=1e-7)
    assert torch.all(student.grad[1] == 0)  # sample_mask 0 row

    # normalisation is by the given G_t, not the mask count: doubling G_t halves the loss
    loss2 = DraftCrossEntropyLossFn(token_chunk_size=chunk)(
        teacher_logits=teacher, student_logits=student.detach(), token_mask=token_mask,
        data={"sample_mask": sample_mask}, global_valid_seqs=None, global_valid_toks=14.0,
    )
    torch.testing.assert_close(loss2.double(), expected / 2, rtol=1e-6, atol=1e-7)


def test_draft_cross_entropy_teacher_gets_no_gradient():
    torch.manual_seed(4)
    teacher = torch.randn(1, 3, 5, requires_grad=True)
    student = torch.randn(1, 3, 5, requires_grad=True)
    loss = DraftCrossEntropyLossFn()(
        teacher_logits=teacher, student_logits=student, token_mask=torch.ones(1, 3),
        data={"sample_mask": torch.ones(1)}, global_valid_seqs=None, global_valid_toks=3.0,
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


def _build_draft_batch(draft_vocab: int, padded_lens=(8, 8, 4), mask_start: int = 2,
                       sample_mask=(1.0, 1.0, 0.0)):
    torch.manual_seed(17)
    vocab = 11
    seq_lens = [5, 7, 4]
    cu, cup = _cumsum(seq_lens), _cumsum(list(padded_lens))
    rows, width = 3, max(seq_lens)
    logits = torch.zeros(rows, width, vocab)
    student = torch.zeros(rows, width, draft_vocab)
    token_mask = torch.zeros(rows, width)
    for i, n in enumerate(seq_lens):
        logits[i, :n] = torch.randn(n, vocab)
        student[i, :n] = torch.randn(n, draft_vocab)
        token_mask[i, mask_start:n] = 1.0
    sample_mask = torch.tensor(sample_mask)
    packed_logits = _pack_rows(logits, seq_lens, cup, torch.randn(cup[-1], vocab) * 5)
    packed_student = _pack_rows(student, seq_lens, cup, torch.randn(cup[-1], draft_vocab) * 5)
    data = {"token_mask": token_mask, "sample_mask": sample_mask, "student_logits": student}
    g_t = (token_mask * sample_mask[:, None]).sum()
    return dict(logits=logits, student=student, data=data, packed_logits=packed_logits,
                packed_student=packed_student, cu=cu, cup=cup, g_t=g_t, seq_lens=seq_lens)


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


@pytest.mark.parametrize(
    "draft_vocab,d2t", [(11, None), (5, torch.tensor([0, 2, 4, 5, 6]))], ids=["full", "d2t"]
)
@pytest.mark.parametrize("cu_as_tensor", [False, True], ids=["tuple", "tensor"])
def test_packed_draft_loss_matches_unpacked(draft_vocab, d2t, cu_as_tensor):
    b = _build_draft_batch(draft_vocab)
    assert b["cu"] == (0, 5, 12, 16) and b["cup"] == (0, 8, 16, 20)
    reference = DraftLossWrapper(
        _zero_policy_loss, functools.partial(prepare_loss_input, d2t=d2t), b["data"],
    )
    ref_loss, ref_metrics = reference(b["logits"], b["data"], None, b["g_t"])

    cu, cup = b["cu"], b["cup"]
    if cu_as_tensor:
        cu, cup = torch.tensor(cu), torch.tensor(cup)
    student = b["packed_student"].clone().requires_grad_()
    packed = DraftLossWrapper(
        _zero_policy_loss, None, b["data"], cu_seqlens_q=cu, cu_seqlens_q_padded=cup,
        d2t=d2t, student_logits=student,
    )
    loss, metrics = packed(b["packed_logits"], b["data"], None, b["g_t"])

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["draft_loss"], ref_metrics["draft_loss"], rtol=1e-5, atol=1e-6)
    assert metrics["draft_loss"].item() > 0.0
    torch.testing.assert_close(metrics["total_loss"], metrics["draft_loss"])
    torch.testing.assert_close(loss.double(), _hand_draft_loss(b, d2t), rtol=1e-5, atol=1e-7)

    # gradient reaches only the supervised student slots of the packed layout
    loss.backward()
    grad = student.grad[0]
    assert torch.all(grad[_padding_slots(b["seq_lens"], b["cup"], 7)] == 0)
    assert torch.all(grad[16:20] == 0)  # sample_mask 0 sequence
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    "draft_vocab,d2t", [(11, None), (5, torch.tensor([0, 2, 4, 5, 6]))], ids=["full", "d2t"]
)
def test_packed_draft_loss_does_not_leak_across_unpadded_segments(draft_vocab, d2t):
    """Stronger than the reference case: no per-sequence padding (cu == cu_padded), every
    token supervised (token_mask[i, 0] = 1), all samples kept, so a roll that is not
    segment-aware would supervise each segment's last token with the next one's first."""
    b = _build_draft_batch(draft_vocab, padded_lens=(5, 7, 4), mask_start=0,
                           sample_mask=(1.0, 1.0, 1.0))
    ref_loss, _ = DraftLossWrapper(
        _zero_policy_loss, functools.partial(prepare_loss_input, d2t=d2t), b["data"],
    )(b["logits"], b["data"], None, b["g_t"])
    student = b["packed_student"].clone().requires_grad_()
    loss, metrics = DraftLossWrapper(
        _zero_policy_loss, None, b["data"], cu_seqlens_q=b["cu"], cu_seqlens_q_padded=b["cup"],
        d2t=d2t, student_logits=student,
    )(b["packed_logits"], b["data"], None, b["g_t"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), _hand_draft_loss(b, d2t), rtol=1e-5, atol=1e-7)
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
    policy = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=loss_fn,
                               prepare_fn=prepare_loss_input)

    logits = torch.randn(rows, width, vocab, requires_grad=True)
    wrapper = DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=None), data,
                               loss_weight=0.3)
    loss, metrics = wrapper(logits, data, g_s, g_t)
    loss.backward()

    ref_logits = logits.detach().clone().requires_grad_()
    ref_loss, ref_metrics = policy(ref_logits, data, g_s, g_t)
    ref_loss.backward()

    mask = torch.roll(data["token_mask"], -1, 1)
    mask[:, -1] = 0
    teacher = torch.cat([logits.detach()[:, 1:], torch.zeros(rows, 1, vocab)], 1)
    draft = (mask.double() * _soft_ce(teacher, student.detach())).sum() / g_t.double()

    torch.testing.assert_close(metrics["draft_loss"].double(), draft, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.double(), ref_loss.double() + 0.3 * draft, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["total_loss"], metrics["loss"] + 0.3 * metrics["draft_loss"])
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"])
    assert torch.equal(logits.grad, ref_logits.grad)
    q = torch.softmax(student.detach().double(), -1)
    p = torch.softmax(teacher.double(), -1)
    expected = 0.3 * (q - p) * mask.double()[..., None] / g_t.double()
    torch.testing.assert_close(student.grad.double(), expected, rtol=1e-5, atol=1e-7)


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
        DraftRuntimeLossWrapper(_make_policy_loss_fn(torch.tensor(1.0)), _fake_prepare_fn,
                                _FakeDraftRuntime(torch.tensor(1.0), 0.5), draft_loss_scale=4.0)


# ---------------------------------------------------------------------------------------
# §12.4 `_pack_input_ids` regressions and the Megatron CP layout example
# ---------------------------------------------------------------------------------------


def _inflated_batch():
    torch.manual_seed(0)
    width = 7040
    ids = torch.randint(1, 50_000, (2, width))  # non-zero so padding zeros are identifiable
    cu = (0, 7040, 16512)  # Megatron: cu_seqlens_q == padded; last segment 9472 > width
    return ids, cu


def test_pack_input_ids_inflated_last_segment_rolled():
    ids, cu = _inflated_batch()
    out = _pack_input_ids(ids, cu, cu, roll_shift=-1)
    assert out.shape == (1, 16512)
    assert out.dtype == ids.dtype
    out = out[0]
    # segment 0 (exact width): rolled left by one over its padded length
    assert torch.equal(out[:7039], ids[0, 1:])
    assert out[7039] == ids[0, 0]
    # segment 1: real tokens rolled within the padded length 9472, phantom tail zero
    seg = out[7040:]
    assert torch.equal(seg[:7039], ids[1, 1:])
    assert torch.all(seg[7039:9471] == 0)
    assert seg[9471] == ids[1, 0]
    # without roll: real tokens first, phantom tail zero
    plain = _pack_input_ids(ids, cu, cu)[0]
    assert torch.equal(plain[:7040], ids[0])
    assert torch.equal(plain[7040:14080], ids[1])
    assert torch.all(plain[14080:] == 0)


@pytest.mark.parametrize("cp_size", [2, 8])
@pytest.mark.parametrize("roll_shift", [0, -1])
def test_pack_input_ids_cp_sharding_conserves_tokens(cp_size, roll_shift):
    ids, cu = _inflated_batch()
    full = _pack_input_ids(ids, cu, cu, roll_shift=roll_shift)[0]
    shards = [_pack_input_ids(ids, cu, cu, cp_rank=r, cp_size=cp_size, roll_shift=roll_shift)
              for r in range(cp_size)]
    for shard in shards:
        assert shard.shape == (1, 16512 // cp_size)
    gathered = torch.cat([s[0] for s in shards])
    assert torch.equal(torch.sort(gathered).values, torch.sort(full).values)
    expected = torch.cat([ids.reshape(-1), torch.zeros(16512 - 2 * 7040, dtype=ids.dtype)])
    assert torch.equal(torch.sort(gathered).values, torch.sort(expected).values)
    assert int((gathered == 0).sum()) == 16512 - 2 * 7040
    # load-balanced layout: rank r holds chunks r and 2cp-1-r of every padded segment
    for r, shard in enumerate(shards):
        local = shard[0]
        for i in range(2):
            start, padded = cu[i], cu[i + 1] - cu[i]
            chunk = padded // (2 * cp_size)
            seg = full[start:start + padded]
            want = torch.cat([seg[r * chunk:(r + 1) * chunk],
                              seg[(2 * cp_size - 1 - r) * chunk:(2 * cp_size - r) * chunk]])
            assert torch.equal(local[start // cp_size:(start + padded) // cp_size], want)


def test_pack_input_ids_in_bounds_lengths_pad_with_zeros():
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 64))
    cu, cup = (0, 40, 104), (0, 48, 112)
    out = _pack_input_ids(ids, cu, cup)
    assert out.shape == (1, 112)
    out = out[0]
    assert torch.equal(out[:40], ids[0, :40])
    assert torch.all(out[40:48] == 0)
    assert torch.equal(out[48:112], ids[1])
    rolled = _pack_input_ids(ids, cu, cup, roll_shift=-1)[0]
    assert torch.equal(rolled[:39], ids[0, 1:40])
    assert torch.all(rolled[39:47] == 0)
    assert rolled[47] == ids[0, 0]
    assert torch.equal(rolled[48:111], ids[1, 1:])
    assert rolled[111] == ids[1, 0]
    # works for float masks too
    fmask = _pack_input_ids(torch.ones(2, 64), cu, cup)[0]
    assert fmask.dtype == torch.float32 and fmask.sum().item() == 104.0
    assert torch.all(fmask[40:48] == 0)


@pytest.mark.parametrize("cu", [(0, 16, 32), (0, 16, 40)], ids=["true", "padded"])
def test_megatron_cp_layout_example(cu):
    """§12.4 `_pack_sequences_for_megatron` CP example (cp=2, S=16, ids arange(32), both
    full length, pad_packed_to 40 → cu_padded [0,16,40]), reproduced via `_pack_input_ids`."""
    ids = torch.arange(32).reshape(2, 16)
    cup = (0, 16, 40)
    rank0 = _pack_input_ids(ids, cu, cup, cp_rank=0, cp_size=2)
    rank1 = _pack_input_ids(ids, cu, cup, cp_rank=1, cp_size=2)
    assert rank0.shape == (1, 20) and rank1.shape == (1, 20)
    assert rank0[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 0, 0, 0, 0, 0, 0]
    assert rank1[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11] + list(range(22, 32)) + [0, 0]
    # no CP: a (1, 40) row, sequence 1 laid at 16, padded with zeros to 40
    full = _pack_input_ids(ids, cu, cup)[0]
    assert full.tolist() == list(range(32)) + [0] * 8


def test_pack_input_ids_rejects_bad_arguments():
    ids = torch.arange(32).reshape(2, 16)
    with pytest.raises(ValueError):
        _pack_input_ids(ids, (0, 16, 30), (0, 16, 30), cp_rank=0, cp_size=2)  # 14 % 4 != 0
    with pytest.raises(ValueError):
        _pack_input_ids(ids, (0, 16, 32), (0, 16, 32), cp_rank=2, cp_size=2)
    with pytest.raises(ValueError):
        _pack_input_ids(ids, (0, 16), (0, 16))  # one boundary pair for two rows
    with pytest.raises(ValueError):
        _pack_input_ids(ids, (0, 16, 32), (0, 12, 32))  # padded shorter than true


# ---------------------------------------------------------------------------------------
# §12.4 test_sequence_packing_fusion (cp = tp = 1)
# ---------------------------------------------------------------------------------------


def _fusion_batch(seed: int = 42):
    torch.manual_seed(seed)
    rows, width, vocab = 4, 64, 64
    lengths = [width // 4, width // 2, width // 3, 3 * width // 4]  # [16, 32, 21, 48]
    padded = [n + (n % 2) for n in lengths]  # pad_individual = 2
    cu, cup = _cumsum(lengths), _cumsum(padded)
    token_mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        token_mask[i, :n] = 1.0
    gen = 0.1 * torch.randn(rows, width)
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width)),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": 0.1 * torch.randn(rows, width),
        "prev_logprobs": 0.1 * torch.randn(rows, width),
        "generation_logprobs": gen,
        "reference_policy_logprobs": gen.clone(),
    }
    unpacked = torch.randn(rows, width, vocab)
    packed = _pack_rows(unpacked, lengths, cup, 3 * torch.randn(cup[-1], vocab))
    g_t = torch.tensor(float(sum(n - 1 for n in lengths)))
    g_s = torch.tensor(4.0)
    return dict(data=data, unpacked=unpacked, packed=packed, lengths=lengths, cu=cu, cup=cup,
                g_t=g_t, g_s=g_s, width=width)


@pytest.mark.parametrize(
    "sampling", [None, TrainingSamplingParams(top_k=8, top_p=0.9)], ids=["plain", "top_k_top_p"]
)
def test_sequence_packing_fusion_matches_per_sequence_wrapper(sampling):
    b = _fusion_batch()
    assert b["cu"] == (0, 16, 48, 69, 117) and b["cup"] == (0, 16, 48, 70, 118)
    assert b["g_t"].item() == 113.0
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())

    results = {}
    for name, cls, prep in (
        ("seq", SequencePackingLossWrapper, functools.partial(prepare_loss_input, sampling_params=sampling)),
        ("fused", SequencePackingFusionLossWrapper,
         functools.partial(prepare_packed_loss_input, sampling_params=sampling)),
    ):
        logits = b["packed"].detach().clone().requires_grad_()
        wrapper = cls(loss_fn, prep, b["cu"], b["cup"])
        loss, metrics = wrapper(logits, b["data"], b["g_s"], b["g_t"])
        loss.backward()
        results[name] = (loss, metrics, logits.grad)

    (l1, m1, g1), (l2, m2, g2) = results["seq"], results["fused"]
    assert torch.isfinite(l1)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-5)
    assert g1.abs().sum() > 0
    assert torch.all(g1[0, _padding_slots(b["lengths"], b["cup"], b["width"])] == 0)
    _assert_metrics_close(m2, m1)
    for key, value in m1.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key

    # both equal the unpacked baseline (token_mask zero past each length)
    base_logits = b["unpacked"].clone().requires_grad_()
    base_loss, base_metrics = wrap_loss_fn_with_input_preparation(
        base_logits, b["data"], b["g_s"], b["g_t"], loss_fn=loss_fn,
        prepare_fn=functools.partial(prepare_loss_input, sampling_params=sampling),
    )
    base_loss.backward()
    torch.testing.assert_close(l1, base_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        _unpack_grad(g1, b["lengths"], b["cup"], b["width"]), base_logits.grad, rtol=1e-5, atol=1e-5
    )
    _assert_metrics_close(m1, base_metrics)


def test_sequence_packing_wrappers_accept_tensor_boundaries():
    b = _fusion_batch(7)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    ref, _ = SequencePackingLossWrapper(loss_fn, prepare_loss_input, b["cu"], b["cup"])(
        b["packed"], b["data"], b["g_s"], b["g_t"])
    for cls, prep in ((SequencePackingLossWrapper, prepare_loss_input),
                      (SequencePackingFusionLossWrapper, prepare_packed_loss_input)):
        wrapper = cls(loss_fn, prep, torch.tensor(b["cu"]), torch.tensor(b["cup"]))
        assert wrapper.cu_seqlens_q == b["cu"] and wrapper.cu_seqlens_q_padded == b["cup"]
        loss, _ = wrapper(b["packed"], b["data"], b["g_s"], b["g_t"])
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    # cu_seqlens_q_padded defaults to cu_seqlens_q
    w = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, b["cup"])
    assert w.cu_seqlens_q_padded == b["cup"]


# ---------------------------------------------------------------------------------------
# §12.4 test_sequence_packing_gradients (cp = 1)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu_mode", ["true_lengths", "megatron_padded"],
    ids=["cu_true", "cu_eq_padded_inflated_last"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["per_sequence", "fused"])
def test_sequence_packing_gradients_match_unpacked_baseline(cu_mode, fused):
    torch.manual_seed(0)
    rows, width, vocab = 4, 64, 100
    lengths = [16, 16, 16, 48]
    token_mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        token_mask[i, :n] = 1.0
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width)),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, width),
        "prev_logprobs": torch.randn(rows, width) * 0.1 - 4.0,
        "generation_logprobs": torch.randn(rows, width) * 0.1 - 4.0,
        "reference_policy_logprobs": torch.randn(rows, width) * 0.1 - 4.0,
    }
    g_t = torch.tensor(float(sum(lengths)))  # Σ L, as the reference test (not L - 1)
    g_s = torch.tensor(4.0)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.1, ratio_clip_c=3.0))

    if cu_mode == "true_lengths":
        cu = cup = _cumsum(lengths)
    else:  # Megatron: cu_seqlens_q IS the padded prefix sum, last segment inflated to 80 > S
        cu = cup = (0, 16, 32, 48, 128)
    pack_lengths = [cu[i + 1] - cu[i] for i in range(rows)]

    base_logits = torch.randn(rows, width, vocab, requires_grad=True)
    base_loss, base_metrics = wrap_loss_fn_with_input_preparation(
        base_logits, data, g_s, g_t, loss_fn=loss_fn, prepare_fn=prepare_loss_input,
    )
    base_loss.backward()

    leaf = base_logits.detach().clone().requires_grad_()
    packed = _pack_rows(leaf, pack_lengths, cup, 3 * torch.randn(cup[-1], vocab)).detach().requires_grad_()
    if fused:
        wrapper = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, cu, cup)
    else:
        wrapper = SequencePackingLossWrapper(loss_fn, prepare_loss_input, cu, cup)
    loss, metrics = wrapper(packed, data, g_s, g_t)
    loss.backward()

    torch.testing.assert_close(loss, base_loss, rtol=1e-5, atol=1e-5)
    mapped = _unpack_grad(packed.grad, pack_lengths, cup, width)
    torch.testing.assert_close(mapped, base_logits.grad, rtol=1e-5, atol=1e-5)
    assert mapped.abs().sum() > 0
    assert torch.all(packed.grad[0, _padding_slots(pack_lengths, cup, width)] == 0)
    if cu_mode == "megatron_padded":
        assert torch.all(packed.grad[0, 48 + 48:] == 0)  # phantom tail of the inflated segment
    _assert_metrics_close(metrics, base_metrics)


# ---------------------------------------------------------------------------------------
# §7.1 extrema registries
# ---------------------------------------------------------------------------------------


def test_seq_metric_extrema_registries():
    reference_min = {"probs_ratio_min", "probs_ratio_clamped_min", "opd_full_reverse_kl_min"}
    reference_max = {"probs_ratio_max", "probs_ratio_clamped_max", "opd_full_reverse_kl_max",
                     "opd_full_decomposition_error"}
    assert isinstance(_SEQ_METRIC_MIN, frozenset) and isinstance(_SEQ_METRIC_MAX, frozenset)
    assert reference_min <= _SEQ_METRIC_MIN
    assert reference_max <= _SEQ_METRIC_MAX
    assert not (_SEQ_METRIC_MIN & _SEQ_METRIC_MAX)
    # the only additions are the critic's extrema (which the library reports with ±inf
    # sentinels, so they must reduce with min/max, not be summed)
    assert _SEQ_METRIC_MIN - reference_min == {"values_min"}
    assert _SEQ_METRIC_MAX - reference_max == {"values_max"}
    # every ClippedPG extremum key is registered
    torch.manual_seed(0)
    b = _fusion_batch(3)
    _, metrics = wrap_loss_fn_with_input_preparation(
        b["unpacked"], b["data"], b["g_s"], b["g_t"],
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig()), prepare_fn=prepare_loss_input,
    )
    for key in metrics:
        if key.endswith("_min"):
            assert key in _SEQ_METRIC_MIN, key
        if key.endswith("_max"):
            assert key in _SEQ_METRIC_MAX, key
    assert {"probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min",
            "probs_ratio_clamped_max"} <= set(metrics)


def test_wrappers_are_frozen_dataclasses():
    w = SequencePackingLossWrapper(ClippedPGLossFn(ClippedPGLossConfig()), prepare_loss_input, (0, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.loss_fn = None
    assert w.cu_seqlens_q == (0, 4) and w.cu_seqlens_q_padded == (0, 4)
