"""The numeric grid: the vocab primitive, both preparers and both micro-batch entry points
against plain torch, over dtypes × shapes × LM heads (dense logits, or the fused head's
`LinearLogits`) × views (padded rows, packed sequences). Each case compares the outputs and
every gradient (the logits', or the hidden states' and the head's). The shapes are odd on
purpose; the slow tier adds one realistic vocabulary. Tolerances are written once, per
dtype, in `tests/tolerances.py` (the "vs_torch" kinds)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tolerances import GRID_DTYPES, close

from compiled_loss.loss_functions import NLLLossFn
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.vocab import LinearLogits, vocab_reduce
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

HIDDEN = 24  # the fused head's hidden size


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    length: int
    vocab: int
    dtype: torch.dtype
    head: str  # "dense": logits; "fused": LinearLogits(hidden, weight)

    @property
    def id(self) -> str:
        return f"{self.batch}x{self.length}x{self.vocab}-{str(self.dtype).removeprefix('torch.')}-{self.head}"


def _grid(shapes: list[tuple[int, int, int]]) -> list[Case]:
    return [Case(*s, d, h) for s in shapes for d in GRID_DTYPES for h in ("dense", "fused")]


CASES = _grid([(1, 5, 7), (3, 47, 123), (2, 33, 1001)])
REALISTIC = _grid([(2, 64, 50257)])  # GPT-2's vocabulary: odd, and wider than a chunk


@dataclasses.dataclass
class Inputs:
    leaves: tuple[torch.Tensor, ...]  # what the gradients are taken of
    logits: torch.Tensor  # [B, T, V] as plain torch computes them (fp32), from the leaves
    library: torch.Tensor | LinearLogits  # the same logits as the library takes them, [B, T, V] / [B, T, H]
    ids: torch.Tensor
    lengths: list[int]


def _inputs(case: Case, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    b, t, v = case.batch, case.length, case.vocab
    ids = torch.randint(0, v, (b, t), generator=g)
    lengths = [max(2, t - 3 * i) for i in range(b)]
    if case.head == "dense":
        logits = (3 * torch.randn(b, t, v, generator=g)).to(case.dtype).requires_grad_()
        return Inputs((logits,), logits.float(), logits, ids, lengths)
    hidden = torch.randn(b, t, HIDDEN, generator=g).to(case.dtype).requires_grad_()
    weight = (torch.randn(v, HIDDEN, generator=g) / HIDDEN**0.25).to(case.dtype).requires_grad_()
    return Inputs((hidden, weight), F.linear(hidden, weight).float(), LinearLogits(hidden, weight), ids, lengths)


def _close(case: Case, got: torch.Tensor, want: torch.Tensor, what: str, kind: str = "vs_torch") -> None:
    torch.testing.assert_close(
        got.float(), want.float(), **close(case.dtype, kind), msg=lambda m: f"{case.id} {what}: {m}"
    )


def _same_gradients(case: Case, got: torch.Tensor, want: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> None:
    got_grads = torch.autograd.grad(got, leaves, retain_graph=True)
    want_grads = torch.autograd.grad(want, leaves, retain_graph=True)
    for i, (a, b) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert a.dtype == leaves[i].dtype, f"{case.id}: gradient {i} in {a.dtype}, its leaf in {leaves[i].dtype}"
        _close(case, a, b, f"gradient of leaf {i}", "fused_vs_torch_grad" if case.head == "fused" else "vs_torch_grad")


def _data(inp: Inputs) -> dict[str, torch.Tensor]:
    b, t = inp.ids.shape
    token_mask = (torch.arange(t)[None, :] < torch.tensor(inp.lengths)[:, None]).float()
    return {"input_ids": inp.ids, "token_mask": token_mask, "sample_mask": torch.ones(b)}


def _plain_logprobs(inp: Inputs) -> torch.Tensor:
    """log softmax(logits[:, t])[ids[:, t + 1]], `[B, T - 1]`."""
    return inp.logits[:, :-1].log_softmax(-1).gather(-1, inp.ids[:, 1:, None])[..., 0]


def _plain_nll(inp: Inputs, data: dict[str, torch.Tensor], global_valid_toks: torch.Tensor) -> torch.Tensor:
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return -(_plain_logprobs(inp) * mask).sum() / (global_valid_toks + 1e-8)


def _packed(inp: Inputs, tokens: int | None = None) -> tuple[torch.Tensor | LinearLogits, tuple[int, ...]]:
    """The rows' real positions packed into `[1, tokens, ·]` (zeros after the last), and cu_seqlens."""
    cu = [0]
    for n in inp.lengths:
        cu.append(cu[-1] + n)
    source = inp.library.hidden if isinstance(inp.library, LinearLogits) else inp.library
    rows = [source[i, :n] for i, n in enumerate(inp.lengths)]
    packed = torch.cat(rows)
    packed = F.pad(packed, (0, 0, 0, (tokens or cu[-1]) - cu[-1]))[None]
    if isinstance(inp.library, LinearLogits):
        return LinearLogits(packed, inp.library.weight), tuple(cu)
    return packed, tuple(cu)


