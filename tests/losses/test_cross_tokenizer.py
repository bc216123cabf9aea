"""Cross-tokenizer distillation (ref §4.8; the math is `compiled_loss.losses.cross_tokenizer`'s
docstring): every mode against a float64 implementation written here from that math —
value, every metric and the gradient (and for the plain sum, a closed-form gradient) —
through both packing wrappers with a teacher whose positions run past the student's
lengths, compiled, pickled, refused configs and inputs, the host-side alignment, and the
demo's digit teacher."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest
import torch
from cases import boundaries, pack_logits
from common import message
from tolerances import close

from compiled_loss.inputs import align_tokenizations
from compiled_loss.loss_functions import (
    ConfigError,
    CrossTokenizerDistillationLossConfig,
    CrossTokenizerDistillationLossFn,
)
from compiled_loss.loss_input import prepare_loss_input, prepare_packed_loss_input
from compiled_loss.losses import TokenProjection
from compiled_loss.packing import BucketGrid
from compiled_loss.train import CompileRecorder
from compiled_loss.vocab import LinearLogits
from compiled_loss.wrapper import (
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

F64 = torch.float64
B, S, V_S, V_T, S_T = 4, 6, 7, 5, 12

# teacher 0's projection [V_T, V_S]: rows 0 and 1 map exactly onto student token 2 (a
# collision), row 2 puts 0.7 on token 4, row 4 0.65 on token 5 (exact only when relaxed)
PROJECTION = torch.tensor(
    [
        [0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0],  # normalised to 1 on token 2
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.7, 0.3, 0.0],
        [0.2, 0.2, 0.0, 0.2, 0.0, 0.2, 0.2],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.65, 0.35],
    ],
    dtype=F64,
)
# the gold split by hand: (common teacher, common student, uncommon teacher, uncommon student)
STRICT = ([0], [2], [1, 2, 3, 4], [0, 1, 3, 4, 5, 6])
RELAXED = ([0, 2, 4], [2, 4, 5], [1, 3], [0, 1, 3, 6])


def _batch(seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Float64 student logits (a leaf) and data for two teachers: 0 on its own finer
    tokenization (`S_T = 2 S` positions, student position t aligned to 2t + 1, some
    unaligned), 1 sharing the student's vocabulary (identity alignment, one gap)."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, S, dtype=F64)
    for b, n in enumerate([4, 5, 6, 5]):
        token_mask[b, 1:n] = 1.0
    align0 = (2 * torch.arange(S) + 1).expand(B, S).clone()
    align0[0, 2] = align0[2, 4] = -1
    align1 = torch.arange(S).expand(B, S).clone()
    align1[1, 3] = -1
    data = {
        "input_ids": torch.randint(0, V_S, (B, S), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64),
        "teacher_0_logits": torch.randn(B, S_T, V_T, generator=g, dtype=F64) * 2,
        "teacher_0_alignment": align0,
        "teacher_1_logits": torch.randn(B, S, V_S, generator=g, dtype=F64) * 2,
        "teacher_1_alignment": align1,
    }
    logits = (torch.randn(B, S, V_S, generator=g, dtype=F64) * 2).requires_grad_()
    return logits, data


def _g_toks(data) -> torch.Tensor:
    return (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()


def _reference(logits, data, cfg: CrossTokenizerDistillationLossConfig, projections, splits=(None, None)):
    """(loss, metrics) from the module docstring's math, float64, position by position."""
    T, modes = cfg.temperature, cfg.kd_loss_mode
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    gt = _g_toks(data) + 1e-8
    y = data["input_ids"][:, 1:]
    z = logits[:, :-1]
    ce = -(torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0] * m).sum() / gt
    accuracy = ((z.argmax(-1) == y).to(F64) * m).sum() / gt
    log_p = torch.log_softmax(z / T, -1)
    aligned, masks, log_qs, rs = [], [], [], []
    for i, projection in enumerate(projections):
        u, a = data[f"teacher_{i}_logits"], data[f"teacher_{i}_alignment"][:, :-1]
        ut = torch.zeros(B, S - 1, u.shape[-1], dtype=F64)
        for b in range(B):
            for t in range(S - 1):
                if a[b, t] >= 0:
                    ut[b, t] = u[b, a[b, t]]
        aligned.append(ut)
        masks.append(m * (a >= 0))
        log_q = torch.log_softmax(ut / T, -1)
        r = log_q.exp()
        if projection is not None:
            r = r @ (projection / projection.sum(1, keepdim=True))
            r = r / r.sum(-1, keepdim=True)
        log_qs.append(log_q)
        rs.append(r)

    def kl(r, mask):
        return ((torch.xlogy(r, r) - r * log_p).sum(-1) * mask).sum() / gt

    metrics = {}
    if modes == "averaged_logits":
        w = torch.tensor(cfg.teacher_weights, dtype=F64) / sum(cfg.teacher_weights)
        mean = sum(w[i] * ut for i, ut in enumerate(aligned))
        kd = T**2 * kl(torch.softmax(mean / T, -1), masks[0] * masks[1])
        metrics.update({f"weight_t{i}": w[i] for i in range(2)})
    else:
        kds = []
        for i, (log_q, r, mask, split) in enumerate(zip(log_qs, rs, masks, splits)):
            if split is None:
                kd_i = T**2 * kl(r, mask)
                if cfg.gold_loss:
                    metrics[f"kl_common_t{i}"], metrics[f"l1_uncommon_t{i}"] = kd_i / T**2, torch.tensor(0.0, dtype=F64)
            else:
                ct, cs, ut_, us = (torch.tensor(x) for x in split)
                common = (log_q[..., ct].exp() * (log_q[..., ct] - log_p[..., cs])).sum(-1)
                k = min(len(ut_), len(us))
                q_sorted = log_q[..., ut_].exp().sort(-1, descending=True).values[..., :k]
                p_sorted = log_p[..., us].exp().sort(-1, descending=True).values[..., :k]
                l1 = (q_sorted - p_sorted).abs().sum(-1)
                kl_common, l1_mean = (common * mask).sum() / gt, (l1 * mask).sum() / gt
                metrics[f"kl_common_t{i}"], metrics[f"l1_uncommon_t{i}"] = kl_common, l1_mean
                kd_i = T**2 * (kl_common + l1_mean)
            kds.append(kd_i)
            metrics[f"kl_loss_t{i}"] = kd_i
        vocab = [log_q.shape[-1] for log_q in log_qs]
        nu = [math.log(v) / math.log(min(vocab)) if cfg.normalize_teacher_by_vocab else 1.0 for v in vocab]

        def local_mean(values, mask):
            return (values * mask).sum() / (mask.sum() + 1e-8)

        def score(i, metric):
            q = log_qs[i].exp()
            if metric == "ce":
                return local_mean(torch.log(rs[i].gather(-1, y[..., None])[..., 0] + 1e-10), masks[i])
            if metric == "entropy":
                return local_mean((q * log_qs[i]).sum(-1), masks[i])
            return local_mean(q.amax(-1), masks[i])

        if modes == "select_teacher":
            cross_entropy = [-score(i, "ce").item() for i in range(2)]
            best = cross_entropy.index(min(cross_entropy))
            w = torch.tensor([float(i == best) for i in range(2)], dtype=F64)
            metrics["selected_teacher"] = torch.tensor(float(best), dtype=F64)
        elif cfg.sum_weights_metric is not None:
            scores = torch.stack([nu[i] * score(i, cfg.sum_weights_metric) for i in range(2)]).detach()
            w = torch.softmax(cfg.alpha * scores, 0)
        else:
            w = torch.tensor(cfg.teacher_weights, dtype=F64)
        kd = sum(w[i] * nu[i] * kds[i] for i in range(2))
        metrics.update({f"weight_t{i}": w[i] for i in range(2)})
    if cfg.dynamic_loss_scaling:
        scale = (ce.abs() / kd.abs()).detach() if kd.abs() > 0 else torch.tensor(1.0, dtype=F64)
        loss = scale * kd + ce
    else:
        scale = torch.tensor(1.0, dtype=F64)
        loss = cfg.kl_loss_weight * kd + cfg.ce_loss_scale * ce
    metrics.update(
        loss=loss,
        kl_loss=kd,
        ce_loss=ce,
        kl_loss_scale=scale,
        accuracy=accuracy,
        num_valid_samples=data["sample_mask"].sum(),
    )
    return loss, metrics


