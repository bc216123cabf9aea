"""`validate_batch`: host-side checks of a batch before compiled code reads it.

Compiled code cannot raise on bad values (an id past the vocabulary reads as logit 0, a
gather past it is a C++ assert under Inductor), so a trainer runs this once per step,
outside the compiled region: every key's shape and dtype, and — with one device sync for
all of them — every value check. The training step runs it by default.

The input preparation runs the same shape and dtype checks on every call
(`check_batch_shapes`: static, so they trace with no graph break and refuse a bad batch
before compiled code runs) and, in eager mode only, the token-id check of the keys it
reads (`check_token_ids`: one device sync).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from compiled_loss.losses.preference import check_pairs
from compiled_loss.vocab import DraftVocab

Tensor = torch.Tensor

TOKEN_KEYS = (
    "input_ids",
    "token_mask",
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
    "returns",
    "values",
)  # [B, S]
ROW_KEYS = (
    "sample_mask",
    "rewards",
    "pair_index",
    "is_chosen",
    "input_lengths",
    "reward_shift",
    "opd_full_teacher_index",
)  # [B]
POSITION_KEYS = {
    "teacher_topk_logits": "[B, S, k]",
    "teacher_topk_indices": "[B, S, k]",
    "opd_full_teacher_payload": "[B, S, D]",
}  # one entry per input position
INTEGER_KEYS = (
    "input_ids",
    "teacher_topk_indices",
    "pair_index",
    "is_chosen",
    "input_lengths",
    "opd_full_teacher_index",
)
FLAG_KEYS = ("is_chosen",)  # integer keys a bool tensor may also hold (True as 1, False as 0)
FLOAT_KEYS = ("teacher_topk_logits", "opd_full_teacher_payload")
ID_KEYS = ("input_ids", "teacher_topk_indices")  # token ids: in [0, V)


def _is_integer(t: Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def check_batch_shapes(data: Mapping[str, object], who: str | None = None) -> None:
    """ValueError / TypeError naming the key (after `who: ` when given) for a batch key that
    is not a tensor, `[B, S]` / `[B]` / `[B, S, ·]` shapes that disagree with `input_ids`
    (or `token_mask`), top-k teacher logits and indices of different shapes, integer keys
    of another dtype (`FLAG_KEYS` may also be bool) and teacher payloads that are not floating point. Reads shapes and
    dtypes only (no device value), so it traces with no graph break; keys it does not know
    are left alone."""
    at = "" if who is None else f"{who}: "
    known = TOKEN_KEYS + ROW_KEYS + tuple(POSITION_KEYS)
    for key in known:
        if key in data and not isinstance(data[key], Tensor):
            raise TypeError(f"{at}data[{key!r}] must be a tensor, got {type(data[key]).__name__}")
    tensors = {key: value for key in known if isinstance(value := data.get(key), Tensor)}
    reference = next((k for k in ("input_ids", "token_mask") if k in tensors), None)
    if reference is not None:
        if tensors[reference].dim() != 2:
            raise ValueError(f"{at}data[{reference!r}] must have shape [B, S], got {tuple(tensors[reference].shape)}")
        rows, width = tensors[reference].shape
        for key in TOKEN_KEYS:
            if key in tensors and tuple(tensors[key].shape) != (rows, width):
                raise ValueError(
                    f"{at}data[{key!r}] must have shape [B, S] = {(rows, width)}, got {tuple(tensors[key].shape)}"
                )
        for key in ROW_KEYS:
            if key in tensors and tuple(tensors[key].shape) != (rows,):
                raise ValueError(f"{at}data[{key!r}] must have shape [B] = {(rows,)}, got {tuple(tensors[key].shape)}")
        for key, shape in POSITION_KEYS.items():
            if key in tensors and (tensors[key].dim() != 3 or tuple(tensors[key].shape[:2]) != (rows, width)):
                raise ValueError(
                    f"{at}data[{key!r}] must have shape {shape} with [B, S] = {(rows, width)} (one entry "
                    f"per position of data[{reference!r}]), got {tuple(tensors[key].shape)}"
                )
    if "teacher_topk_logits" in tensors and "teacher_topk_indices" in tensors:
        logits, indices = tensors["teacher_topk_logits"].shape, tensors["teacher_topk_indices"].shape
        if logits != indices:
            raise ValueError(
                f"{at}data['teacher_topk_logits'] and data['teacher_topk_indices'] must have one shape, "
                f"got {tuple(logits)} and {tuple(indices)}"
            )
    for key in INTEGER_KEYS:
        if key in tensors and not _is_integer(tensors[key]):
            if key in FLAG_KEYS and tensors[key].dtype == torch.bool:
                continue
            kind = "an integer or bool" if key in FLAG_KEYS else "an integer"
            raise TypeError(f"{at}data[{key!r}] must be {kind} tensor, got {tensors[key].dtype}")
    for key in FLOAT_KEYS:
        if key in tensors and not tensors[key].dtype.is_floating_point:
            raise TypeError(f"{at}data[{key!r}] must be a floating-point tensor, got {tensors[key].dtype}")


def _raise_first(checks: dict[str, tuple[Tensor, Tensor, str]], at: str) -> None:
    """One device sync for all `checks` (key -> values, failing condition, what they must
    hold); ValueError naming the first failing key, its value and the value's index."""
    if not checks:
        return
    failing = torch.stack([bad.any() for _, bad, _ in checks.values()]).tolist()  # host: one sync
    for (key, (values, bad, expected)), failed in zip(checks.items(), failing):
        if failed:
            where = bad.nonzero()[0].tolist()  # host: error path only
            value = values[tuple(where)].item()  # host: error path only
            raise ValueError(f"{at}data[{key!r}] must hold {expected}, got {value} at index {tuple(where)}")


