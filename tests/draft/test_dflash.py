"""DFlash block drafter runtime (ref §11.3 "DSpark / DFlash", §7.7): anchor sampling and the
eval-mask rules on hand-made cases, the loss and its gradient against a float64
computation written here, packed == unpacked, one compile over varying anchors, and a short
training run against a frozen random policy."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F
from tolerances import close

from compiled_loss.app.batches import sample_batch
from compiled_loss.checks import ConfigError
from compiled_loss.config import DataConfig, ModelConfig
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft import DraftBatch, anchor_noise, anchor_seed
from compiled_loss.draft.dflash import (
    FIRST_SUPERVISED_SLOT,
    DFlashConfig,
    DFlashRuntime,
    block_targets,
    build_dflash_runtime,
    select_anchors,
)
from compiled_loss.train import CompileRecorder
from compiled_loss.vocab import total_variation

SMALL = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, max_positions=256)


@pytest.fixture
def one_thread():
    """Tiny models run one op after another: on a busy 2-core machine a second intra-op
    thread only waits for a time slice at every op (measured: 1 s runs taking 50 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _policy(cfg: ModelConfig = SMALL, head_scale: float = 1.0, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    policy = TinyLM(cfg).requires_grad_(False)
    with torch.no_grad():
        policy.head.weight.mul_(head_scale)  # a sharper (still random, frozen) teacher
    return policy


def _unpacked_batch(policy: TinyLM, runtime: DFlashRuntime, ids, lengths, loss_mask, noise) -> DraftBatch:
    """`[B, S]` rows, one document per row (id = row, -1 past its length)."""
    rows, width = ids.shape
    positions = torch.arange(width).expand(rows, width)
    docs = torch.where(positions < lengths[:, None], torch.arange(rows)[:, None], -1)
    with torch.no_grad():
        logits, hidden = policy(ids, positions, docs, return_hidden=True)
    aux = torch.cat([hidden[i + 1] for i in runtime.drafter.aux_layers], -1)
    return DraftBatch(ids, aux, logits, loss_mask * (docs >= 0), docs, positions, noise)


def _pack(batch: DraftBatch, lengths: list[int], width: int, fill: float = 0.0) -> DraftBatch:
    """The same documents in one row `[1, width]` (document order kept, padding at the end);
    float padding slots hold `fill`."""

    def pack(x, pad):
        parts = [x[i, :n] for i, n in enumerate(lengths)]
        total = sum(lengths)
        tail = x.new_full((width - total, *x.shape[2:]), pad)
        return torch.cat(parts + [tail])[None]

    return DraftBatch(
        pack(batch.input_ids, 0),
        pack(batch.hidden_states, fill),
        pack(batch.teacher_logits, fill),
        pack(batch.loss_mask, 0.0),
        pack(batch.document_ids, -1),
        pack(batch.position_ids, 0),
        pack(batch.anchor_noise, 0.5),
    )


def _task_batch(policy: TinyLM, runtime: DFlashRuntime, data: DataConfig, rng: random.Random, step: int):
    b = sample_batch(data, policy.cfg.vocab_size, rng)
    rows, width = b["input_ids"].shape
    mask = b["token_mask"] * b["sample_mask"][:, None]
    noise = anchor_noise((rows, width), anchor_seed(0, step, 0))
    return _unpacked_batch(policy, runtime, b["input_ids"], b["input_lengths"], mask, noise)


# ---------------------------------------------------------------------------------------
# Anchors and the eval mask (ref §11.3)
# ---------------------------------------------------------------------------------------


def _eval(loss_mask, docs, anchors, block_size=5, ids=None, in_draft=None):
    loss_mask = torch.tensor(loss_mask, dtype=torch.float32)
    docs = torch.tensor(docs)
    ids = torch.zeros_like(docs) if ids is None else torch.tensor(ids)
    anchors = torch.tensor(anchors)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    return block_targets(ids, loss_mask, docs, anchors, keep, block_size, in_draft)


def test_eval_mask_is_a_contiguous_prefix_of_supervised_slots():
    # one document; the label at position 4 is unsupervised: the block at 1 stops before it
    blocks = _eval([[0, 0, 1, 1, 0, 1, 1, 1, 1, 0]], [[0] * 10], [1, 4, 7])
    assert blocks.eval_mask.tolist() == [
        [0, 1, 1, 0, 0],  # labels 2, 3 supervised; 4 not; 5 after the hole
        [0, 1, 1, 1, 1],  # labels 5..8
        [0, 1, 0, 0, 0],  # label 8; 9 unsupervised; 10, 11 outside the row
    ]
    assert blocks.teacher_index.tolist()[1] == [3, 4, 5, 6, 7]  # slot j reads the logits at p + j - 1


def test_eval_mask_stops_at_the_document_boundary_and_the_row_end():
    docs = [[0, 0, 0, 0, 1, 1, 1, 1, -1, -1], [2, 2, 2, 2, 2, 2, -1, -1, -1, -1]]
    mask = [[0, 1, 1, 1, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    blocks = _eval(mask, docs, [1, 5, 12], block_size=4)
    assert blocks.eval_mask.tolist() == [
        [0, 1, 1, 0],  # labels 2, 3 in document 0; 4 is document 1
        [0, 1, 1, 0],  # labels 6, 7; 8 is padding
        [0, 1, 1, 1],  # row 1, anchor 2: labels 3, 4, 5
    ]
    end = _eval([[0, 1, 1, 1]], [[0, 0, 0, 0]], [2], block_size=4)  # labels 4, 5 lie past the row
    assert end.eval_mask.tolist() == [[0, 1, 0, 0]]


def test_eval_mask_unsupervised_first_label_and_unmappable_labels():
    ids = [[5, 6, 7, 8, 9, 10, 11, 12]]
    # the first label unsupervised: nothing after it counts, however supervised
    assert _eval([[0, 0, 1, 1, 1, 1, 1, 1]], [[0] * 8], [0], ids=ids).eval_mask.tolist() == [[0, 0, 0, 0, 0]]
    in_draft = torch.ones(16, dtype=torch.bool)
    in_draft[8] = False  # target id 8 has no draft id: the prefix ends before it
    blocks = _eval([[0, 1, 1, 1, 1, 1, 1, 1]], [[0] * 8], [0, 3], ids=ids, in_draft=in_draft)
    assert blocks.eval_mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert blocks.labels.tolist()[0] == [5, 6, 7, 8, 9]


def test_anchor_candidates_and_fewer_candidates_than_anchors():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1], [2, 2, 2, 3, 3, 3, 3, -1]])
    noise = torch.rand(2, 8, generator=torch.Generator().manual_seed(3))
    # candidates p (flat): next token supervised in p's document: 1, 2, 4 | 8, 9 — not 3 (next is
    # another document), not 5 (next is padding), not 10 (next in document 3)
    anchors, keep = select_anchors(loss_mask, docs, noise, 7)
    assert anchors.tolist() == [1, 2, 4, 8, 9, 0, 0]
    assert keep.tolist() == [True] * 5 + [False] * 2
    blocks = block_targets(torch.zeros(2, 8, dtype=torch.long), loss_mask, docs, anchors, keep, 3)
    assert blocks.eval_mask[5:].sum() == 0  # padded anchors supervise nothing
    # more candidates than anchors: the two with the largest noise, in position order
    anchors, keep = select_anchors(loss_mask, docs, noise, 2)
    flat = noise.flatten()
    best = sorted(sorted([1, 2, 4, 8, 9], key=lambda i: -flat[i])[:2])
    assert anchors.tolist() == best and keep.tolist() == [True, True]
    # no candidate at all, and more anchors than slots
    anchors, keep = select_anchors(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long), torch.rand(1, 3), 5)
    assert anchors.tolist() == [0] * 5 and not keep.any()


