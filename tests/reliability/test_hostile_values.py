"""Hostile values (NaN, +inf, -inf, 1e30).

(a) OUTSIDE the masks — packing-padding logit slots, the logits of each sequence's last
real position (they predict a token past the sequence), logits whose log-probs are masked
(prompt positions, masked rows: docs/deviations.md "Non-finite values outside the masks … log-probs …
reach no loss, metric or gradient"), data past each sequence's length,
data at prompt positions (token_mask 0), data of rows whose sample_mask is 0, teacher
top-k logits at masked positions — change nothing: loss, every metric and the gradient
equal the clean run's, for both packing wrappers.

(b) INSIDE the masks — the packing wrappers and the per-sequence oracle agree (both NaN
is agreement).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reliability.oracle import (
    ATOL,
    CASE_STRATEGIES,
    FAMILIES,
    RTOL,
    VOCAB,
    WRAPPERS,
    Packing,
    assert_metrics_equal,
    check_against_oracle,
    global_counts,
    hyp,
    layout_tokens,
    make_data,
    make_logits,
    packings,
    real_slots,
    run_wrapper,
    truncated_masks,
)

from compiled_loss.metrics import aggregation
from compiled_loss.wrapper import wrap_loss_fn_with_input_preparation

HOSTILE = [float("nan"), float("inf"), float("-inf"), 1e30]
BAD_IDS = {0: -1, 1: VOCAB + 7, 2: -1, 3: VOCAB}  # integer stand-ins, by HOSTILE index

# Which `[B, S, ...]` data keys align with which token_mask column: data[t] is read with the
# mask of column t + shift (ref §1.2; DPO's reference log-probs are pre-rolled, §4.4; the
# teacher's top-k at t predicts token t+1, §8.9; the value loss reads per-position, §4.7).
FLOAT_KEYS = (
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
    "returns",
    "values",
    "teacher_topk_logits",
)


def shift_of(family: str, key: str) -> int:
    if key == "teacher_topk_logits" or (family == "dpo" and key == "reference_policy_logprobs"):
        return 1
    return 0


def masked_positions(family: str, key: str, data: dict, packing) -> torch.Tensor:
    """bool `[B, S]`: inside sequence i's length, data[key][i, t] is never read unmasked
    (its token_mask column is 0; the first column of next-token-aligned keys; a shift-1
    key's last real position)."""
    tm = data["token_mask"]
    rows, width = tm.shape
    out = torch.zeros(rows, width, dtype=torch.bool)
    shift = shift_of(family, key)
    for i in range(rows):
        n = packing.real_len(i)
        for t in range(n):
            col = t + shift
            if col >= n or tm[i, col] == 0 or (family != "mse" and col == 0):
                out[i, t] = True
    return out


def masked_rows(sample_mask: torch.Tensor) -> torch.Tensor:
    """bool `[B]`: rows no value of which reaches a loss or metric — sample_mask 0, for DPO
    too (a pair with a masked row drops out of the pair's terms; each reward mean reads its
    rows under their own mask)."""
    return sample_mask == 0


def masked_logit_slots(family: str, data: dict, packing, tokens: int) -> torch.Tensor:
    """bool `[tokens]`: real slots whose logits feed only masked positions — the next-token
    position t (mask column t + 1) is masked, or the row is; value heads: column t itself."""
    tm = data["token_mask"]
    rows_off = masked_rows(data["sample_mask"])
    out = torch.zeros(tokens, dtype=torch.bool)
    cup = packing.cu_padded
    for i in range(packing.rows):
        n = packing.real_len(i)
        for t in range(n if family == "mse" else n - 1):
            col = t if family == "mse" else t + 1
            if rows_off[i] or tm[i, col] == 0:
                out[cup[i] + t] = True
    return out


def _set(t: torch.Tensor, where: torch.Tensor, value: float) -> int:
    where = where.reshape(where.shape + (1,) * (t.dim() - where.dim())).expand_as(t)
    t[where] = value
    return int(where.sum())


def inject(site: str, family: str, value_index: int, packing, logits: torch.Tensor, data: dict):
    """Dirty copies of (logits, data) with HOSTILE[value_index] at `site`; and how many
    entries were poisoned (the test asserts > 0)."""
    value = HOSTILE[value_index]
    logits = logits.detach().clone()
    data = {k: v.clone() for k, v in data.items()}
    rows, width = data["token_mask"].shape
    count = 0
    if site == "logits_padding_slots":
        pad = ~real_slots(packing, logits.shape[1])
        logits[0, pad] = value
        count = int(pad.sum()) * logits.shape[2]
    elif site == "logits_unevaluated":
        cup = packing.cu_padded
        for i in range(rows):
            n = packing.real_len(i)
            if n:
                logits[0, cup[i] + n - 1] = value
                count += logits.shape[2]
    elif site == "logits_masked_positions":
        where = masked_logit_slots(family, data, packing, logits.shape[1])
        logits[0, where] = value
        count = int(where.sum()) * logits.shape[2]
    elif site == "data_past_length":
        past = torch.arange(width)[None, :] >= torch.tensor([packing.real_len(i) for i in range(rows)])[:, None]
        for key, t in data.items():
            if t.dim() > 1 and t.shape[1] == width:
                if t.dtype.is_floating_point:
                    count += _set(t, past, value)
                else:
                    count += _set(t, past, BAD_IDS[value_index])
    elif site == "data_prompt_positions":
        for key in FLOAT_KEYS:
            count += _set(data[key], masked_positions(family, key, data, packing), value)
    elif site == "data_sample_mask_zero_rows":
        zero = masked_rows(data["sample_mask"])
        for key in FLOAT_KEYS:
            count += _set(data[key], zero[:, None].expand(rows, width), value)
    elif site == "teacher_masked_positions":
        where = masked_positions(family, "teacher_topk_logits", data, packing)
        where |= masked_rows(data["sample_mask"])[:, None]
        count += _set(data["teacher_topk_logits"], where, value)
    else:
        raise AssertionError(site)
    return logits.requires_grad_(), data, count


SITES = {
    "logits_padding_slots": FAMILIES,
    "logits_unevaluated": ("pg", "nll", "dpo", "distill"),  # value heads evaluate every real position
    "logits_masked_positions": FAMILIES,
    "data_past_length": FAMILIES,
    "data_prompt_positions": FAMILIES,
    "data_sample_mask_zero_rows": FAMILIES,
    "teacher_masked_positions": ("distill",),
}
OUTSIDE = [(site, family) for site, families in SITES.items() for family in families]


def _prepare_outside(site, family, packing, seed):
    """A clean batch shaped so that `site` is non-empty: a padded segment, a sequence shorter
    than S, prompt columns (row 0: two), a row with sample_mask 0."""
    lengths, pads = list(packing.lengths), list(packing.pads)
    lengths[0] = min(max(lengths[0], 2), packing.width - 1)
    pads[0] = max(pads[0], 1)
    packing = dataclasses.replace(packing, lengths=tuple(lengths), pads=tuple(pads))
    data = make_data(family, packing.rows, packing.width, seed)
    data["token_mask"][:, 0] = 0
    data["token_mask"][0, 1] = 0
    data["sample_mask"][-1] = 0
    if family == "dpo":
        data["sample_mask"][-2] = 0
    return packing, data


@pytest.mark.parametrize("site,family", OUTSIDE, ids=[f"{s}-{f}" for s, f in OUTSIDE])
def test_hostile_values_outside_masks_change_nothing(site, family):
    """NaN/±inf/1e30 outside the masks: loss, metrics and gradient equal the clean run's."""

    @hyp(6)
    @given(CASE_STRATEGIES[family](), packings(pairs=family == "dpo", widths=(3, 5, 8), min_len=1))
    def run(case, packing):
        packing, data = _prepare_outside(site, family, packing, packing.seed)
        gs, gt = global_counts(family, data, packing.lengths)
        clean = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
        for wrapper_cls in WRAPPERS:
            want, want_metrics, want_grad = run_wrapper(case, wrapper_cls, packing, clean, data, gs, gt)
            for value_index, value in enumerate(HOSTILE):
                logits, dirty, count = inject(site, family, value_index, packing, clean, data)
                assert count > 0, f"nothing injected at {site}"
                what = f"{wrapper_cls.__name__} with {value} at {site}"
                got, got_metrics, got_grad = run_wrapper(case, wrapper_cls, packing, logits, dirty, gs, gt)
                torch.testing.assert_close(
                    got.detach(), want.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: loss {m}"
                )
                assert_metrics_equal(got_metrics, want_metrics, what=what)
                torch.testing.assert_close(
                    got_grad, want_grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: gradient {m}"
                )

    run()


# ---------------------------------------------------------------------------------------
# (b) inside the masks
# ---------------------------------------------------------------------------------------

READ_KEYS = {
    "pg": ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"),
    "nll": (),
    "dpo": ("reference_policy_logprobs",),
    "distill": ("teacher_topk_logits",),
    "mse": ("returns", "values"),
}


def inject_inside(family: str, rnd: random.Random, packing, logits: torch.Tensor, data: dict):
    """Poison 1–3 entries that the masks keep: a logit row (or one vocab entry) at an
    evaluated position, or a read data key at a masked-in position."""
    logits = logits.detach().clone()
    data = {k: v.clone() for k, v in data.items()}
    tm, sm = data["token_mask"], data["sample_mask"]
    cup = packing.cu_padded
    evaluated_slots, data_spots = [], []
    for i in range(packing.rows):
        n = packing.real_len(i)
        for t in range(n):
            if family == "mse":
                if tm[i, t] * sm[i] > 0:
                    evaluated_slots.append(cup[i] + t)
                    data_spots += [(k, i, t) for k in READ_KEYS[family]]
            elif t + 1 < n and tm[i, t + 1] > 0 and sm[i] > 0:
                evaluated_slots.append(cup[i] + t)
                data_spots += [
                    (k, i, t + 1 - shift)
                    for k in READ_KEYS[family]
                    for shift in [1 if (k == "teacher_topk_logits" or family == "dpo") else 0]
                ]
    spots = [("logits", s) for s in evaluated_slots] + [("data", d) for d in data_spots]
    if not spots:
        return None
    for _ in range(rnd.randint(1, 3)):
        value = rnd.choice(HOSTILE)
        kind, where = rnd.choice(spots)
        if kind == "logits":
            if rnd.random() < 0.5 or logits.shape[2] == 1:
                logits[0, where] = value
            else:
                logits[0, where, rnd.randrange(logits.shape[2])] = value
        else:
            key, i, t = where
            data[key][i, t] = value
    return logits.requires_grad_(), data


def _inside_examples(family):
    return st.tuples(
        CASE_STRATEGIES[family](),
        packings(pairs=family == "dpo", widths=(2, 3, 5, 8), min_len=2),
        st.integers(0, 2**31 - 1),
    )


def _check_inside(family, example, parts):
    case, packing, seed = example
    data = make_data(family, packing.rows, packing.width, packing.seed)
    data["sample_mask"][0] = 1
    data["token_mask"][0, 1] = 1
    gs, gt = global_counts(family, data, packing.lengths)
    clean = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
    poisoned = inject_inside(family, random.Random(seed), packing, clean, data)
    assert poisoned is not None, "no position inside the masks"
    logits, dirty = poisoned
    check_against_oracle(case, packing, logits, dirty, gs, gt, equal_nan=True, parts=parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_hostile_values_inside_masks_agree_with_oracle(family):
    """NaN/±inf/1e30 inside the masks: packed loss, gradient and summed metrics == oracle
    (NaN == NaN)."""

    @hyp(25)
    @given(_inside_examples(family))
    def run(example):
        _check_inside(family, example, parts=("values",))

    run()


def _unpacked_metrics(case, packing: Packing, logits: torch.Tensor, data: dict, gs, gt) -> dict:
    """Metrics of ONE unpacked evaluation of the micro-batch (the reference's unpacked path):
    row i holds its first min(L_i, S) packed slots, data zeroed past each length."""
    cup = packing.cu_padded
    unpacked = logits.new_zeros(packing.rows, packing.width, logits.shape[2])
    for i in range(packing.rows):
        n = packing.real_len(i)
        unpacked[i, :n] = logits[0, cup[i] : cup[i] + n].detach()
    token_mask, _ = truncated_masks(data, packing.lengths)
    _, metrics = wrap_loss_fn_with_input_preparation(
        unpacked, {**data, "token_mask": token_mask}, gs, gt, loss_fn=case.loss_fn, prepare_fn=case.prepare(False)
    )
    return metrics


@pytest.mark.parametrize("family", ("pg", "mse"))
def test_hostile_values_inside_masks_extrema_follow_the_unpacked_evaluation(family):
    """NaN/±inf inside the masks: the packed min/max metrics are one unpacked evaluation's —
    NaN propagates, a genuine ±inf is reported (deviation in docs/deviations.md: §7.2's loop drops a
    sequence's non-finite extremum, which its own unpacked path does not)."""

    @hyp(15)
    @given(_inside_examples(family))
    def run(example):
        case, packing, seed = example
        data = make_data(family, packing.rows, packing.width, packing.seed)
        data["sample_mask"][0] = 1
        data["token_mask"][0, 1] = 1
        gs, gt = global_counts(family, data, packing.lengths)
        clean = make_logits(layout_tokens(case, packing), case.logit_width, packing.seed)
        logits, dirty = inject_inside(family, random.Random(seed), packing, clean, data)
        want = _unpacked_metrics(case, packing, logits, dirty, gs, gt)
        for wrapper_cls in WRAPPERS:
            _, got, _ = run_wrapper(case, wrapper_cls, packing, logits, dirty, gs, gt)
            for key in (k for k in want if aggregation(k) != "sum"):
                torch.testing.assert_close(
                    got[key],
                    want[key],
                    equal_nan=True,
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda m, k=key: f"{wrapper_cls.__name__} {k}: {m}",
                )

    run()