CASES = {
    "sum": dict(teacher_weights=(0.4, 1.5), kl_loss_weight=0.6, ce_loss_scale=0.8, temperature=2.0),
    "gold_strict_dynamic_scaling": dict(
        teacher_weights=(0.4, 1.5), gold_loss=True, temperature=1.5, dynamic_loss_scaling=True
    ),
    "gold_xtoken": dict(teacher_weights=(1.0, 0.5), gold_loss=True, xtoken_loss=True),
    "weights_ce": dict(teacher_weights=(1.0, 1.0), sum_weights_metric="ce", alpha=2.0),
    "weights_entropy_by_vocab": dict(
        teacher_weights=(1.0, 1.0), sum_weights_metric="entropy", alpha=0.5, normalize_teacher_by_vocab=True
    ),
    "weights_max_prob": dict(teacher_weights=(1.0, 1.0), sum_weights_metric="max_prob", temperature=0.7),
    "select_teacher": dict(teacher_weights=(1.0, 1.0), kd_loss_mode="select_teacher", temperature=1.3),
    "averaged_logits": dict(teacher_weights=(0.3, 0.9), kd_loss_mode="averaged_logits", temperature=1.2),
}


def _setup(name: str, seed: int = 0):
    cfg = CrossTokenizerDistillationLossConfig(**CASES[name])
    logits, data = _batch(seed)
    projections = (PROJECTION, None)
    if cfg.kd_loss_mode == "averaged_logits":  # two teachers of the student's vocabulary
        data["teacher_0_logits"] = torch.randn(B, S_T, V_S, dtype=F64, generator=torch.Generator().manual_seed(9))
        projections = (None, None)
    splits = ((RELAXED if cfg.xtoken_loss else STRICT) if cfg.gold_loss else None, None)
    return cfg, logits, data, projections, splits