# ---------------------------------------------------------------------------------------
# Loss against float64
# ---------------------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, max_positions=32)
D2T = torch.tensor([0, 0, 1, 1, 2, 3, 4])  # draft ids -> target ids 0, 1, 3, 4, 6, 8, 10


def _tiny_case(seed: int = 0):
    cfg = DFlashConfig(
        block_size=4,
        num_anchors=6,
        loss_decay_gamma=2.0,
        ce_loss_alpha=0.8,
        l1_loss_alpha=0.7,
        confidence_head_alpha=0.3,
        hidden_size=8,
        num_heads=2,
        token_chunk_size=5,
    )
    torch.manual_seed(seed)
    runtime = build_dflash_runtime(cfg, TINY, d2t=D2T)
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([[0] * 6 + [1] * 5 + [-1], [2] * 9 + [-1] * 3])
    batch = DraftBatch(
        input_ids=torch.randint(0, 11, (2, 12), generator=g),
        hidden_states=torch.randn(2, 12, 16, generator=g),
        teacher_logits=2 * torch.randn(2, 12, 11, generator=g),
        loss_mask=(torch.rand(2, 12, generator=g) < 0.8).float() * (docs >= 0),
        document_ids=docs,
        position_ids=torch.tensor([list(range(6)) + list(range(6)), list(range(12))]),
        anchor_noise=torch.rand(2, 12, generator=g),
    )
    return runtime, batch


