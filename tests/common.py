"""Shared test helpers (reference test fixtures, ref §12 conventions)."""

from __future__ import annotations

import math

import torch

# Hydra overrides for runner tests: the embedded model and task at test size, with a bucket
# grid that small batches fill (SMALL_RUN), a shorter task on a 32-token vocabulary (TINY_TASK),
# or the task the learning tests train on (LEARNING_TASK: a 64-wide LM over 32 tokens)
SMALL_RUN = [
    "model.vocab_size=96",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.max_positions=64",
    "data.prompts=4",
    "data.group_size=2",
    "data.modulus=16",
    "data.response_median=5",
    "data.response_max=12",
    "data.prompt_terms_max=5",
    "packing.tokens=32",
    "packing.width=24",
    "packing.rows=4",
]
_TASK_32 = [  # the task on a 32-token vocabulary
    "model.vocab_size=32",
    "model.num_heads=2",
    "model.max_positions=64",
    "data.modulus=16",
    "data.prompt_terms_max=5",
    "data.response_max=12",
    "data.total_terms=10",
]
TINY_TASK = [*_TASK_32, "model.hidden_size=32", "data.prompts=4", "data.group_size=4"]
LEARNING_TASK = [*_TASK_32, "model.hidden_size=64", "data.prompts=8", "data.group_size=8"]


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


def message(fn, *args, **kwargs) -> str:
    """`"<ExceptionType>: <message>"` of the error `fn(*args, **kwargs)` raises (pinned by tests)."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


def cumsum(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def pack_rows(
    unpacked: torch.Tensor, lengths: list[int], cu_padded: tuple[int, ...], filler: torch.Tensor
) -> torch.Tensor:
    """Differentiable packing `[B, S, ...]` → `[1, T, ...]`: segment i occupies slots
    `[cu_padded[i], cu_padded[i+1])`, its first `min(L_i, S)` slots hold row i's first
    positions, the other slots come from `filler` (`[T, ...]`, arbitrary junk)."""
    width = unpacked.shape[1]
    pieces = []
    for i, length in enumerate(lengths):
        c = min(length, width)
        start, end = cu_padded[i], cu_padded[i + 1]
        pieces.append(unpacked[i, :c])
        pieces.append(filler[start + c : end])
    return torch.cat(pieces, 0)[None]


def padding_slots(lengths: list[int], cu_padded: tuple[int, ...], width: int) -> torch.Tensor:
    keep = torch.zeros(cu_padded[-1], dtype=torch.bool)
    for i, length in enumerate(lengths):
        keep[cu_padded[i] : cu_padded[i] + min(length, width)] = True
    return ~keep


_SYNC_CALLS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "unique", "masked_select"}


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Records the tensor calls that read device values on the host (`.item()`,
    `.tolist()`, `nonzero`, `bool(t)`, boolean-mask indexing, …) made inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        bool_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:]
        )
        if name in _SYNC_CALLS or bool_index:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))
