"""Reference acceptance checks for the packing wrappers and layout utilities.

Ports the CPU-applicable checks of the behaviour reference:
- §12.4 `_pack_input_ids` regressions, the `_pack_sequences_for_megatron` CP layout
  example, `test_sequence_packing_fusion` (cp = tp = 1) and
  `test_sequence_packing_gradients` (cp = 1).
- §7.1 the extrema registries.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from common import cumsum, pack_rows, padding_slots
from tolerances import close

from compiled_loss.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
)
from compiled_loss.loss_input import (
    TrainingSamplingParams,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from compiled_loss.metrics import aggregation, combine_metrics
from compiled_loss.utils import _pack_input_ids
from compiled_loss.wrapper import (
    _SEQ_METRIC_MAX,
    _SEQ_METRIC_MIN,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _unpack_grad(packed_grad: torch.Tensor, lengths: list[int], cu_padded: tuple[int, ...], width: int) -> torch.Tensor:
    """Map a packed `[1, T, ...]` gradient back to `[B, S, ...]` (zeros past each length)."""
    out = packed_grad.new_zeros((len(lengths), width) + tuple(packed_grad.shape[2:]))
    for i, length in enumerate(lengths):
        c = min(length, width)
        out[i, :c] = packed_grad[0, cu_padded[i] : cu_padded[i] + c]
    return out


def _assert_metrics_close(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(
            torch.as_tensor(got[key]).double(),
            torch.as_tensor(expected[key]).double(),
            **close(torch.float32, "reordered"),  # fp32 metrics, compared in float64
            msg=lambda m, k=key: f"metric {k!r}: {m}",
        )


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
    shards = [_pack_input_ids(ids, cu, cu, cp_rank=r, cp_size=cp_size, roll_shift=roll_shift) for r in range(cp_size)]
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
            seg = full[start : start + padded]
            want = torch.cat(
                [seg[r * chunk : (r + 1) * chunk], seg[(2 * cp_size - 1 - r) * chunk : (2 * cp_size - r) * chunk]]
            )
            assert torch.equal(local[start // cp_size : (start + padded) // cp_size], want)


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
    cu, cup = cumsum(lengths), cumsum(padded)
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
    packed = pack_rows(unpacked, lengths, cup, 3 * torch.randn(cup[-1], vocab))
    g_t = torch.tensor(float(sum(n - 1 for n in lengths)))
    g_s = torch.tensor(4.0)
    return dict(
        data=data, unpacked=unpacked, packed=packed, lengths=lengths, cu=cu, cup=cup, g_t=g_t, g_s=g_s, width=width
    )


@pytest.mark.parametrize("sampling", [None, TrainingSamplingParams(top_k=8, top_p=0.9)], ids=["plain", "top_k_top_p"])
def test_sequence_packing_fusion_matches_per_sequence_wrapper(sampling):
    b = _fusion_batch()
    assert b["cu"] == (0, 16, 48, 69, 117) and b["cup"] == (0, 16, 48, 70, 118)
    assert b["g_t"].item() == 113.0
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())

    results = {}
    for name, cls, prep in (
        ("seq", SequencePackingLossWrapper, functools.partial(prepare_loss_input, sampling_params=sampling)),
        (
            "fused",
            SequencePackingFusionLossWrapper,
            functools.partial(prepare_packed_loss_input, sampling_params=sampling),
        ),
    ):
        logits = b["packed"].detach().clone().requires_grad_()
        wrapper = cls(loss_fn, prep, b["cu"], b["cup"])
        loss, metrics = wrapper(logits, b["data"], b["g_s"], b["g_t"])
        loss.backward()
        results[name] = (loss, metrics, logits.grad)

    (l1, m1, g1), (l2, m2, g2) = results["seq"], results["fused"]
    assert torch.isfinite(l1)
    torch.testing.assert_close(l2, l1, **close(torch.float32, "reordered"))
    torch.testing.assert_close(g2, g1, **close(torch.float32, "reordered"))
    assert g1.abs().sum() > 0
    assert torch.all(g1[0, padding_slots(b["lengths"], b["cup"], b["width"])] == 0)
    _assert_metrics_close(m2, m1)
    for key, value in m1.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key

    # both equal the unpacked baseline (token_mask zero past each length)
    base_logits = b["unpacked"].clone().requires_grad_()
    base_loss, base_metrics = wrap_loss_fn_with_input_preparation(
        base_logits,
        b["data"],
        b["g_s"],
        b["g_t"],
        loss_fn=loss_fn,
        prepare_fn=functools.partial(prepare_loss_input, sampling_params=sampling),
    )
    base_loss.backward()
    torch.testing.assert_close(l1, base_loss, **close(torch.float32, "reordered"))
    torch.testing.assert_close(
        _unpack_grad(g1, b["lengths"], b["cup"], b["width"]), base_logits.grad, **close(torch.float32, "reordered")
    )
    _assert_metrics_close(m1, base_metrics)


def test_sequence_packing_wrappers_accept_tensor_boundaries():
    b = _fusion_batch(7)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
    ref, _ = SequencePackingLossWrapper(loss_fn, prepare_loss_input, b["cu"], b["cup"])(
        b["packed"], b["data"], b["g_s"], b["g_t"]
    )
    for cls, prep in (
        (SequencePackingLossWrapper, prepare_loss_input),
        (SequencePackingFusionLossWrapper, prepare_packed_loss_input),
    ):
        wrapper = cls(loss_fn, prep, torch.tensor(b["cu"]), torch.tensor(b["cup"]))
        assert wrapper.cu_seqlens_q == b["cu"] and wrapper.cu_seqlens_q_padded == b["cup"]
        loss, _ = wrapper(b["packed"], b["data"], b["g_s"], b["g_t"])
        torch.testing.assert_close(loss, ref, **close(torch.float32, "reordered"))
    # cu_seqlens_q_padded defaults to cu_seqlens_q
    w = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, b["cup"])
    assert w.cu_seqlens_q_padded == b["cup"]


# ---------------------------------------------------------------------------------------
# §12.4 test_sequence_packing_gradients (cp = 1)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu_mode",
    ["true_lengths", "megatron_padded"],
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
        cu = cup = cumsum(lengths)
    else:  # Megatron: cu_seqlens_q IS the padded prefix sum, last segment inflated to 80 > S
        cu = cup = (0, 16, 32, 48, 128)
    pack_lengths = [cu[i + 1] - cu[i] for i in range(rows)]

    base_logits = torch.randn(rows, width, vocab, requires_grad=True)
    base_loss, base_metrics = wrap_loss_fn_with_input_preparation(
        base_logits,
        data,
        g_s,
        g_t,
        loss_fn=loss_fn,
        prepare_fn=prepare_loss_input,
    )
    base_loss.backward()

    leaf = base_logits.detach().clone().requires_grad_()
    packed = pack_rows(leaf, pack_lengths, cup, 3 * torch.randn(cup[-1], vocab)).detach().requires_grad_()
    if fused:
        wrapper = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, cu, cup)
    else:
        wrapper = SequencePackingLossWrapper(loss_fn, prepare_loss_input, cu, cup)
    loss, metrics = wrapper(packed, data, g_s, g_t)
    loss.backward()

    torch.testing.assert_close(loss, base_loss, **close(torch.float32, "reordered"))
    mapped = _unpack_grad(packed.grad, pack_lengths, cup, width)
    torch.testing.assert_close(mapped, base_logits.grad, **close(torch.float32, "reordered"))
    assert mapped.abs().sum() > 0
    assert torch.all(packed.grad[0, padding_slots(pack_lengths, cup, width)] == 0)
    if cu_mode == "megatron_padded":
        assert torch.all(packed.grad[0, 48 + 48 :] == 0)  # phantom tail of the inflated segment
    _assert_metrics_close(metrics, base_metrics)


# ---------------------------------------------------------------------------------------
# §7.1 extrema registries
# ---------------------------------------------------------------------------------------


def test_seq_metric_extrema_registries():
    """ref §7.1: the seed's sets exactly; every other extremum (the critic's, reported with
    ±inf sentinels) is registered through the one registry, so it combines with min/max."""
    reference_min = {"probs_ratio_min", "probs_ratio_clamped_min", "opd_full_reverse_kl_min"}
    reference_max = {
        "probs_ratio_max",
        "probs_ratio_clamped_max",
        "opd_full_reverse_kl_max",
        "opd_full_decomposition_error",
    }
    assert isinstance(_SEQ_METRIC_MIN, frozenset) and isinstance(_SEQ_METRIC_MAX, frozenset)
    assert (_SEQ_METRIC_MIN, _SEQ_METRIC_MAX) == (reference_min, reference_max)
    assert (aggregation("values_min"), aggregation("values_max"), aggregation("values_mean")) == ("min", "max", "sum")
    parts = [{"values_min": torch.tensor(v), "values_max": torch.tensor(v)} for v in (2.0, float("inf"), -1.0)]
    parts[1]["values_max"] = torch.tensor(float("-inf"))  # an empty micro-batch's sentinels
    combined = combine_metrics(parts)
    assert (combined["values_min"].item(), combined["values_max"].item()) == (-1.0, 2.0)
    # every ClippedPG extremum key is registered
    torch.manual_seed(0)
    b = _fusion_batch(3)
    _, metrics = wrap_loss_fn_with_input_preparation(
        b["unpacked"],
        b["data"],
        b["g_s"],
        b["g_t"],
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig()),
        prepare_fn=prepare_loss_input,
    )
    for key in metrics:
        if key.endswith("_min"):
            assert aggregation(key) == "min", key
        if key.endswith("_max"):
            assert aggregation(key) == "max", key
    assert {"probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"} <= set(metrics)


def test_wrappers_are_frozen_dataclasses():
    w = SequencePackingLossWrapper(ClippedPGLossFn(ClippedPGLossConfig()), prepare_loss_input, (0, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.loss_fn = None
    assert w.cu_seqlens_q == (0, 4) and w.cu_seqlens_q_padded == (0, 4)