def _reference_loss(runtime: DFlashRuntime, batch: DraftBatch, n_slots: int):
    """The §11.3 loss in float64, slot by slot, from the drafter's own logits."""
    cfg, drafter = runtime.config, runtime.drafter
    ids, mask, docs = batch.input_ids.flatten(), batch.loss_mask.flatten(), batch.document_ids.flatten()
    length, total = batch.input_ids.shape[1], batch.input_ids.numel()
    cands = [p for p in range(total) if (p + 1) % length and docs[p] >= 0 and docs[p + 1] == docs[p] and mask[p + 1]]
    noise = batch.anchor_noise.flatten()
    chosen = sorted(sorted(cands, key=lambda p: -noise[p])[: cfg.num_anchors])
    anchors = torch.tensor(chosen + [0] * (cfg.num_anchors - len(chosen)))
    hidden = drafter(batch.hidden_states, batch.input_ids, batch.position_ids, batch.document_ids, anchors)
    logits = drafter.logits(hidden).double()
    conf = drafter.confidence(hidden).double()
    targets = set((D2T + torch.arange(7)).tolist())
    teacher_all = batch.teacher_logits.flatten(0, 1).double()[:, sorted(targets)]
    terms = {"ce": 0.0, "tv": 0.0, "conf": 0.0, "w": 0.0, "n": 0.0, "tau": 0.0, "blocks": 0.0}
    accept_num, accept_den = [0.0] * runtime.gamma, [0.0] * runtime.gamma
    agree = [0.0] * runtime.gamma
    for n, p in enumerate(chosen):
        prefix, alive = 1.0, True
        for j in range(1, cfg.block_size):
            label = p + j
            alive = (
                alive
                and label // length == p // length
                and docs[label] == docs[p]
                and bool(mask[label])
                and int(ids[label]) in targets
            )
            if not alive:
                break
            q = torch.softmax(teacher_all[label - 1], -1)
            logp = torch.log_softmax(logits[n, j], -1)
            ce = -(q * logp).sum()
            tv = (logp.exp() - q).abs().sum()
            a = (1 - 0.5 * tv.detach()).clamp(0, 1)
            c = conf[n, j]
            bce = -(a * F.logsigmoid(c) + (1 - a) * F.logsigmoid(-c))
            w = math.exp(-(j - 1) / cfg.loss_decay_gamma)
            terms["ce"] = terms["ce"] + ce * w
            terms["tv"] = terms["tv"] + tv * w
            terms["conf"] = terms["conf"] + bce
            terms["w"] += w
            terms["n"] += 1
            prefix *= float(a)
            terms["tau"] += prefix
            accept_num[j - 1] += float(a)
            accept_den[j - 1] += 1
            agree[j - 1] += float(logits[n, j].argmax() == q.argmax())
        if mask[p + 1] and int(ids[p + 1]) in targets:
            terms["tau"] += 1
            terms["blocks"] += 1
    ce = terms["ce"] / (terms["w"] + 1e-6)
    tv = terms["tv"] / (terms["w"] + 1e-6)
    conf = terms["conf"] / (terms["n"] + 1e-6)
    loss = (cfg.ce_loss_alpha * ce + cfg.l1_loss_alpha * tv + cfg.confidence_head_alpha * conf) / n_slots
    metrics = {
        "draft_loss": loss,
        "draft_ce_loss": ce / n_slots,
        "draft_tv_loss": tv / n_slots,
        "draft_conf_loss": conf / n_slots,
        "draft_tau_num": terms["tau"],
        "draft_tau_den": terms["blocks"],
    }
    for k in range(runtime.gamma):
        metrics[f"draft_accept_rate_num@{k + 1}"] = accept_num[k]
        metrics[f"draft_accept_rate_den@{k + 1}"] = accept_den[k]
        metrics[f"draft_acc_num@{k + 1}"] = agree[k]
        metrics[f"draft_acc_den@{k + 1}"] = accept_den[k]
    return loss, metrics, len(chosen)


