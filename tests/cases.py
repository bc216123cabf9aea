"""Loss cases shared by the packing, split-invariance and compile tests: for each loss /
input type, a loss object, the data it reads and a logits builder, on random packings."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from tolerances import close

from compiled_loss.loss_functions import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    MseValueLossFn,
    NLLLossFn,
)
from compiled_loss.loss_input import TrainingSamplingParams, prepare_loss_input, prepare_packed_loss_input

VOCAB = 16
TOPK = 4


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make_loss: Callable[[], Any]
    pairs: bool = False  # rows are (chosen, rejected) pairs
    logit_width: int = VOCAB  # last dim of the logits (1 for value heads)
    sampling: TrainingSamplingParams | None = None
    teacher_heads: bool = False  # OPD_FULL from teacher hidden states through TEACHER_HEADS

    def prepare(self, packed: bool):
        base = prepare_packed_loss_input if packed else prepare_loss_input
        kwargs = {} if self.sampling is None else {"sampling_params": self.sampling}
        if self.teacher_heads:
            kwargs["teacher_output_layer_weight_by_index"] = TEACHER_HEADS
        return functools.partial(base, **kwargs) if kwargs else base


TEACHER_HIDDEN = 6
# two teacher LM heads [V, H], keyed by the index rows name in data["opd_full_teacher_index"]
TEACHER_HEADS = {
    2: torch.randn(VOCAB, TEACHER_HIDDEN, generator=torch.Generator().manual_seed(7)),
    5: torch.randn(VOCAB, TEACHER_HIDDEN, generator=torch.Generator().manual_seed(8)),
}


CASES = [
    Case("grpo", lambda: ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})),
    Case(
        "grpo_k1_onpolicy_kl",
        lambda: ClippedPGLossFn(
            {
                "reference_policy_kl_penalty": 0.1,
                "reference_policy_kl_type": "k1",
                "use_on_policy_kl_approximation": True,
            }
        ),
    ),
    Case("dual_clip_vapo", lambda: ClippedPGLossFn({"ratio_clip_c": 3.0, "positive_example_nll_weight": 0.5})),
    Case(
        "gspo_tis",
        lambda: ClippedPGLossFn(
            {
                "token_level_loss": False,
                "sequence_level_importance_ratios": True,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 1.5,
            }
        ),
    ),
    Case(
        "cispo_icepop",
        lambda: ClippedPGLossFn(
            {
                "use_cispo": True,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
                "reference_policy_kl_penalty": 0.0,
            }
        ),
    ),
    Case(
        "seq_mask_tis_seq_level",
        lambda: ClippedPGLossFn(
            {
                "token_level_loss": False,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
            }
        ),
    ),
    Case("reinforce", lambda: ClippedPGLossFn({"disable_ppo_ratio": True})),
    Case(
        "seq_filter",
        lambda: ClippedPGLossFn(
            {"force_on_policy_ratio": True, "seq_logprob_error_in_loss": True}, seq_logprob_error_threshold=2.0
        ),
    ),
    Case(
        "grpo_topk_topp",
        lambda: ClippedPGLossFn({"reference_policy_kl_penalty": 0.05}),
        sampling=TrainingSamplingParams(top_k=6, top_p=0.9),
    ),
    Case("nll", lambda: NLLLossFn()),
    Case("dpo_sft", lambda: DPOLossFn({"sft_loss_weight": 0.5, "preference_average_log_probs": True}), pairs=True),
    Case(
        "distill_mixed_zero_outside",
        lambda: DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 0.3, "zero_outside_topk": True}),
    ),
    Case("distill_reverse", lambda: DistillationLossFn({"kl_type": "reverse"})),
    Case(
        "opd_full_logits",
        lambda: ClippedPGLossFn(
            {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.05}, opd_full={"validate_decomposition": True}
        ),
    ),
    Case(
        "opd_full_hidden_seq_level",
        lambda: ClippedPGLossFn(
            {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.0, "token_level_loss": False},
            opd_full={"teacher_payload": "hidden_states", "compute_entropy": True},
        ),
        teacher_heads=True,
    ),
    Case("mse_value_clipped", lambda: MseValueLossFn({"cliprange": 0.2, "scale": 2.0}), logit_width=1),
]

CASE_BY_NAME = {c.name: c for c in CASES}


def make_batch(case: Case, lengths: list[int], width: int, seed: int) -> tuple[dict, torch.Tensor]:
    """Data `[B, S]` (token_mask zero past each row's length, as the unpacked baseline
    needs) and unpacked logits `[B, S, W]` (a leaf requiring grad)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    token_mask = torch.zeros(rows, width)
    for i, length in enumerate(lengths):
        token_mask[i, 1 : min(length, width)] = 1.0
    sample_mask = torch.ones(rows)
    if rows > 2:
        sample_mask[-1] = 0.0
    data = {
        "input_ids": torch.randint(0, VOCAB, (rows, width), generator=g),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": randn(rows, width),
        "prev_logprobs": -torch.rand(rows, width, generator=g) * 2,
        "generation_logprobs": -torch.rand(rows, width, generator=g) * 2,
        "reference_policy_logprobs": -torch.rand(rows, width, generator=g) * 2,
        "rewards": randn(rows),
        "teacher_topk_logits": randn(rows, width, TOPK) * 2,
        "teacher_topk_indices": torch.randint(0, VOCAB, (rows, width, TOPK), generator=g),
        "returns": randn(rows, width),
        "values": randn(rows, width),
    }
    if case.name.startswith("opd_full"):
        if case.teacher_heads:
            data["opd_full_teacher_payload"] = randn(rows, width, TEACHER_HIDDEN)
            data["opd_full_teacher_index"] = torch.tensor([(2, 5)[i % 2] for i in range(rows)])
        else:
            data["opd_full_teacher_payload"] = randn(rows, width, VOCAB) * 2
    logits = (randn(rows, width, case.logit_width) * 2).requires_grad_()
    return data, logits


