"""The core equality property once more under `torch.compile(backend="aot_eager",
fullgraph=True)`: compiled packing wrappers (one shared compiled call function, data padded
to one bucket) equal the eager per-sequence oracle — loss, every metric, real-slot
gradient, zero gradient elsewhere. Catches eager ≠ compiled differences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from reliability.oracle import (
    FIXED,
    Case,
    Packing,
    check_against_oracle,
    global_counts,
    hyp,
    make_data,
    make_logits,
    packings,
)

from compiled_loss.loss_functions import ClippedPGLossFn
from compiled_loss.loss_input import TrainingSamplingParams
from compiled_loss.packing import BucketGrid

pytestmark = pytest.mark.slow  # compiled wrappers on random cases

GRID = BucketGrid(tokens=32, rows=4, width=8)
AOT_EAGER = torch._dynamo.lookup_backend("aot_eager")
COMPILES = {"graphs": 0}


def counting_aot_eager(gm, example_inputs):
    """aot_eager, counting the graphs it is handed (proof that the calls were compiled)."""
    COMPILES["graphs"] += 1
    return AOT_EAGER(gm, example_inputs)


def _call(wrapper, logits, data, gs, gt):
    return wrapper(logits, data, gs, gt)


COMPILED_CALL = None


@pytest.fixture(scope="module", autouse=True)
def compiled_call():
    """One compiled call function for the module; dynamo reset once; recompiles (one per
    loss config and wrapper) may not silently fall back to eager."""
    global COMPILED_CALL
    torch._dynamo.reset()
    COMPILED_CALL = torch.compile(_call, backend=counting_aot_eager, fullgraph=True)
    with torch._dynamo.config.patch(
        recompile_limit=256,
        accumulated_recompile_limit=4096,
        fail_on_recompile_limit_hit=True,
        automatic_dynamic_shapes=False,
    ):
        yield
    torch._dynamo.reset()


CASES = {
    **FIXED,
    "gspo_seq_tis": Case(
        "pg",
        ClippedPGLossFn(
            {
                "token_level_loss": False,
                "sequence_level_importance_ratios": True,
                "reference_policy_kl_penalty": 0.05,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            }
        ),
        TrainingSamplingParams(top_p=0.8),
        label="gspo icepop top-p",
    ),
    "seq_filter_seq_mask_tis": Case(
        "pg",
        ClippedPGLossFn(
            {
                "force_on_policy_ratio": True,
                "seq_logprob_error_in_loss": True,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
                "reference_policy_kl_penalty": 0.1,
                "use_on_policy_kl_approximation": True,
            },
            seq_logprob_error_threshold=1.5,
        ),
        label="seq filter seq-mask-tis",
    ),
}
NAMES = list(CASES)


def fit(packing: Packing) -> Packing:
    """The packing shrunk into GRID (padding first, then lengths), data padded to it."""
    lengths, pads = list(packing.lengths), list(packing.pads)
    while sum(lengths) + sum(pads) > GRID.tokens:
        i = max(range(len(lengths)), key=lambda j: lengths[j] + pads[j])
        if pads[i]:
            pads[i] -= 1
        else:
            lengths[i] -= 1
    return Packing(tuple(lengths), tuple(pads), packing.width, GRID, True, packing.seed)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_wrappers_equal_per_sequence_oracle(name):
    """Compiled (aot_eager, fullgraph) packed loss/metrics/gradients == eager oracle; each
    wrapper × loss was compiled (graphs handed to the backend)."""
    case = CASES[name]
    before = COMPILES["graphs"]

    @hyp(5)
    @given(packings(pairs=case.pairs, widths=(1, 3, 5, 8), buckets=[GRID]).map(fit))
    def run(packing):
        data = make_data(case.family, packing.rows, packing.width, packing.seed)
        gs, gt = global_counts(case.family, data, packing.lengths)
        logits = make_logits(GRID.tokens, case.logit_width, packing.seed)
        check_against_oracle(case, packing, logits, data, gs, gt, call=COMPILED_CALL)

    run()
    assert COMPILES["graphs"] >= before + 2, f"{COMPILES['graphs'] - before} graphs compiled for two wrappers"