@pytest.mark.parametrize("name", list(CASES))
def test_value_metrics_and_gradient_match_the_reference_math(name):
    cfg, logits, data, projections, splits = _setup(name)
    loss_fn = CrossTokenizerDistillationLossFn(cfg, projections=projections)
    got, metrics = wrap_loss_fn_with_input_preparation(
        logits, data, data["sample_mask"].sum(), _g_toks(data), loss_fn, prepare_loss_input
    )
    want, want_metrics = _reference(logits, data, cfg, projections, splits)
    assert sorted(metrics) == sorted(want_metrics) == sorted(loss_fn.metric_normalizations)
    for key in want_metrics:
        torch.testing.assert_close(
            metrics[key].to(F64), want_metrics[key].detach(), **close(torch.float32, "reordered"), msg=key
        )
    torch.testing.assert_close(got.to(F64), want.detach(), **close(torch.float32, "reordered"))
    (grad,) = torch.autograd.grad(got, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad, want_grad, **close(torch.float32, "reordered"))


def test_sum_gradient_in_closed_form():
    """`∂/∂z_t = m_t / G_t · [ce_scale·(softmax(z_t) - e_y) + kl_weight·Σ_i w_i·[a_i ≥ 0]·T·(softmax(z_t/T) - r_i)]`."""
    cfg, logits, data, projections, _ = _setup("sum")
    loss_fn = CrossTokenizerDistillationLossFn(cfg, projections=projections)
    got, _ = wrap_loss_fn_with_input_preparation(
        logits, data, data["sample_mask"].sum(), _g_toks(data), loss_fn, prepare_loss_input
    )
    (grad,) = torch.autograd.grad(got, logits)
    z, T = logits.detach()[:, :-1], cfg.temperature
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    direct = cfg.ce_loss_scale * (torch.softmax(z, -1) - torch.nn.functional.one_hot(data["input_ids"][:, 1:], V_S))
    p_t = torch.softmax(z / T, -1)
    for i, (w, projection) in enumerate(zip(cfg.teacher_weights, projections)):
        u, a = data[f"teacher_{i}_logits"], data[f"teacher_{i}_alignment"][:, :-1]
        r = torch.softmax(u[torch.arange(B)[:, None], a.clamp(min=0)] / T, -1)
        if projection is not None:
            r = r @ (projection / projection.sum(1, keepdim=True))
        direct = direct + cfg.kl_loss_weight * w * (a >= 0)[..., None] * T * (p_t - r)
    want = torch.zeros_like(grad)
    want[:, :-1] = direct * m[..., None] / _g_toks(data)
    torch.testing.assert_close(grad, want, **close(torch.float32, "reordered"))


