"""The reference-number tests of `test_reference_losses` (NeMo-RL's own tests, ref §12), run
with every logits tensor going through the fused LM-head path.

An autouse fixture replaces `prepare_loss_input` and `get_distillation_topk_logprobs_from_logits`
in the reference test module by wrappers that pass `LinearLogits(logits, I_V)` instead of the
logits `[..., V]`: the projection by the identity reproduces the logits exactly, and the
gradient reaches the original logits tensor through `hidden`. Every test of that module that
reaches one of those names (directly or through its helpers) is re-exported here unchanged,
with its parametrization; the fixture checks that the wrapper really ran, and
`test_reexports_cover_every_logits_test` that no such test was left out.
"""

from __future__ import annotations

import types

import pytest
import torch

# pytest runs with --import-mode=importlib and only tests/ on sys.path (pyproject's `pythonpath`), so a bare
# `import test_reference_losses` fails: the module loads through the namespace package `losses` (tests/losses),
# as a copy of its own, distinct from the one pytest collects: patching it never touches the original tests.
from losses import test_reference_losses as ref

from compiled_loss.vocab import LinearLogits

# the names through which the reference tests turn logits into loss inputs
PATCHED = ("prepare_loss_input", "get_distillation_topk_logprobs_from_logits")


def as_linear(logits: torch.Tensor) -> LinearLogits:
    """`logits [..., V]` as `LinearLogits(logits, I_V)`: same values, gradient through `hidden`."""
    assert isinstance(logits, torch.Tensor) and logits.dim() >= 1, type(logits)
    return LinearLogits(logits, torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device))


@pytest.fixture(autouse=True)
def fused_logits(monkeypatch):
    calls = {name: 0 for name in PATCHED}

    def fused(name):
        real = getattr(ref, name)

        def wrapper(logits, *args, **kwargs):
            calls[name] += 1
            return real(as_linear(logits), *args, **kwargs)

        return wrapper

    for name in PATCHED:
        monkeypatch.setattr(ref, name, fused(name))
    yield calls
    assert sum(calls.values()) > 0, "the test never reached the fused path"


# ---------------------------------------------------------------------------------------
# the re-exported reference tests (every one that reaches a PATCHED name)
# ---------------------------------------------------------------------------------------

test_clipped_pg_loss_ppo_clipping_through_exact_logits = ref.test_clipped_pg_loss_ppo_clipping_through_exact_logits
test_clipped_pg_loss_kl_penalty_through_exact_logits = ref.test_clipped_pg_loss_kl_penalty_through_exact_logits
test_nll_loss = ref.test_nll_loss
test_dpo_loss = ref.test_dpo_loss
test_dpo_preference_average_and_pre_rolled_reference = ref.test_dpo_preference_average_and_pre_rolled_reference
test_dpo_loss_varying_sequence_lengths = ref.test_dpo_loss_varying_sequence_lengths
test_dpo_sft_matches_nll_loss = ref.test_dpo_sft_matches_nll_loss
test_distillation_loss_hand_computed_single_token = ref.test_distillation_loss_hand_computed_single_token
test_distillation_loss_different_settings = ref.test_distillation_loss_different_settings
test_distillation_zero_outside_forward_bounds_renormalised_forward = (
    ref.test_distillation_zero_outside_forward_bounds_renormalised_forward
)
test_distillation_duplicated_indices_make_zero_outside_reverse_negative = (
    ref.test_distillation_duplicated_indices_make_zero_outside_reverse_negative
)
test_distillation_loss_topk_filtering = ref.test_distillation_loss_topk_filtering
test_distillation_loss_invalid_k_zero = ref.test_distillation_loss_invalid_k_zero
test_distillation_loss_gradient_flow = ref.test_distillation_loss_gradient_flow
test_distillation_loss_edge_cases = ref.test_distillation_loss_edge_cases
test_distillation_loss_fn_call = ref.test_distillation_loss_fn_call
test_subset_softmax_matches_full_vocab_reference = ref.test_subset_softmax_matches_full_vocab_reference


def _names(code: types.CodeType) -> set[str]:
    """Global names a function's code (and its nested functions / lambdas) reads."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _reaching_tests() -> set[str]:
    """Module-level test functions of `ref` that reach a PATCHED name, directly or through
    the module's own helper functions."""
    functions = {
        name: value
        for name, value in vars(ref).items()
        if isinstance(value, types.FunctionType) and value.__module__ == ref.__name__
    }
    reads = {name: _names(fn.__code__) for name, fn in functions.items()}
    reaching = {name for name, r in reads.items() if r & set(PATCHED)}
    while True:
        more = {name for name, r in reads.items() if r & reaching} - reaching
        if not more:
            break
        reaching |= more
    for cls in (v for v in vars(ref).values() if isinstance(v, type) and v.__module__ == ref.__name__):
        for attr, method in vars(cls).items():  # test classes: none may reach the fused path unseen
            if isinstance(method, types.FunctionType):
                assert not (_names(method.__code__) & (set(PATCHED) | reaching)), f"{cls.__name__}.{attr}"
    return {name for name in reaching if name.startswith("test_")}


def test_reexports_cover_every_logits_test(fused_logits):
    here = {
        name
        for name, value in globals().items()
        if name.startswith("test_") and getattr(value, "__module__", None) == ref.__name__
    }
    assert here == _reaching_tests()
    for name in here:  # the same function objects, marks (parametrizations) included
        assert globals()[name] is getattr(ref, name)
    # the fixture's wrapper is what the reference module now calls
    student = torch.randn(1, 3, 5, requires_grad=True)
    data = {"input_ids": torch.tensor([[0, 1, 2]]), "token_mask": torch.ones(1, 3), "sample_mask": torch.ones(1)}
    loss_input, _ = ref.prepare_loss_input(student, data, ref.NLLLossFn())
    assert fused_logits["prepare_loss_input"] == 1
    expected = torch.log_softmax(student, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(loss_input["next_token_logprobs"], expected)
    loss_input["next_token_logprobs"].sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