def _id_checks(data: Mapping[str, Tensor], keys: Iterable[str], vocab_size: int) -> dict[str, tuple]:
    """`_raise_first`'s checks of the token ids in `data[keys]` (the keys present, not empty)."""
    return {
        key: (
            data[key],
            (data[key] < 0) | (data[key] >= vocab_size),
            f"token ids in [0, {vocab_size}) (the vocabulary)",
        )
        for key in keys
        if key in data and data[key].numel()
    }


def check_token_ids(data: Mapping[str, Tensor], keys: Iterable[str], vocab_size: int, who: str) -> None:
    """Eager only (one device sync): ValueError naming `who`, the key, the first id of
    `data[key]` outside `[0, vocab_size)` and its index. Skipped while torch.compile traces
    (compiled code cannot raise; `validate_batch` checks on the host before it)."""
    if torch.compiler.is_compiling():
        return
    _raise_first(_id_checks(data, keys, vocab_size), f"{who}: ")


def validate_batch(
    data: Mapping[str, Tensor], *, vocab_size: int | None = None, d2t: Tensor | DraftVocab | None = None
) -> None:
    """ValueError / TypeError naming the key and the bad value, for: non-tensor values;
    the shapes and dtypes of `check_batch_shapes`; token ids or teacher top-k indices
    outside `[0, vocab_size)`; masks outside `[0, 1]` (NaN included); `input_lengths`
    outside `[0, S]`; a preference pair naming that is not one chosen and one rejected row
    per pair; a `d2t` mapping outside the vocabulary."""
    for key, value in data.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"data[{key!r}] must be a tensor, got {type(value).__name__}")
    if "token_mask" not in data and "input_ids" not in data:
        raise ValueError(f"data must hold 'input_ids' or 'token_mask' ([B, S]); present: {sorted(data)}")
    check_batch_shapes(data)
    width = data["input_ids" if "input_ids" in data else "token_mask"].shape[1]

    checks = {} if vocab_size is None else _id_checks(data, ID_KEYS, vocab_size)
    for key in ("token_mask", "sample_mask"):
        if key in data and data[key].numel():
            m = data[key].float()
            checks[key] = (data[key], ~((m >= 0) & (m <= 1)), "values in [0, 1]")
    if "input_lengths" in data and data["input_lengths"].numel():
        n = data["input_lengths"]
        checks["input_lengths"] = (n, (n < 0) | (n > width), f"lengths in [0, S = {width}]")
    _raise_first(checks, "")
    check_pairs(data, "data")
    if d2t is not None and vocab_size is not None:
        (d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t)).check_vocab(vocab_size)
