"""The metric registry (`compiled_loss.metrics`): every key that every loss family, draft
loss and drafter runtime emits has an explicit aggregation, and an unregistered key is an
error; a mean is taken over every fragment — micro-batches and data-parallel replicas
alike — so the cross-tokenizer loss's per-micro-batch values (`kl_loss_scale`,
`weight_t{i}`, `selected_teacher`) come out as one fragment's value at 4 micro-batches and
at dp = 2 (real gloo ranks), while its fragments still sum to the single-process values."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
import torch.distributed as dist
from cases import CASE_BY_NAME, CASES, globals_for, make_batch
from common import message
from ranks import mesh_groups, run_on_ranks
from tolerances import approx

from compiled_loss.app import compose_config
from compiled_loss.app.batches import annotate_cross_tokenizer, sample_batch
from compiled_loss.config import build_draft_runtime
from compiled_loss.demo import cross_tokenizer as demo
from compiled_loss.demo.model import TinyLM
from compiled_loss.loss_functions import (
    CrossTokenizerDistillationLossConfig,
    CrossTokenizerDistillationLossFn,
    NLLLossFn,
    PreferenceLossFn,
)
from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.losses import MPOLossFn
from compiled_loss.metrics import aggregation, combine_metrics
from compiled_loss.train import build_train_step
from compiled_loss.train.parallel import ParallelGroups, combine_over, shard_model
from compiled_loss.wrapper import DraftLossWrapper, wrap_loss_fn_with_input_preparation

# the keys the step adds once per step, and the ratios `with_ratios` derives: not fragments
STEP_WIDE = {"grad_norm", "draft_grad_norm", "global_valid_seqs", "global_valid_toks", "lr"}


def _ratio(key: str, metrics) -> bool:
    base, at, index = key.partition("@")
    return f"{base}_num{at}{index}" in metrics


def _cross_tokenizer_metrics(projections=(True, False), **cfg) -> dict[str, torch.Tensor]:
    """Two teachers (0 on a 5-token vocabulary through a projection, or on the student's;
    1 on the student's 7), every student position aligned."""
    g = torch.Generator().manual_seed(0)
    rows, width, vocab, t_vocab = 4, 6, 7, 5
    projection = torch.cat([torch.eye(t_vocab - 1, vocab), torch.ones(1, vocab)])  # 4 exact maps, 1 spread
    token_mask = torch.ones(rows, width)
    token_mask[:, 0] = 0
    data = {
        "input_ids": torch.randint(0, vocab, (rows, width), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
    }
    teachers = {
        i: torch.randn(rows, 2 * width, t_vocab if p else vocab, generator=g) for i, p in enumerate(projections)
    }
    aligns = {i: (2 * torch.arange(width)).expand(rows, width) for i in teachers}
    fn = CrossTokenizerDistillationLossFn(
        CrossTokenizerDistillationLossConfig(teacher_weights=(0.25, 0.75), **cfg),
        projections=tuple(projection if p else None for p in projections),
    )
    _, metrics = fn(torch.randn(rows, width, vocab, generator=g), teachers, aligns, data, *globals_for(data))
    return metrics


def _loss_metrics() -> list[tuple[str, dict]]:
    """(label, metrics) of one call of every loss family, in the options that add keys."""
    out = []
    for case in CASES:
        data, logits = make_batch(case, [5, 3, 4, 2], 6, seed=0)
        _, metrics = wrap_loss_fn_with_input_preparation(
            logits, data, *globals_for(data), loss_fn=case.make_loss(), prepare_fn=case.prepare(packed=False)
        )
        out.append((case.name, metrics))
    data, logits = make_batch(CASE_BY_NAME["dpo_sft"], [5, 3, 4, 2], 6, seed=0)
    data["reward_shift"] = torch.zeros(4)
    _, metrics = wrap_loss_fn_with_input_preparation(
        logits, data, *globals_for(data), loss_fn=MPOLossFn({"sft_loss_weight": 0.5}), prepare_fn=prepare_loss_input
    )
    out.append(("mpo", metrics))
    out.append(("reward_model", PreferenceLossFn()(logits[..., :1].sum(1), data, *globals_for(data))[1]))
    for label, kwargs in [
        ("cross_tokenizer_gold", dict(gold_loss=True)),
        ("cross_tokenizer_scored", dict(sum_weights_metric="entropy", dynamic_loss_scaling=True)),
        ("cross_tokenizer_select", dict(kd_loss_mode="select_teacher")),
        ("cross_tokenizer_averaged", dict(kd_loss_mode="averaged_logits", projections=(False, False))),
    ]:
        out.append((label, _cross_tokenizer_metrics(**kwargs)))
    g = torch.Generator().manual_seed(1)
    data = {
        "input_ids": torch.randint(0, 9, (3, 6), generator=g),
        "token_mask": torch.ones(3, 6),
        "sample_mask": torch.ones(3),
        "student_logits": torch.randn(3, 6, 9, generator=g),
    }
    policy = functools.partial(wrap_loss_fn_with_input_preparation, loss_fn=NLLLossFn(), prepare_fn=prepare_loss_input)
    for defer in (False, True):
        wrapper = DraftLossWrapper(policy, prepare_loss_input, None, loss_weight=0.5, defer_normalization=defer)
        out.append(
            (
                f"draft_wrapper_defer={defer}",
                wrapper(torch.randn(3, 6, 9, generator=g), data, None, torch.tensor(15.0))[1],
            )
        )
    return out


def test_every_key_of_every_loss_family_is_registered():
    """Each key resolves; the ones that do not sum are exactly these (the rest are fragments
    of global means, or counts)."""
    emitted = {key for _, metrics in _loss_metrics() for key in metrics}
    assert {key: aggregation(key) for key in sorted(emitted) if aggregation(key) != "sum"} == {
        "kl_loss_scale": "mean",
        "opd_full_decomposition_error": "max",
        "opd_full_reverse_kl_max": "max",
        "opd_full_reverse_kl_min": "min",
        "probs_ratio_clamped_max": "max",
        "probs_ratio_clamped_min": "min",
        "probs_ratio_max": "max",
        "probs_ratio_min": "min",
        "selected_teacher": "mean",
        "values_max": "max",
        "values_min": "min",
        "weight_t0": "mean",
        "weight_t1": "mean",
    }
    assert {
        "kl_loss_t1",
        "kl_common_t0",
        "l1_uncommon_t1",
        "bco_reward_sum",
        "is_oob_ratio",
        "_draft_step_payload",
        "seq_logprob_error_valid_seqs",
        "positive_nll_loss",
        "total_loss",
    } <= emitted


DRAFT_STEP = [
    "model.vocab_size=96",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.max_positions=64",
    "data.prompts=2",
    "data.group_size=2",
    "data.modulus=16",
    "data.response_median=6",
    "data.response_max=12",
    "data.prompt_terms_max=5",
    "packing.tokens=32",
    "packing.width=24",
    "packing.rows=4",
    "loss=nll",
    "compile.enabled=false",
    "run.micro_batches=2",
]


@pytest.mark.parametrize("draft", ["eagle3", "dflash"])
def test_every_key_of_both_drafter_runtimes_is_registered(draft):
    """One training step with the drafter (the step combines through the registry, which
    refuses an unregistered key): every fragment key is registered and sums."""
    cfg = compose_config(*DRAFT_STEP, f"draft={draft}", *(["draft.num_anchors=12"] if draft == "dflash" else []))
    torch.manual_seed(0)
    policy = TinyLM(cfg.model)
    runtime = build_draft_runtime(cfg.draft, cfg.model, policy)
    params = [p for m in (policy, runtime) for p in m.parameters() if p.requires_grad]
    step = build_train_step(cfg, policy, torch.optim.SGD(params, lr=0.0), draft_runtime=runtime)
    metrics = step(sample_batch(cfg.data, cfg.model.vocab_size, random.Random(3), clean=True)).metrics
    fragments = [k for k in metrics if k not in STEP_WIDE and not _ratio(k, metrics)]
    numerators = {"eagle3": "draft_cond_acc_num@1", "dflash": "draft_accept_rate_num@1"}[draft]
    assert {"draft_loss", "loss", numerators} <= set(fragments)
    assert {k: aggregation(k) for k in fragments} == dict.fromkeys(fragments, "sum")


def test_an_unregistered_key_is_an_error():
    """Never summed by default: the first fragment that carries one fails, naming the key."""
    text = (
        "ValueError: metric 'my_metric' has no aggregation: register it in compiled_loss.metrics (AGGREGATION, or "
        "PATTERNS for an indexed key) as 'sum', 'mean', 'min' or 'max'"
    )
    assert message(combine_metrics, [{"loss": torch.tensor(1.0), "my_metric": torch.tensor(1.0)}]) == text
    assert message(aggregation, "weight_tx") == text.replace("my_metric", "weight_tx")
    assert message(combine_over, [{"my_metric": 1.0}], None) == text


def test_each_key_combines_by_its_aggregation():
    """Sums add, extrema skip their ±inf sentinels, a mean divides by the fragments that hold it."""
    parts = [
        {"loss": 1.0, "kl_loss_scale": 2.0, "weight_t3": 0.5, "probs_ratio_min": 0.5, "values_max": -math.inf},
        {"loss": 2.0, "kl_loss_scale": 4.0, "weight_t3": 0.5, "probs_ratio_min": math.inf, "values_max": 3.0},
        {"loss": 4.0, "probs_ratio_min": 0.25, "values_max": 1.0},
    ]
    combined = combine_metrics([{k: torch.tensor(v) for k, v in p.items()} for p in parts])
    assert {k: v.item() for k, v in combined.items()} == {
        "loss": 7.0,
        "kl_loss_scale": 3.0,
        "weight_t3": 0.5,
        "probs_ratio_min": 0.25,
        "values_max": 3.0,
    }
    assert combine_over(parts, None) == {k: v.item() for k, v in combined.items()}


CROSS_TOKENIZER = [
    "loss=cross_tokenizer",
    "loss.teacher_weights=[0.25,0.75]",
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
    "compile.enabled=false",
]
# one fragment's values: the static weights (`sum`), the one-hot choice of teacher 1 (`select_teacher`)
ONE_FRAGMENT = {
    "sum": {"kl_loss_scale": 1.0, "weight_t0": 0.25, "weight_t1": 0.75},
    "select_teacher": {"kl_loss_scale": 1.0, "weight_t0": 0.0, "weight_t1": 1.0, "selected_teacher": 1.0},
}


def _cross_tokenizer_step(
    mode: str, micro_batches: int, groups: ParallelGroups = ParallelGroups(), rows: slice = slice(None)
) -> dict[str, float]:
    """One step's metrics of the demo's cross-tokenizer loss (two digit teachers) on a fixed
    8-row batch (its `rows`) and init. Teacher 0's logits × 100 (confident, mostly wrong),
    teacher 1's zero (uniform): `select_teacher` picks teacher 1 in every micro-batch."""
    cfg = compose_config(*CROSS_TOKENIZER, f"loss.kd_loss_mode={mode}", f"run.micro_batches={micro_batches}")
    torch.manual_seed(0)
    model = TinyLM(cfg.model)
    loss_fn = demo.build_cross_tokenizer_loss(cfg)
    batch = sample_batch(cfg.data, cfg.model.vocab_size, random.Random(0))
    batch = annotate_cross_tokenizer(batch, loss_fn, demo.teacher_models(cfg), cfg)
    batch["teacher_0_logits"] = batch["teacher_0_logits"] * 100
    batch["teacher_1_logits"] = torch.zeros_like(batch["teacher_1_logits"])
    batch = {k: v[rows] for k, v in batch.items()}
    step = build_train_step(
        cfg, shard_model(model, groups), torch.optim.SGD(model.parameters(), lr=0.0), groups, loss_fn=loss_fn
    )
    return step(batch).metrics


@functools.cache
def _single_process(mode: str, micro_batches: int) -> dict[str, float]:
    return _cross_tokenizer_step(mode, micro_batches)


def _assert_parity(got: dict, want: dict, mode: str) -> None:
    """`got` has one fragment's per-micro-batch values and the single-process sums."""
    assert sorted(got) == sorted(want)
    for key, value in ONE_FRAGMENT[mode].items():
        assert got[key] == value, (mode, key)
    for key in set(want) - {"grad_norm"}:
        assert got[key] == approx(want[key], torch.float32, "parallel"), (mode, key)


@pytest.mark.parametrize("mode", ["sum", "select_teacher"])
def test_cross_tokenizer_metrics_at_four_micro_batches(mode):
    whole = _single_process(mode, 1)
    for key, value in ONE_FRAGMENT[mode].items():
        assert whole[key] == value, key
    _assert_parity(_single_process(mode, 4), whole, mode)


def _on_two_replicas(rank: int, world: int) -> dict:
    """Each replica's half of the rows in 2 micro-batches (the single process's 4), then
    `combine_over` with 1 and 2 fragments, then with a key rank 0 does not carry."""
    group, groups = dist.group.WORLD, mesh_groups(world, dp=world)
    out: dict = {mode: _cross_tokenizer_step(mode, 2, groups, slice(4 * rank, 4 * rank + 4)) for mode in ONE_FRAGMENT}
    parts = [
        [{"kl_loss_scale": 1.0, "loss": 1.0, "probs_ratio_min": 0.5}],
        [
            {"kl_loss_scale": 2.0, "loss": 2.0, "probs_ratio_min": math.inf},
            {"kl_loss_scale": 6.0, "loss": 4.0, "probs_ratio_min": 0.25},
        ],
    ]
    out["uneven"] = combine_over(parts[rank], group)
    try:
        combine_over([{"my_metric": 1.0}] if rank == 1 else [], group)
    except ValueError as e:
        out["unregistered"] = str(e)
    return out


@pytest.mark.slow
def test_cross_tokenizer_metrics_at_two_data_parallel_replicas():
    """The means weigh every fragment alike (3.0 over fragments 1, 2, 6 — not 2.5, the mean of
    the replicas' means); an unregistered key fails alike on both ranks."""
    results = run_on_ranks(_on_two_replicas, world_size=2, timeout=240)
    assert all(isinstance(r, dict) for r in results), results
    for mode in ONE_FRAGMENT:
        want = _single_process(mode, 4)
        for result in results:
            _assert_parity(result[mode], want, mode)
    for result in results:
        assert result["uneven"] == {"kl_loss_scale": 3.0, "loss": 7.0, "probs_ratio_min": 0.25}
        assert result["unregistered"].startswith("metric 'my_metric' has no aggregation")