def test_the_exact_token_maps():
    projection = TokenProjection.of(PROJECTION)
    for relaxed, want in ((False, STRICT), (True, RELAXED)):
        assert [t.tolist() for t in projection.exact_map(relaxed)] == [list(x) for x in want]


def test_a_sparse_projection_equals_the_dense_one():
    cfg, logits, data, _, _ = _setup("gold_strict_dynamic_scaling")
    args = (data["sample_mask"].sum(), _g_toks(data))
    dense = CrossTokenizerDistillationLossFn(cfg, projections=(PROJECTION, None))
    sparse = CrossTokenizerDistillationLossFn(cfg, projections=(PROJECTION.to_sparse(), None))
    want, want_metrics = wrap_loss_fn_with_input_preparation(logits, data, *args, dense, prepare_loss_input)
    got, got_metrics = wrap_loss_fn_with_input_preparation(logits, data, *args, sparse, prepare_loss_input)
    torch.testing.assert_close(got, want)
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key], want_metrics[key], msg=key)


_CALL = CompileRecorder("aot_eager")
_COMPILED = _CALL.compile(lambda w, *a: w(*a), fullgraph=True)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_cls", [SequencePackingLossWrapper, SequencePackingFusionLossWrapper])
def test_packed_with_bucket_padding_equals_unpacked_and_compiles_once(wrapper_cls):
    """Teacher 0 is aligned to positions 2t + 1, past the student's lengths: its logits must
    reach the loss uncut. Two bucket padding rows, per-sequence padding, garbage in the
    padding slots; one graph, no break, no host sync."""
    cfg, logits, data, projections, _ = _setup("gold_strict_dynamic_scaling")
    cfg = CrossTokenizerDistillationLossConfig(**{**CASES["gold_strict_dynamic_scaling"], "sum_weights_metric": "ce"})
    data = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    logits = logits.detach().float().requires_grad_()
    loss_fn = CrossTokenizerDistillationLossFn(cfg, projections=projections)
    gs, gt = data["sample_mask"].sum(), _g_toks(data)
    want, want_metrics = wrap_loss_fn_with_input_preparation(logits, data, gs, gt, loss_fn, prepare_loss_input)
    (want_grad,) = torch.autograd.grad(want, logits)
    lengths = [4, 5, 6, 5]
    cu, cup = boundaries(lengths, [2, 0, 1, 3])
    prepare = prepare_packed_loss_input if wrapper_cls is SequencePackingFusionLossWrapper else prepare_loss_input
    wrapper = wrapper_cls(loss_fn, prepare, cu, cup, bucket=BucketGrid(tokens=32, rows=6, width=8))
    packed = pack_logits(logits.detach(), cu, cup, wrapper.layout.tokens, seed=3)
    before = _CALL.report.compiles
    got, got_metrics = _COMPILED(wrapper, packed, wrapper.layout.pad_data(data), gs, gt)
    assert sorted(got_metrics) == sorted(want_metrics)
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key], want_metrics[key], **close(torch.float32, "reordered"), msg=key)
    torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad(got, packed)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(grad[0, cup[i] : cup[i] + n], want_grad[i, :n])
    assert _CALL.report.compiles - before == 1 and _CALL.report.problems() == []