def test_loss_metrics_and_gradients_match_a_float64_computation():
    runtime, batch = _tiny_case()
    params = [p for p in runtime.parameters() if p.requires_grad]
    loss, metrics = runtime.draft_loss(batch, n_slots=2)
    grads = torch.autograd.grad(loss, params)
    ref_loss, ref_metrics, chosen = _reference_loss(runtime, batch, n_slots=2)
    ref_grads = torch.autograd.grad(ref_loss, params)
    assert chosen == 6 and ref_metrics["draft_tau_den"] >= 5  # every anchor used; blocks of several lengths
    assert sorted(ref_metrics[f"draft_accept_rate_den@{k}"] for k in (1, 2, 3)) != [6.0] * 3
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(
            metrics[key].double(),
            torch.as_tensor(value, dtype=torch.float64),
            **close(torch.float32, "reordered"),
            msg=key,
        )
    assert metrics["draft_loss"] > 0 and metrics["draft_conf_loss"] > 0
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), **close(torch.float32, "accumulated"))
    assert runtime.drafter.embed.weight.requires_grad  # no policy embedding given: a learned one


def test_total_variation_gradient_and_chunks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 13, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(7, 13, generator=g, dtype=torch.float64)
    want = (torch.softmax(x, -1) - torch.softmax(t, -1)).abs().sum(-1)
    for chunk in (None, 1, 3):
        got = total_variation(x, t, chunk)
        torch.testing.assert_close(got.double(), want, **close(torch.float32, "reordered"))
        u = torch.randn(7, generator=g, dtype=torch.float64)
        (gx,) = torch.autograd.grad((got * u).sum(), x)
        (wx,) = torch.autograd.grad((want * u).sum(), x, retain_graph=True)
        torch.testing.assert_close(gx, wx, **close(torch.float32, "reordered"))


def test_drafter_reads_only_its_document_before_the_anchor():
    runtime, batch = _tiny_case()
    drafter = runtime.drafter
    anchors = torch.tensor([3, 8, 16])  # doc 0 at 3, doc 1 at 8 (its 3rd slot), doc 2 at 4
    args = (batch.input_ids, batch.position_ids, batch.document_ids, anchors)
    base = drafter(batch.hidden_states, *args)

    def changed(row, cols):
        h = batch.hidden_states.clone()
        h[row, cols] += 5.0
        return (drafter(h, *args) - base).abs().amax((1, 2)) > 1e-6

    assert changed(0, [0, 1, 2]).tolist() == [True, False, False]  # doc 0 before 3
    assert changed(0, [3, 4, 5]).tolist() == [False, False, False]  # doc 0 from the anchor on
    assert changed(0, [6, 7]).tolist() == [False, True, False]  # doc 1 before 8
    assert changed(0, [8, 9, 10, 11]).tolist() == [False, False, False]
    assert changed(1, [0, 1, 2, 3]).tolist() == [False, False, True]
    nan = batch.hidden_states.clone()
    nan[:, -1] = float("nan")  # padding slots: never read
    assert torch.equal(drafter(nan, *args), base)


def test_compute_loss_seed_protocol_uses_the_stashed_teacher():
    runtime, batch = _tiny_case()
    want, _ = runtime.draft_loss(batch, n_slots=3)
    runtime.begin_global_batch(3)
    runtime.stash_teacher_logits(batch.teacher_logits, need_clone=True)
    got, metrics = runtime.compute_loss({"draft_batch": dataclasses.replace(batch, teacher_logits=None)})
    torch.testing.assert_close(got, want)
    assert metrics["draft_loss"] == got.detach()


# ---------------------------------------------------------------------------------------
# Layouts and compilation
# ---------------------------------------------------------------------------------------