def _vocab_primitive(case: Case) -> None:
    inp = _inputs(case)
    v = case.vocab
    library = (
        LinearLogits(inp.library.hidden.reshape(-1, HIDDEN), inp.library.weight)
        if isinstance(inp.library, LinearLogits)
        else inp.library.reshape(-1, v)
    )
    index = inp.ids.reshape(-1, 1)
    stats = vocab_reduce(library, index, entropy=True)
    logits = inp.logits.reshape(-1, v)
    lse = logits.logsumexp(-1)
    picked = logits.gather(-1, index)
    logp = logits.log_softmax(-1)
    negent = (logp.exp() * logp).sum(-1)
    for what, got, want in (
        ("lse", stats.lse, lse),
        ("picked", stats.picked, picked),
        ("negent", stats.negent, negent),
    ):
        _close(case, got, want, what)
    weights = torch.linspace(-1, 1, lse.shape[0])
    objective = lambda s: (weights * (s[1][:, 0] - s[0] + 0.3 * s[2])).sum()  # noqa: E731
    _same_gradients(case, objective(stats), objective((lse, picked, negent)), inp.leaves)


def _preparers(case: Case) -> None:
    inp = _inputs(case)
    data = _data(inp)
    want = _plain_logprobs(inp)
    rows, _ = prepare_loss_input(inp.library, data, NLLLossFn())
    _close(case, rows["next_token_logprobs"], want, "prepare_loss_input")
    packed_logits, cu = _packed(inp)
    packed, _ = prepare_packed_loss_input(packed_logits, data, NLLLossFn(), cu, cu)
    got = packed["next_token_logprobs"]  # [B, T - 1], zero past each sequence
    real = data["token_mask"][:, 1:] > 0
    _close(case, got[real], want[real], "prepare_packed_loss_input")
    weights = torch.linspace(-1, 1, want.numel()).view_as(want) * real
    _same_gradients(case, (rows["next_token_logprobs"] * weights).sum(), (want * weights).sum(), inp.leaves)
    _same_gradients(case, (got * weights).sum(), (want * weights).sum(), inp.leaves)


def _entry_points(case: Case) -> None:
    inp = _inputs(case)
    data = _data(inp)
    gs = data["sample_mask"].sum()
    gt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    want = _plain_nll(inp, data, gt)
    loss, metrics = wrap_loss_fn_with_input_preparation(
        inp.library, data, gs, gt, loss_fn=NLLLossFn(), prepare_fn=prepare_loss_input
    )
    _close(case, loss, want, "wrap_loss_fn_with_input_preparation")
    assert metrics["num_unmasked_tokens"] == gt
    _same_gradients(case, loss, want, inp.leaves)
    _, cu = _packed(inp)
    wrapper = SequencePackingFusionLossWrapper(NLLLossFn(), prepare_packed_loss_input, cu, cu)
    packed_logits, _ = _packed(inp, wrapper.layout.tokens)
    loss, metrics = wrapper(packed_logits, data, gs, gt)
    _close(case, loss, want, "SequencePackingFusionLossWrapper")
    assert metrics["num_unmasked_tokens"] == gt
    _same_gradients(case, loss, want, inp.leaves)


CHECKS = {"vocab_reduce": _vocab_primitive, "preparers": _preparers, "entry_points": _entry_points}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_grid_equals_plain_torch(case, check):
    CHECKS[check](case)


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("case", REALISTIC, ids=[c.id for c in REALISTIC])
def test_a_realistic_vocabulary_equals_plain_torch(case, check):
    CHECKS[check](case)