def test_pickle_and_deepcopy_give_identical_results():
    cfg, logits, data, projections, _ = _setup("gold_xtoken")
    loss_fn = CrossTokenizerDistillationLossFn(cfg, projections=(PROJECTION.to_sparse(), None))
    args = (data["sample_mask"].sum(), _g_toks(data))
    want, want_metrics = wrap_loss_fn_with_input_preparation(logits, data, *args, loss_fn, prepare_loss_input)
    for copied in (pickle.loads(pickle.dumps(loss_fn)), copy.deepcopy(loss_fn)):
        got, got_metrics = wrap_loss_fn_with_input_preparation(logits, data, *args, copied, prepare_loss_input)
        assert torch.equal(got, want)
        assert all(torch.equal(got_metrics[k], want_metrics[k]) for k in want_metrics)


@pytest.mark.parametrize(
    ("cfg", "projections", "text"),
    [
        (
            dict(xtoken_loss=True),
            None,
            "xtoken_loss=True requires gold_loss=True; xtoken_loss relaxes the gold loss's exact token map",
        ),
        (
            dict(kd_loss_mode="select_teacher", sum_weights_metric="entropy"),
            None,
            "sum_weights_metric='entropy' is only applied in kd_loss_mode='sum', not 'select_teacher'; unset one of them",
        ),
        (
            dict(kd_loss_mode="averaged_logits", normalize_teacher_by_vocab=True),
            None,
            "normalize_teacher_by_vocab is only applied in kd_loss_mode='sum', not 'averaged_logits'; unset one of them",
        ),
        (
            dict(kd_loss_mode="averaged_logits", teacher_weights=[0.0, 0.0]),
            None,
            "teacher_weights must not sum to zero in kd_loss_mode='averaged_logits' (they form a convex combination "
            "of teacher logits); got teacher_weights=[0.0, 0.0]",
        ),
        (
            dict(teacher_weights=[1.0, 1.0]),
            [PROJECTION],
            "per-teacher lists must be equal length, got {'teacher_weights': 2, 'projections': 1}",
        ),
        (
            dict(kd_loss_mode="averaged_logits", teacher_weights=[1.0, 1.0]),
            [None, PROJECTION],
            "kd_loss_mode='averaged_logits' averages the teachers' logits, so every teacher must share the student's "
            "vocabulary (projection None); teachers [1] have a projection",
        ),
        (dict(temperature=0.0), None, "temperature must be finite and > 0, got 0.0"),
        (dict(teacher_weights=[1.0, -0.5]), None, "teacher_weights[1] must be finite and >= 0, got -0.5"),
        (dict(teacher_weights=[1.0, "2"]), None, "teacher_weights[1] must be a float, got str '2'"),
        (dict(teacher_weights=[]), None, "teacher_weights must be a non-empty sequence of floats, got ()"),
        (dict(ce_loss_scale=math.nan), None, "ce_loss_scale must be finite, got nan"),
        (
            dict(kd_loss_mode="mean"),
            None,
            "kd_loss_mode must be one of 'sum', 'averaged_logits', 'select_teacher', got 'mean'",
        ),
        (
            dict(sum_weights_metric="loss"),
            None,
            "sum_weights_metric must be one of 'ce', 'entropy', 'max_prob', got 'loss'",
        ),
        (dict(dynamic_loss_scaling="yes"), None, "dynamic_loss_scaling must be a bool, got str 'yes'"),
        (
            dict(vocab_topk=8),
            None,
            "CrossTokenizerDistillationLossFn: unknown config keys ['vocab_topk']; valid keys: ['alpha', "
            "'ce_loss_scale', 'dynamic_loss_scaling', 'gold_loss', 'kd_loss_mode', 'kl_loss_weight', "
            "'normalize_teacher_by_vocab', 'sum_weights_metric', 'teacher_weights', 'temperature', 'xtoken_loss']",
        ),
    ],
)
def test_config_errors_name_the_field(cfg, projections, text):
    with pytest.raises(ConfigError) as info:
        CrossTokenizerDistillationLossFn(cfg, projections=projections)
    assert str(info.value) == text