def pack_logits(
    unpacked: torch.Tensor, cu: tuple[int, ...], cu_padded: tuple[int, ...], tokens: int, seed: int
) -> torch.Tensor:
    """Packed `[1, tokens, W]` logits: row i's first min(L_i, S) positions at its padded
    offset; every other slot random garbage (it must not matter). A leaf requiring grad."""
    rows, width, w = unpacked.shape
    g = torch.Generator().manual_seed(seed + 1)
    packed = torch.randn(tokens, w, generator=g) * 5
    for i in range(rows):
        n = min(cu[i + 1] - cu[i], width)
        packed[cu_padded[i] : cu_padded[i] + n] = unpacked[i, :n].detach()
    return packed[None].requires_grad_()


def unpack_grad(grad_packed: torch.Tensor, cu, cu_padded, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed gradient → `[B, S, W]` at real positions, and the packed gradient at every
    slot that holds no real token."""
    rows = len(cu) - 1
    out = torch.zeros(rows, width, grad_packed.shape[-1])
    pad = torch.ones(grad_packed.shape[1], dtype=torch.bool)
    for i in range(rows):
        n = min(cu[i + 1] - cu[i], width)
        out[i, :n] = grad_packed[0, cu_padded[i] : cu_padded[i] + n]
        pad[cu_padded[i] : cu_padded[i] + n] = False
    return out, grad_packed[0, pad]


def boundaries(lengths: list[int], pads: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    cu, cup = [0], [0]
    for length, pad in zip(lengths, pads):
        cu.append(cu[-1] + length)
        cup.append(cup[-1] + length + pad)
    return tuple(cu), tuple(cup)


def globals_for(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(global_valid_seqs, global_valid_toks) as the trainer computes them (ref §1.3)."""
    sm = data["sample_mask"]
    return sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()


def assert_metrics_close(got: dict, want: dict, **tol) -> None:
    """`tol`: `close(dtype, kind)` (`tests/tolerances.py`); a reduction reordered by default."""
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **(tol or close(torch.float32, "reordered")), msg=key)