def test_packed_row_equals_unpacked_rows():
    policy = _policy()
    cfg = DFlashConfig(
        num_anchors=8,
        block_size=4,
        l1_loss_alpha=0.5,
        confidence_head_alpha=0.2,
        hidden_size=32,
        num_heads=4,
        num_layers=2,
    )
    torch.manual_seed(1)
    runtime = build_dflash_runtime(cfg, SMALL, policy_embedding_weight=policy.embed.weight)
    lengths = [7, 11, 5, 9]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (4, 12), generator=g)
    mask = (torch.arange(12)[None] >= torch.tensor([[2], [4], [1], [3]])).float()
    noise = torch.rand(4, 12, generator=g)  # per document position: same anchors in both layouts
    unpacked = _unpacked_batch(policy, runtime, ids, torch.tensor(lengths), mask, noise)
    nan = torch.where(unpacked.document_ids[..., None] >= 0, 0.0, float("nan"))
    unpacked = DraftBatch(
        unpacked.input_ids,
        unpacked.hidden_states + nan,
        unpacked.teacher_logits + nan,
        *(getattr(unpacked, f) for f in ("loss_mask", "document_ids", "position_ids", "anchor_noise")),
    )
    packed = _pack(unpacked, lengths, 40, fill=float("nan"))  # padding holds NaN in both layouts

    params = [p for p in runtime.parameters() if p.requires_grad]
    results = []
    for batch in (unpacked, packed):
        loss, metrics = runtime.draft_loss(batch, n_slots=2)
        results.append((loss, metrics, torch.autograd.grad(loss, params)))
    (loss_u, m_u, g_u), (loss_p, m_p, g_p) = results
    assert torch.isfinite(loss_u) and m_u["draft_tau_den"] == 8
    torch.testing.assert_close(loss_p, loss_u, **close(torch.float32, "reordered"))
    assert set(m_p) == set(m_u)
    for key in m_u:
        torch.testing.assert_close(m_p[key], m_u[key], **close(torch.float32, "reordered"), msg=key)
    for a, b in zip(g_p, g_u):
        torch.testing.assert_close(a, b, **close(torch.float32, "accumulated"))
    assert runtime.drafter.embed.weight.grad is None and not runtime.drafter.embed.weight.requires_grad
    assert torch.equal(runtime.drafter.embed.weight, policy.embed.weight)


