"""`validate_batch`: host-side checks of a batch before compiled code reads it.

Compiled code cannot raise on bad values (a gather past the vocabulary is a raw `index out
of bounds` in eager mode and a C++ assert under Inductor), so a trainer runs this once per
step, outside the compiled region: every key's shape and dtype, and — with one device
sync for all of them — every value check. The training step runs it by default.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from compiled_loss.losses.preference import check_pairs
from compiled_loss.vocab import DraftVocab

Tensor = torch.Tensor

TOKEN_KEYS = ("input_ids", "token_mask", "advantages", "prev_logprobs", "generation_logprobs",
              "reference_policy_logprobs", "returns", "values")  # [B, S]
ROW_KEYS = ("sample_mask", "rewards", "pair_index", "is_chosen", "input_lengths", "reward_shift",
            "opd_full_teacher_index")  # [B]
INTEGER_KEYS = ("input_ids", "teacher_topk_indices", "pair_index", "is_chosen", "input_lengths",
                "opd_full_teacher_index")


def _is_integer(t: Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def validate_batch(
    data: Mapping[str, Tensor], *, vocab_size: int | None = None, d2t: Tensor | DraftVocab | None = None
) -> None:
    """ValueError / TypeError naming the key and the bad value, for: non-tensor values;
    `[B, S]` / `[B]` / `[B, S, k]` shapes that disagree; integer keys of another dtype;
    token ids or teacher top-k indices outside `[0, vocab_size)`; masks outside `[0, 1]`
    (NaN included); `input_lengths` outside `[0, S]`; a preference pair naming that is not
    one chosen and one rejected row per pair; a `d2t` mapping outside the vocabulary."""
    for key, value in data.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"data[{key!r}] must be a tensor, got {type(value).__name__}")
    if "token_mask" not in data and "input_ids" not in data:
        raise ValueError(f"data must hold 'input_ids' or 'token_mask' ([B, S]); present: {sorted(data)}")
    rows, width = data["input_ids" if "input_ids" in data else "token_mask"].shape[:2]
    for key in TOKEN_KEYS:
        if key in data and tuple(data[key].shape) != (rows, width):
            raise ValueError(f"data[{key!r}] must have shape [B, S] = {(rows, width)}, got {tuple(data[key].shape)}")
    for key in ROW_KEYS:
        if key in data and tuple(data[key].shape) != (rows,):
            raise ValueError(f"data[{key!r}] must have shape [B] = {(rows,)}, got {tuple(data[key].shape)}")
    for key in ("teacher_topk_logits", "teacher_topk_indices", "opd_full_teacher_payload"):
        if key in data and (data[key].dim() != 3 or tuple(data[key].shape[:2]) != (rows, width)):
            raise ValueError(f"data[{key!r}] must have shape [B, S, k] with [B, S] = {(rows, width)}, got "
                             f"{tuple(data[key].shape)}")
    if "teacher_topk_logits" in data and "teacher_topk_indices" in data:
        logits, indices = data["teacher_topk_logits"].shape, data["teacher_topk_indices"].shape
        if logits != indices:
            raise ValueError("data['teacher_topk_logits'] and data['teacher_topk_indices'] must have one shape, got "
                             f"{tuple(logits)} and {tuple(indices)}")
    for key in INTEGER_KEYS:
        if key in data and not _is_integer(data[key]):
            raise TypeError(f"data[{key!r}] must be an integer tensor, got {data[key].dtype}")

    checks: dict[str, tuple[Tensor, str]] = {}  # failing condition per key, and what it means
    if vocab_size is not None:
        for key in ("input_ids", "teacher_topk_indices"):
            if key in data and data[key].numel():
                v = data[key]
                checks[key] = ((v < 0) | (v >= vocab_size), f"token ids in [0, {vocab_size}) (the vocabulary)")
    for key in ("token_mask", "sample_mask"):
        if key in data and data[key].numel():
            m = data[key].float()
            checks[key] = (~((m >= 0) & (m <= 1)), "values in [0, 1]")
    if "input_lengths" in data and data["input_lengths"].numel():
        n = data["input_lengths"]
        checks["input_lengths"] = ((n < 0) | (n > width), f"lengths in [0, S = {width}]")
    if checks:
        failing = torch.stack([bad.any() for bad, _ in checks.values()]).tolist()  # host: one sync
        for (key, (bad, expected)), failed in zip(checks.items(), failing):
            if failed:
                where = bad.nonzero()[0].tolist()  # host: error path only
                value = data[key][tuple(where)].item()  # host: error path only
                raise ValueError(f"data[{key!r}] must hold {expected}, got {value} at index {tuple(where)}")
    check_pairs(data, "data")
    if d2t is not None and vocab_size is not None:
        (d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t)).check_vocab(vocab_size)