def test_config_is_keyword_only_and_takes_a_hydra_list():
    with pytest.raises(TypeError):
        CrossTokenizerDistillationLossConfig((1.0,))
    assert CrossTokenizerDistillationLossConfig(teacher_weights=[0.5, 2]).teacher_weights == (0.5, 2)


@pytest.mark.parametrize(
    ("projection", "text"),
    [
        (PROJECTION[0], "ValueError: projections[0] must be a [V_t, V_s] matrix, got shape (7,)"),
        (-PROJECTION, "ValueError: projections[0] must hold finite, non-negative weights"),
        (
            PROJECTION * torch.tensor([0.0, 1, 1, 1, 1], dtype=F64)[:, None],
            "ValueError: projections[0]: every teacher token must map to some student token; rows [0] are empty",
        ),
        (
            [[1.0]],
            "TypeError: projections[0] must be a [V_t, V_s] tensor (dense or sparse COO) or a TokenProjection, "
            "got list",
        ),
    ],
)
def test_bad_projections_name_the_argument(projection, text):
    assert message(CrossTokenizerDistillationLossFn, {}, projections=[projection]) == text


def test_bad_inputs_name_the_argument():
    cfg, logits, data, projections, _ = _setup("sum")
    loss_fn = CrossTokenizerDistillationLossFn(cfg, projections=projections)
    args = (data["sample_mask"].sum(), _g_toks(data))

    def call(data=data, logits=logits, prepare=prepare_loss_input):
        return wrap_loss_fn_with_input_preparation(logits, data, *args, loss_fn, prepare)

    without = {k: v for k, v in data.items() if k != "teacher_1_alignment"}
    assert message(call, without).startswith(
        "ValueError: prepare_loss_input: data is missing key 'teacher_1_alignment'"
    )
    assert message(call, data, logits[:, :-1]) == (
        "ValueError: CrossTokenizerDistillationLossFn: logits must be [B, S, V_s] with [B, S] = (4, 6) (input_ids), "
        "got (4, 5, 7)"
    )
    assert message(call, {**data, "teacher_0_logits": data["teacher_0_logits"][..., :4]}) == (
        "ValueError: CrossTokenizerDistillationLossFn: teacher_full_logits_by_idx[0] must be [B, S_t, V_t] with "
        "B = 4, V_t = 5, got (4, 12, 4)"
    )
    assert message(call, {**data, "teacher_1_alignment": data["teacher_1_alignment"][:, :-1]}) == (
        "ValueError: CrossTokenizerDistillationLossFn: aligns_by_idx[1] ([B, S]) must have shape (4, 6), got (4, 5)"
    )
    assert message(call, {**data, "teacher_1_alignment": data["teacher_1_alignment"].double()}) == (
        "ValueError: CrossTokenizerDistillationLossFn: aligns_by_idx[1] must be an integer tensor, got torch.float64"
    )
    assert message(call, {**data, "teacher_0_alignment": data["teacher_0_alignment"] + 2}) == (
        "ValueError: CrossTokenizerDistillationLossFn: aligns_by_idx[0] must hold teacher positions in [-1, 12) "
        "(-1: no aligned position)"
    )
    assert message(loss_fn, logits, {0: data["teacher_0_logits"]}, {0: data["teacher_0_alignment"]}, data, *args) == (
        "ValueError: CrossTokenizerDistillationLossFn: teacher_full_logits_by_idx must hold teachers [0, 1], got [0]"
    )
    wide = CrossTokenizerDistillationLossFn(cfg, projections=(torch.ones(V_T, V_S + 1), None))
    assert message(wrap_loss_fn_with_input_preparation, logits, data, *args, wide, prepare_loss_input) == (
        "ValueError: CrossTokenizerDistillationLossFn: projections[0] maps onto 8 student tokens, the logits have 7"
    )
    linear = LinearLogits(torch.randn(B, S, 3, dtype=F64), torch.randn(V_S, 3, dtype=F64))
    assert message(call, data, linear) == (
        "ValueError: prepare_loss_input: CrossTokenizerDistillationLossFn reads the student's full distributions; "
        "pass the logits tensor, not LinearLogits"
    )