@pytest.mark.slow
def test_one_compile_over_batches_with_varying_anchor_counts(one_thread):
    torch._dynamo.reset()
    policy = _policy(seed=3)
    cfg = DFlashConfig(num_anchors=12, block_size=4, l1_loss_alpha=0.5, confidence_head_alpha=0.1)
    torch.manual_seed(0)
    runtime = build_dflash_runtime(cfg, SMALL, policy_embedding_weight=policy.embed.weight)
    rec = CompileRecorder("aot_eager")
    step = rec.compile(runtime.draft_loss, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    rows, width = 4, 16
    ids = torch.randint(3, 128, (rows, width), generator=g)
    lengths = torch.tensor([16, 12, 9, 14])
    base = _unpacked_batch(policy, runtime, ids, lengths, torch.ones(rows, width), torch.rand(rows, width))
    blocks, first = [], None
    for i in range(50):
        density = [0.0, 0.05, 0.1, 0.3, 0.6, 1.0][i % 6]
        mask = (torch.rand(rows, width, generator=g) < density).float() * (base.document_ids >= 0)
        batch = DraftBatch(
            base.input_ids,
            base.hidden_states,
            base.teacher_logits,
            mask,
            base.document_ids,
            base.position_ids,
            torch.rand(rows, width, generator=g),
        )
        loss, metrics = step(batch, 2)
        loss.backward()
        blocks.append(int(metrics["draft_tau_den"]))
        if i == 4:
            first = (batch, loss.detach(), {k: v.detach() for k, v in metrics.items()})
    assert rec.report.problems() == []
    assert rec.report.compiles == 1
    assert min(blocks) == 0 and max(blocks) == 12 and len(set(blocks)) >= 5  # fewer candidates than anchors too
    batch, loss, metrics = first
    eager_loss, eager_metrics = runtime.draft_loss(batch, 2)
    torch.testing.assert_close(loss, eager_loss.detach(), **close(torch.float32, "compiled"))
    for key, value in eager_metrics.items():
        torch.testing.assert_close(metrics[key], value.detach(), **close(torch.float32, "compiled"), msg=key)


# ---------------------------------------------------------------------------------------
# Training against a frozen policy
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_tau(one_thread):
    model = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, max_positions=256)
    data = DataConfig(prompts=4, group_size=2, response_median=12.0, response_max=24, modulus=64)
    policy = _policy(model, head_scale=8.0)
    cfg = DFlashConfig(num_anchors=16, block_size=5, confidence_head_alpha=0.1)
    torch.manual_seed(0)
    runtime = build_dflash_runtime(cfg, model, policy_embedding_weight=policy.embed.weight)
    opt = torch.optim.Adam([p for p in runtime.parameters() if p.requires_grad], lr=3e-3)
    rng = random.Random(0)
    losses, taus, accepts = [], [], []
    for step in range(150):
        loss, m = runtime.draft_loss(_task_batch(policy, runtime, data, rng, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(m["draft_ce_loss"]))
        taus.append(float(m["draft_tau_num"] / m["draft_tau_den"]))
        accepts.append(float(m["draft_accept_rate_num@1"] / m["draft_accept_rate_den@1"]))
    first, last = slice(0, 3), slice(-20, None)  # the untrained drafter (it learns fast), the end

    def mean(xs, s):
        return sum(xs[s]) / len(xs[s])

    print(
        f"loss {mean(losses, first):.3f} -> {mean(losses, last):.3f}, tau {mean(taus, first):.3f} -> "
        f"{mean(taus, last):.3f}, accept@1 {mean(accepts, first):.3f} -> {mean(accepts, last):.3f}"
    )
    assert mean(losses, last) < 0.7 * mean(losses, first)
    assert mean(taus, last) > mean(taus, first) + 0.6
    assert mean(accepts, last) > mean(accepts, first) + 0.25


# ---------------------------------------------------------------------------------------
# Configuration errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 1}, "block_size must be >= 2, got 1"),
        ({"num_anchors": 0}, "num_anchors must be >= 1, got 0"),
        ({"loss_weight": -1.0}, "loss_weight must be >= 0, got -1.0"),
        ({"loss_decay_gamma": float("nan")}, "loss_decay_gamma must be finite, got nan"),
        ({"l1_loss_alpha": -0.5}, "l1_loss_alpha must be >= 0, got -0.5"),
        ({"confidence_head_alpha": "1"}, "confidence_head_alpha must be a float, got str '1'"),
        ({"hidden_size": 0}, "hidden_size must be None or >= 1, got 0"),
        ({"num_heads": 2.0}, "num_heads must be an int, got float 2.0"),
        ({"token_chunk_size": 0}, "token_chunk_size must be None or >= 1, got 0"),
        (
            {"aux_layers": (1, 1)},
            "aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got (1, 1)",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as info:
        DFlashConfig(**kwargs)
    assert str(info.value) == message


def test_config_checks_against_the_policy():
    with pytest.raises(ConfigError) as info:
        build_dflash_runtime(DFlashConfig(hidden_size=30), SMALL)
    assert str(info.value) == "hidden_size (30) must be divisible by num_heads (4) into an even head size"
    with pytest.raises(ConfigError) as info:
        build_dflash_runtime(DFlashConfig(aux_layers=(0, 2)), SMALL)
    assert str(info.value) == "aux_layers (0, 2) must name decoder layers of the policy, [0, 2)"
    with pytest.raises(ConfigError) as info:
        build_dflash_runtime(DFlashConfig(draft_vocab_size=5), TINY, d2t=D2T)
    assert str(info.value) == "draft_vocab_size (5) must equal the size of the d2t map (7)"
    assert DFlashConfig(aux_layers=[0, 1]).aux_layers == (0, 1)  # a Hydra list
    runtime = build_dflash_runtime(DFlashConfig(draft_vocab_size=7, hidden_size=8, num_heads=2), TINY, d2t=D2T)
    assert runtime.drafter.draft_vocab_size == 7 and runtime.drafter.aux_layers == (0, 1)
    assert FIRST_SUPERVISED_SLOT == 1 and runtime.gamma == 4


def test_batch_shapes_are_checked():
    runtime, batch = _tiny_case()
    with pytest.raises(ValueError) as info:
        runtime.draft_loss(dataclasses.replace(batch, hidden_states=batch.hidden_states[..., :8]))
    assert str(info.value) == "DraftBatch.hidden_states must have shape (2, 12, 16), got (2, 12, 8)"
    with pytest.raises(ValueError) as info:
        runtime.draft_loss(batch, n_slots=0)
    assert str(info.value) == "n_slots must be an int >= 1, got 0"
