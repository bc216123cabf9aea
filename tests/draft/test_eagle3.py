"""The EAGLE-3 TTT runtime (ref §11.3 "EAGLE3 TTT", §13.13): the loss is the reference's
decayed sum of per-step masked KL means with the vLLM-aligned mask (token t + k + 2 at
slot t of step k); the drafter's TTT attention is the reference's shared K/V cache; one
packed row and the unpacked rows of the same sequences agree on loss, metrics and
gradients; it compiles once with no graph break or host sync; and it learns."""

from __future__ import annotations

import math
import random
import time
import types

import pytest
import torch
from common import message
from expecttest import TestCase
from tolerances import approx, close

from compiled_loss.app.batches import sample_batch
from compiled_loss.checks import ConfigError
from compiled_loss.config import DataConfig, ModelConfig
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft import DraftBatch, aux_hidden_states
from compiled_loss.draft.eagle3 import (
    Eagle3Config,
    Eagle3Runtime,
    build_eagle3_runtime,
)
from compiled_loss.train import CompileRecorder

D2T = torch.tensor([1, 1, 2])  # draft id i -> target id i + d2t[i]: [1, 2, 4]


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: intra-op threads only add overhead, and on a shared 2-core
    machine they made the training run ~10x slower (measured 5.9 s vs 64 s under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _runtime(vocab=5, d2t=None, steps=2, hidden=8, heads=2, policy_hidden=4, layers=2, seed=0, **cfg) -> Eagle3Runtime:
    torch.manual_seed(seed)
    policy = types.SimpleNamespace(vocab_size=vocab, hidden_size=policy_hidden, num_layers=layers, num_heads=2)
    config = Eagle3Config(ttt_steps=steps, hidden_size=hidden, num_heads=heads, aux_layers=(0, 1), **cfg)
    runtime = build_eagle3_runtime(config, policy, d2t=d2t)
    with torch.no_grad():  # logits of order 1, so argmax agreement and KL are not degenerate
        runtime.drafter.head.weight.mul_(4.0)
    return runtime


def _sequence(length, vocab, aux, gen, mask=None):
    return {
        "ids": torch.randint(0, vocab, (length,), generator=gen),
        "hidden": torch.randn(length, aux, generator=gen),
        "teacher": 2 * torch.randn(length, vocab, generator=gen),
        "mask": (torch.rand(length, generator=gen) < 0.8).float() if mask is None else torch.tensor(mask).float(),
    }


def _batch(rows):
    """A `DraftBatch` of `rows`: lists of (sequence or None, slots) segments; a None segment
    is padding full of garbage (out-of-vocab ids, NaN hidden and teacher, mask 1)."""
    parts = {k: [] for k in ("ids", "hidden", "teacher", "mask", "doc", "pos")}
    doc = 0
    vocab, aux = next((s["teacher"].shape[1], s["hidden"].shape[1]) for row in rows for s, _ in row if s is not None)
    for row in rows:
        cols = {k: [] for k in parts}
        for seq, slots in row:
            if seq is None:
                cols["ids"].append(torch.full((slots,), 10**6))
                cols["hidden"].append(torch.full((slots, aux), float("nan")))
                cols["teacher"].append(torch.full((slots, vocab), float("nan")))
                cols["mask"].append(torch.ones(slots))
                cols["doc"].append(torch.full((slots,), -1))
                cols["pos"].append(torch.full((slots,), 777))
                continue
            for key in ("ids", "hidden", "teacher", "mask"):
                cols[key].append(seq[key])
            cols["doc"].append(torch.full((slots,), doc))
            cols["pos"].append(torch.arange(slots))
            doc += 1
        for key in parts:
            parts[key].append(torch.cat(cols[key]))
    t = {k: torch.stack(v) for k, v in parts.items()}
    return DraftBatch(
        input_ids=t["ids"],
        hidden_states=t["hidden"],
        teacher_logits=t["teacher"],
        loss_mask=t["mask"],
        document_ids=t["doc"],
        position_ids=t["pos"],
        anchor_noise=torch.zeros(t["ids"].shape),
    )


def _unpacked(seqs, width):
    return _batch([[(s, len(s["ids"])), (None, width - len(s["ids"]))] for s in seqs])


def _packed(seqs, multiple, total):
    row, used = [], 0
    for s in seqs:
        n = len(s["ids"])
        row += [(s, n), (None, -n % multiple)]
        used += n + (-n % multiple)
    return _batch([[*row, (None, total - used)]])


def _grads(runtime):
    return {name: p.grad.clone() for name, p in runtime.drafter.named_parameters() if p.requires_grad}


def _loss_and_grads(runtime, batch, n_slots=1):
    runtime.drafter.zero_grad(set_to_none=True)
    loss, metrics = runtime.draft_loss(batch, n_slots)
    loss.backward()
    return loss.detach(), metrics, _grads(runtime)


# --------------------------------------------------------------------------------------
# the loss: hand-checked on a tiny case


def test_loss_is_the_decayed_masked_kl_mean_with_the_vllm_aligned_mask():
    """ttt_steps=2, a 5-token policy vocabulary mapped to a 3-token draft vocabulary, two
    unpacked rows (the second of length 4, then garbage padding), n_slots=2: the loss is
    Σ_k 0.8^k Σ_t mask_k[t]·KL(p_teacher[t+k+1] ‖ q_k[t]) / (Σ mask_k + 1e-5) / 2, the KL in
    float64 here; mask_k[t] = loss_mask[t + k + 2] inside the row's sequence."""
    runtime = _runtime(vocab=5, d2t=D2T, steps=2)
    gen = torch.Generator().manual_seed(3)
    a = _sequence(6, 5, 8, gen, mask=[0, 0, 1, 1, 1, 1])
    b = _sequence(4, 5, 8, gen, mask=[0, 1, 1, 1])
    batch = _unpacked([a, b], 6)
    masks = [  # written out by hand: mask_k[t] = loss_mask[t + k + 2] while t + k + 2 < length
        [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
        [[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]],
    ]
    loss, metrics = runtime.draft_loss(batch, n_slots=2)

    logits = [x.detach().double() for x in runtime.drafter.step_logits(batch, 2)]
    teacher = batch.teacher_logits.double()[..., [1, 2, 4]]  # d2t: draft ids -> target ids 1, 2, 4
    lengths = [6, 4]

    def hit(k, r, t):  # argmax agreement of slot t's step k, whose target t + k + 2 is in the sequence
        return int(t + k + 2 < lengths[r] and logits[k][r, t].argmax() == teacher[r, t + k + 1].argmax())

    expected = 0.0
    for k in range(2):
        num = den = full = cond = cond_den = 0.0
        for r in range(2):
            for t in range(6):
                if not masks[k][r][t]:
                    continue
                p = torch.softmax(teacher[r, t + k + 1], -1)
                log_q = torch.log_softmax(logits[k][r, t], -1)
                num += float((p * (p.log() - log_q)).sum())
                den += 1
                prev = math.prod(hit(j, r, t) for j in range(k))  # the running AND along the chain
                full, cond, cond_den = full + hit(k, r, t), cond + prev * hit(k, r, t), cond_den + prev
        expected += 0.8**k * num / (den + 1e-5) / 2
        assert metrics[f"draft_ttt_loss_num@{k}"].item() == approx(num, torch.float32, "reordered")
        assert metrics[f"draft_ttt_loss_den@{k}"].item() == den == [6, 4][k]
        assert metrics[f"draft_full_acc_num@{k}"].item() == full
        assert metrics[f"draft_full_acc_den@{k}"].item() == den
        assert metrics[f"draft_cond_acc_num@{k}"].item() == cond
        assert metrics[f"draft_cond_acc_den@{k}"].item() == cond_den
    assert loss.item() == approx(expected, torch.float32, "reordered")
    assert metrics["draft_loss"].item() == loss.item()
    assert 0.5 < expected < 5.0  # a real KL, not an empty mask
    assert sorted(metrics) == sorted(
        [
            f"draft_{name}@{k}"
            for k in range(2)
            for name in ("ttt_loss_num", "ttt_loss_den", "full_acc_num", "full_acc_den", "cond_acc_num", "cond_acc_den")
        ]
        + ["draft_loss"]
    )


def test_all_masked_gives_zero_loss_and_zero_gradients():
    runtime = _runtime(steps=3)
    gen = torch.Generator().manual_seed(0)
    batch = _unpacked([_sequence(7, 5, 8, gen, mask=[0] * 7)], 9)
    loss, metrics, grads = _loss_and_grads(runtime, batch)
    assert loss.item() == 0.0
    assert all(metrics[f"draft_ttt_loss_den@{k}"].item() == 0.0 for k in range(3))
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_denominators_are_summed_over_data_parallel_ranks(monkeypatch):
    """Only the per-step denominators go through the DP all-reduce (two identical ranks
    here): the loss halves, the numerators and local counts in the metrics do not."""
    import compiled_loss.draft.eagle3 as eagle3

    runtime = _runtime(steps=3)
    runtime.dp_group = object()
    gen = torch.Generator().manual_seed(4)
    batch = _unpacked([_sequence(8, 5, 8, gen), _sequence(6, 5, 8, gen)], 8)
    loss, metrics = runtime.draft_loss(batch)
    seen = []
    monkeypatch.setattr(eagle3, "all_reduce_sum", lambda x, group: seen.append(group) or 2 * x)
    loss_dp, metrics_dp = runtime.draft_loss(batch)
    assert seen == [runtime.dp_group]
    torch.testing.assert_close(loss_dp, loss / 2)
    assert all(torch.equal(metrics_dp[k], metrics[k]) for k in metrics if k != "draft_loss")


def test_seed_protocol_runs_draft_loss_with_the_stashed_teacher_and_n_slots():
    runtime = _runtime(steps=2)
    gen = torch.Generator().manual_seed(6)
    batch = _unpacked([_sequence(7, 5, 8, gen)], 8)
    runtime.begin_global_batch(4)
    runtime.stash_teacher_logits(batch.teacher_logits, need_clone=True)
    loss, metrics = runtime.compute_loss({"draft_batch": DraftBatch(**{**batch.__dict__, "teacher_logits": None})})
    torch.testing.assert_close(loss, runtime.draft_loss(batch, 1)[0] / 4)
    assert metrics["draft_loss"].item() == loss.item() and runtime.loss_weight == 1.0


# --------------------------------------------------------------------------------------
# the drafter: TTT attention against a per-slot loop


def _rotate(x, angle):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def _naive_step_logits(d, batch, steps, theta=10000.0):
    """The reference's TTT forward, slot by slot: step k of slot t reads token t + k + 1 and
    its previous step's hidden; it attends to the step-0 keys of slots s <= t of its
    document and to the keys slot t produced at steps 1..k; positions + k."""
    rows, length = batch.input_ids.shape
    heads, width = d.num_heads, d.hidden_size // d.num_heads
    freq = theta ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    out = [torch.zeros(rows, length, d.draft_vocab_size, dtype=torch.float64) for _ in range(steps)]
    for r in range(rows):
        doc, ids, pos = batch.document_ids[r].tolist(), batch.input_ids[r].tolist(), batch.position_ids[r].tolist()
        real = [t for t in range(length) if doc[t] >= 0]
        hidden = {t: d.fc(batch.hidden_states[r, t].double()) for t in real}
        keys, values = [], []
        for k in range(steps):
            q_s, k_s, v_s = {}, {}, {}
            for t in real:
                nxt = t + k + 1
                token = ids[nxt] if nxt < length and doc[nxt] == doc[t] else 0
                x = torch.cat([d.input_norm(d.embed.weight[token]), d.hidden_norm(hidden[t])])
                angle = (pos[t] + k) * freq
                q_s[t] = _rotate(d.q_proj(x).view(heads, width), angle)
                k_s[t] = _rotate(d.k_proj(x).view(heads, width), angle)
                v_s[t] = d.v_proj(x).view(heads, width)
            keys.append(k_s)
            values.append(v_s)
            new_hidden = {}
            for t in real:
                ks = [keys[0][s] for s in real if s <= t and doc[s] == doc[t]] + [keys[i][t] for i in range(1, k + 1)]
                vs = [values[0][s] for s in real if s <= t and doc[s] == doc[t]] + [
                    values[i][t] for i in range(1, k + 1)
                ]
                weights = torch.softmax(torch.stack([(q_s[t] * kk).sum(-1) for kk in ks]) / math.sqrt(width), 0)
                attn = (weights[..., None] * torch.stack(vs)).sum(0).reshape(-1)
                h = hidden[t] + d.o_proj(attn)
                m = d.post_norm(h)
                h = h + d.down_proj(torch.nn.functional.silu(d.gate_proj(m)) * d.up_proj(m))
                out[k][r, t] = d.logits(h)
                new_hidden[t] = h
            hidden = new_hidden
    return out


def test_drafter_forward_is_the_reference_ttt_attention():
    runtime = _runtime(vocab=7, steps=3, hidden=8, heads=2)
    drafter = runtime.drafter.double()
    gen = torch.Generator().manual_seed(1)
    seqs = [_sequence(n, 7, 8, gen) for n in (5, 4, 6)]
    batch = _batch([[(seqs[0], 5), (None, 2), (seqs[1], 4), (None, 1)], [(seqs[2], 6), (None, 6)]])
    batch = DraftBatch(**{**batch.__dict__, "hidden_states": batch.hidden_states.double()})
    with torch.no_grad():
        got = drafter.step_logits(batch, 3)
        want = _naive_step_logits(drafter, batch, 3)
    real = batch.document_ids >= 0
    for k in range(3):
        torch.testing.assert_close(got[k][real], want[k][real], **close(torch.float64, "reordered"))
        assert torch.isfinite(got[k]).all()


def test_draft_step_k_reads_no_token_past_t_plus_k_plus_1():
    """Teacher forcing is causal along the chain: changing token p leaves step k's logits
    at slots t < p - k - 1 unchanged and changes some slot t = p - k - 1."""
    runtime = _runtime(vocab=7, steps=3)
    gen = torch.Generator().manual_seed(2)
    base = _unpacked([_sequence(10, 7, 8, gen)], 10)
    ids = base.input_ids.clone()
    ids[0, 7] = (ids[0, 7] + 1) % 7
    changed = DraftBatch(**{**base.__dict__, "input_ids": ids})
    with torch.no_grad():
        before, after = runtime.drafter.step_logits(base, 3), runtime.drafter.step_logits(changed, 3)
    for k in range(3):
        first = 7 - k - 1
        assert torch.equal(before[k][0, :first], after[k][0, :first])
        assert not torch.allclose(before[k][0, first], after[k][0, first])


# --------------------------------------------------------------------------------------
# layouts: packed == unpacked, padding and document boundaries do not leak


def test_packed_row_equals_unpacked_rows():
    d2t = torch.tensor([0, 1, 3, 3, 4, 5])  # 6 draft ids of an 11-token vocabulary
    runtime = _runtime(vocab=11, d2t=d2t, steps=3, hidden=16, heads=4, seed=5)
    gen = torch.Generator().manual_seed(17)
    seqs = [_sequence(n, 11, 8, gen) for n in (9, 5, 7)]
    unpacked = _unpacked(seqs, 10)
    packed = _packed(seqs, multiple=4, total=32)
    loss_u, metrics_u, grads_u = _loss_and_grads(runtime, unpacked, n_slots=3)
    loss_p, metrics_p, grads_p = _loss_and_grads(runtime, packed, n_slots=3)
    assert torch.isfinite(loss_u) and loss_u > 0.1
    torch.testing.assert_close(loss_p, loss_u, **close(torch.float32, "reordered"))
    assert metrics_p.keys() == metrics_u.keys()
    for key in metrics_u:
        torch.testing.assert_close(metrics_p[key], metrics_u[key], **close(torch.float32, "reordered"), msg=key)
    assert [metrics_u[f"draft_ttt_loss_den@{k}"].item() > 0 for k in range(3)] == [True] * 3
    assert grads_u.keys() == grads_p.keys() and "fc.weight" in grads_u and "embed.weight" not in grads_u
    for name in grads_u:
        assert torch.isfinite(grads_u[name]).all() and grads_u[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_p[name], grads_u[name], **close(torch.float32, "accumulated"), msg=name)
    # each sequence alone gives its share: the loss is a sum of per-sequence numerators
    nums = [
        sum(_loss_and_grads(runtime, _unpacked([s], 10))[1][f"draft_ttt_loss_num@{k}"] for s in seqs) for k in range(3)
    ]
    torch.testing.assert_close(
        torch.stack(nums),
        torch.stack([metrics_u[f"draft_ttt_loss_num@{k}"] for k in range(3)]),
        **close(torch.float32, "reordered"),
    )


# --------------------------------------------------------------------------------------
# compile: one graph, one compile, no host sync over many batches of one shape


@pytest.mark.slow
def test_compiles_once_without_problems_over_batches_of_one_shape():
    runtime = _runtime(vocab=11, d2t=torch.tensor([0, 1, 3, 3, 4, 5]), steps=3, hidden=16, heads=4)
    recorder = CompileRecorder("aot_eager")
    step = recorder.compile(lambda batch: runtime.draft_loss(batch, 2), fullgraph=True)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for i in range(20):
        if i % 2:  # one packed-style row pair: several documents per row
            row0 = [rng.randint(2, 6), rng.randint(2, 6)]
            row1 = [rng.randint(2, 10)]
            rows = [[(_sequence(n, 11, 8, gen), n) for n in row0], [(_sequence(n, 11, 8, gen), n) for n in row1]]
        else:  # unpacked rows
            rows = [[(_sequence(n, 11, 8, gen), n)] for n in (rng.randint(2, 16), rng.randint(2, 16))]
        rows = [row + [(None, 16 - sum(n for _, n in row))] if sum(n for _, n in row) < 16 else row for row in rows]
        batch = _batch(rows)
        loss, metrics, grads = _loss_and_grads(runtime, batch, 2)  # eager
        runtime.drafter.zero_grad(set_to_none=True)
        compiled_loss, compiled_metrics = step(batch)
        compiled_loss.backward()
        torch.testing.assert_close(compiled_loss.detach(), loss, **close(torch.float32, "compiled"))
        for key in metrics:
            torch.testing.assert_close(compiled_metrics[key], metrics[key], **close(torch.float32, "compiled"))
        for name, grad in _grads(runtime).items():
            torch.testing.assert_close(grad, grads[name], **close(torch.float32, "accumulated"))
    report = recorder.report
    assert report.calls == 20
    assert report.problems() == []
    assert report.compiles == 1
    assert len(report.graphs) == 1


# --------------------------------------------------------------------------------------
# training: the drafter learns a frozen policy


@pytest.mark.slow
def test_training_against_a_frozen_policy_lowers_the_loss_and_raises_agreement():
    torch.manual_seed(0)
    model_cfg = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, max_positions=128)
    data_cfg = DataConfig(prompts=4, group_size=4, response_median=12.0, response_max=24, modulus=48)
    policy = TinyLM(model_cfg).eval().requires_grad_(False)
    runtime = build_eagle3_runtime(Eagle3Config(), model_cfg, policy.embed.weight)
    assert runtime.aux_layers == (0, 1)
    optim = torch.optim.Adam([p for p in runtime.parameters() if p.requires_grad], lr=3e-3)
    rng = random.Random(0)
    losses, accuracy = [], []
    start = time.perf_counter()
    for _ in range(150):
        data = sample_batch(data_cfg, model_cfg.vocab_size, rng)
        ids = data["input_ids"]
        rows, width = ids.shape
        positions = torch.arange(width).expand(rows, width)
        with torch.no_grad():
            logits, hidden = policy(ids, positions, torch.zeros_like(ids), return_hidden=True)
        batch = DraftBatch(
            input_ids=ids,
            hidden_states=aux_hidden_states(hidden, runtime.aux_layers),
            teacher_logits=logits,
            loss_mask=data["token_mask"] * data["sample_mask"][:, None],
            document_ids=torch.where(positions < data["input_lengths"][:, None], torch.arange(rows)[:, None], -1),
            position_ids=positions,
            anchor_noise=torch.zeros(rows, width),
        )
        loss, metrics = runtime.draft_loss(batch)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
        accuracy.append((metrics["draft_full_acc_num@0"] / metrics["draft_full_acc_den@0"]).item())
    seconds = time.perf_counter() - start
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    acc_first, acc_last = sum(accuracy[:10]) / 10, sum(accuracy[-10:]) / 10
    print(
        f"eagle3 training: loss {first:.3f} -> {last:.3f}, step-0 agreement {acc_first:.3f} -> {acc_last:.3f}, "
        f"{seconds:.1f} s"
    )
    assert last < 0.5 * first  # measured 0.327 -> 0.077, step-0 agreement 0.151 -> 0.461 (~5 s)
    assert acc_last > acc_first + 0.15


# --------------------------------------------------------------------------------------
# configuration


class TestConfigErrors(TestCase):
    def test_single_field_checks_name_the_field(self):
        cases = {
            "ttt_steps=0": dict(ttt_steps=0),
            "ttt_steps=2.0": dict(ttt_steps=2.0),
            "decay=0": dict(ttt_step_loss_decay=0.0),
            "decay=1.5": dict(ttt_step_loss_decay=1.5),
            "loss_weight=-1": dict(loss_weight=-1.0),
            "loss_weight=nan": dict(loss_weight=float("nan")),
            "token_chunk_size=0": dict(token_chunk_size=0),
            "aux_layers=()": dict(aux_layers=()),
            "heads": dict(hidden_size=10, num_heads=4),
        }
        got = "\n".join(f"{name}: {message(Eagle3Config, **kw)}" for name, kw in cases.items())
        self.assertExpectedInline(
            got,
            """\
ttt_steps=0: ConfigError: ttt_steps must be >= 1, got 0
ttt_steps=2.0: ConfigError: ttt_steps must be an int, got float 2.0
decay=0: ConfigError: ttt_step_loss_decay must be in (0, 1], got 0.0
decay=1.5: ConfigError: ttt_step_loss_decay must be in (0, 1], got 1.5
loss_weight=-1: ConfigError: loss_weight must be >= 0, got -1.0
loss_weight=nan: ConfigError: loss_weight must be finite, got nan
token_chunk_size=0: ConfigError: token_chunk_size must be >= 1, got 0
aux_layers=(): ConfigError: aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got ()
heads: ConfigError: hidden_size (10) must be divisible by num_heads (4) into an even head size""",
        )
        assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, AssertionError)
        assert Eagle3Config(aux_layers=[2, 0]).aux_layers == (2, 0)  # a Hydra list

    def test_builder_checks_against_the_policy(self):
        policy = ModelConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2)
        got = "\n".join(
            [
                message(build_eagle3_runtime, Eagle3Config(aux_layers=(0, 2)), policy),
                message(build_eagle3_runtime, Eagle3Config(draft_vocab_size=8), policy),
                message(build_eagle3_runtime, Eagle3Config(draft_vocab_size=4), policy, d2t=D2T),
                message(build_eagle3_runtime, Eagle3Config(hidden_size=12, num_heads=2), policy, torch.zeros(16, 8)),
            ]
        )
        self.assertExpectedInline(
            got,
            """\
ConfigError: aux_layers (0, 2) must name decoder layers of the policy, [0, 2)
ConfigError: draft_vocab_size (8) differs from the policy's vocabulary (16): pass a d2t map
ConfigError: draft_vocab_size (4) must equal the size of the d2t map (3)
ValueError: policy_embedding_weight must be [16, 12] (vocab_size, the drafter's hidden_size), got (16, 8)""",
        )