def test_align_tokenizations():
    # text "^ab cd$": student tokens "^", "ab ", "cd", "$"; teacher "^", "a", "b ", "c", "d$", plus an empty token
    student = [[1, 3, 2, 1], [1, 2]]
    teacher = [[1, 1, 2, 1, 2, 0], [0, 1, 1, 1]]
    assert align_tokenizations(student, teacher, 5).tolist() == [[0, 2, -1, 5, -1], [1, 3, -1, -1, -1]]
    assert message(align_tokenizations, student, teacher[:1], 5) == (
        "ValueError: align_tokenizations: student_lengths has 2 rows, teacher_lengths 1"
    )


def test_the_demo_digit_teacher():
    from compiled_loss.app import compose_config
    from compiled_loss.app.batches import annotate_cross_tokenizer, sample_batch
    from compiled_loss.config import loss_family
    from compiled_loss.demo import cross_tokenizer as demo

    ids = torch.tensor([[1, 3 + 7, 3 + 42, 2, 0]])  # BOS 7 42 EOS PAD
    teacher_ids, alignment = demo.tokenize(ids, torch.tensor([4]), compose_config())
    digit, space = demo.FIRST_DIGIT, demo.SPACE
    assert teacher_ids[0, :8].tolist() == [1, digit + 7, space, digit + 4, digit + 2, space, 2, 0]
    assert alignment.tolist() == [[0, 2, 5, 6, -1]]
    sampled, _ = demo.tokenize(torch.tensor([[1, 3 + 1234, 2]]), torch.tensor([3]), compose_config())
    assert sampled[0, :7].tolist() == [
        1,
        digit + 1,
        digit + 2,
        digit + 3,
        digit + 4,
        space,
        2,
    ]  # past the task's values
    projection = demo.teacher_projection(64, 70)
    torch.testing.assert_close(projection.sum(-1), torch.ones(demo.TEACHER_VOCAB_SIZE))
    assert projection[digit + 6].nonzero().flatten().tolist() == [3 + 6] + [3 + v for v in range(60, 64)]

    cfg = compose_config(
        "loss=cross_tokenizer", "loss.gold_loss=true", "model.vocab_size=80", "data.prompts=2", "data.response_max=12"
    )
    assert loss_family(cfg.loss) == "cross_tokenizer"
    loss_fn = demo.build_cross_tokenizer_loss(cfg)
    assert [t.tolist() for t in loss_fn._splits[0][:2]] == [
        [0, 1, 2, digit, digit + 7, digit + 8, digit + 9],
        [0, 1, 2, 3, 10, 11, 12],
    ]
    torch.manual_seed(0)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(0))
    data = annotate_cross_tokenizer(batch, loss_fn, demo.teacher_models(cfg), cfg)
    lengths = data.pop("input_lengths").tolist()
    assert data["teacher_0_logits"].shape[1:] == (demo.teacher_width(cfg), demo.TEACHER_VOCAB_SIZE)
    logits = torch.randn(*data["input_ids"].shape, cfg.model.vocab_size, requires_grad=True)
    args = (data["sample_mask"].sum(), _g_toks(data))
    want, want_metrics = wrap_loss_fn_with_input_preparation(logits, data, *args, loss_fn, prepare_loss_input)
    cu, cup = boundaries(lengths, [0] * len(lengths))
    wrapper = SequencePackingFusionLossWrapper(loss_fn, prepare_packed_loss_input, cu, cup)
    packed = pack_logits(logits.detach(), cu, cup, wrapper.layout.tokens, seed=0)
    got, got_metrics = wrapper(packed, data, *args)
    torch.testing.assert_close(got, want)
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key], want_metrics[key], msg=key)
