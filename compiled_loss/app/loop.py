"""The embedded training loop: the demo model on the demo task through the compiled
training step, with a progress line per step and `metrics.jsonl` / `summary.json`.

A run has two phases. The warm start: `run.sft_steps` steps of NLL on correct responses
through the same compiled step built for `loss=nll` (none for `loss=mse_value`: a value
head has no LM head). Then `run.steps` steps of the run's loss on on-policy rollouts
(`compiled_loss.app.rollouts`), with the warm-start weights as the KL reference. Each
step: the batch (sampled by the policy, annotated), one optimizer step, a metrics record.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from compiled_loss.app.batches import annotate_cross_tokenizer
from compiled_loss.app.checkpoint import load_checkpoint, save_checkpoint
from compiled_loss.app.curves import WARM_START
from compiled_loss.app.rollouts import Rollouts
from compiled_loss.config import Config, build_draft_runtime, loss_family
from compiled_loss.config.losses import NllLossOption
from compiled_loss.demo import cross_tokenizer
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft import DraftRuntimeBase
from compiled_loss.interfaces import LossFunction
from compiled_loss.losses import update_reward_shift
from compiled_loss.train import build_train_step
from compiled_loss.train.parallel import ParallelGroups, init_parallel
from compiled_loss.train.step import TrainStep

# the metrics shown on the per-step line, per loss family (when present)
_KEY_METRICS = {
    "policy_gradient": ("probs_ratio", "kl_penalty", "sampling_importance_ratio"),
    "nll": (),
    "dpo": ("accuracy", "rewards_chosen_mean", "rewards_rejected_mean"),
    "distillation": (),
    "opd_full": ("opd_full_reverse_kl",),
    "cross_tokenizer": ("kl_loss", "ce_loss", "accuracy"),
    "value": ("values_mean", "vf_clipfrac"),
}


def _draft_metrics(cfg: Config) -> tuple[str, ...]:
    """The draft metrics shown on the per-step line: its loss and how well it agrees with
    the policy (EAGLE-3: top-1 agreement at the first and last TTT step; DFlash: τ, the
    first slot's accept rate and top-1 agreement)."""
    if cfg.draft.name == "eagle3":
        last = cfg.draft.ttt_steps - 1
        return ("draft_loss", "draft_full_acc@0") + ((f"draft_full_acc@{last}",) if last else ())
    if cfg.draft.name == "dflash":
        return "draft_loss", "draft_tau", "draft_accept_rate@1", "draft_acc@1"
    return ()


def _progress(step: int, total: int, width: int = 30) -> str:
    done = width * step // total
    return f"[{'#' * done}{'.' * (width - done)}] {step}/{total}"


def _finite(values: dict[str, Any], where: str, reported: set[str] | None) -> dict[str, Any]:
    """`values` with each non-finite float as None: `metrics.jsonl` and `summary.json` hold
    JSON, which has no NaN or infinity. The first time a key is non-finite, a warning line
    names it and `where` (`reported`: the keys named so far; None: name none)."""
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            if reported is not None and key not in reported:
                reported.add(key)
                print(
                    f"warning: {where}: {key} is {value}, written as null (later non-finite {key} values are "
                    "not reported)",
                    flush=True,
                )
    return out


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Within it, with `enabled` (`run.deterministic`): deterministic kernels
    (`torch.use_deterministic_algorithms`) and Inductor's deterministic mode; the previous
    settings come back on exit."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch._inductor.config.patch(deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(before)


def train(cfg: Config, output_dir: Path) -> dict[str, Any]:
    """Run the warm start and `cfg.run.steps` steps of the loss (after `run.resume`'s step,
    from that checkpoint); write metrics.jsonl and summary.json (rank 0; other ranks write
    their compile report as `summary.rank<r>.json`; non-finite values as null, each key
    reported once) and checkpoints every `run.save_every` steps (the newest `run.keep_last`
    kept); return the summary.

    Under `torchrun` (`parallel.tp · cp · dp` processes) every rank holds the whole model —
    the LM head returns this rank's vocabulary shard — and the step replicates it with
    DistributedDataParallel; each data-parallel replica trains on its share of every
    global batch."""
    with deterministic(cfg.run.deterministic):
        return _train(cfg, output_dir)


@dataclasses.dataclass
class Run:
    """Everything a run trains with, built once from its config (`build_run`): the models,
    the loss object, both optimizers, both compiled steps (the warm start's NLL and the
    loss's) and the rollouts that make their batches."""

    cfg: Config
    groups: ParallelGroups
    family: str
    policy: TinyLM
    reference: TinyLM
    drafter: DraftRuntimeBase | None
    loss_fn: LossFunction
    teachers: list[TinyLM] | None  # cross-tokenizer distillation's teachers
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer]  # the warm start's, the loss's
    warm: TrainStep
    step: TrainStep
    rollouts: Rollouts
    warm_steps: int

    def batch(self, i: int, reward_shift: float | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """This replica's batch of global step `i` (1-based, warm start included) and its
        statistics; `reward_shift`: MPO's running reward shift δ, carried in the batch."""
        if i <= self.warm_steps:
            return self.rollouts.warm_start(i)
        batch, stats = self.rollouts(i)
        if self.teachers is not None:
            batch = annotate_cross_tokenizer(batch, self.loss_fn, self.teachers, self.cfg)
        if reward_shift is not None:
            batch["reward_shift"] = torch.full((batch["input_ids"].shape[0],), reward_shift)
        return batch, stats


@dataclasses.dataclass
class Models:
    """A run's models (`build_models`): the policy, its frozen copy (the KL reference), the
    frozen teacher of `distillation` / `opd_full`, cross-tokenizer distillation's digit
    teachers and the co-trained drafter (None where the run has none)."""

    policy: TinyLM
    reference: TinyLM
    teacher: TinyLM | None
    teachers: list[TinyLM] | None
    drafter: DraftRuntimeBase | None

    def trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizers step: the policy's and the drafter's that take gradients."""
        return [p for m in (self.policy, self.drafter) if m is not None for p in m.parameters() if p.requires_grad]


def build_models(cfg: Config, groups: ParallelGroups) -> Models:
    """The models of a run (`build_run`) or an audited step (`compiled-loss-audit`),
    initialised from torch's current seed: the policy (a value head for the value loss; the
    LM head returns this tensor-parallel rank's vocabulary shard), the reference, the
    teachers the loss family reads and the drafter (its denominators summed over the
    data-parallel group)."""
    family = loss_family(cfg.loss)
    policy = TinyLM(cfg.model, value_head=family == "value", vocab_shard=(groups.tp_rank, groups.sizes[0]))
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    teacher = TinyLM(cfg.model).requires_grad_(False).eval() if family in ("distillation", "opd_full") else None
    teachers = cross_tokenizer.teacher_models(cfg) if family == "cross_tokenizer" else None
    drafter = build_draft_runtime(cfg.draft, cfg.model, policy, groups.dp)
    return Models(policy=policy, reference=reference, teacher=teacher, teachers=teachers, drafter=drafter)


def build_run(cfg: Config, groups: ParallelGroups) -> Run:
    """The run's models (seeded by `run.seed`), loss, optimizers, steps and rollouts."""
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    family = loss_family(cfg.loss)
    models = build_models(cfg, groups)
    policy, drafter = models.policy, models.drafter
    # cross-tokenizer distillation: its projections come from the demo task
    loss_fn = cross_tokenizer.build_cross_tokenizer_loss(cfg) if family == "cross_tokenizer" else None
    o = cfg.optim
    warm_optimizer, optimizer = (
        torch.optim.AdamW(models.trained(), lr=lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        for lr in (o.sft_lr, o.lr)
    )
    step = build_train_step(cfg, policy, optimizer, groups, drafter, loss_fn=loss_fn)
    warm = build_train_step(dataclasses.replace(cfg, loss=NllLossOption()), policy, warm_optimizer, groups, drafter)
    rollouts = Rollouts(cfg, family, groups, rng, policy=policy, reference=models.reference, teacher=models.teacher)
    return Run(
        cfg=cfg,
        groups=groups,
        family=family,
        policy=policy,
        reference=models.reference,
        drafter=drafter,
        loss_fn=step.loss_fn,
        teachers=models.teachers,
        optimizers=(warm_optimizer, optimizer),
        warm=warm,
        step=step,
        rollouts=rollouts,
        warm_steps=0 if family == "value" else cfg.run.sft_steps,
    )


def _train(cfg: Config, output_dir: Path) -> dict[str, Any]:
    groups = init_parallel(cfg.parallel)
    run = build_run(cfg, groups)
    family, policy, reference, step, warm, rollouts = (
        run.family,
        run.policy,
        run.reference,
        run.step,
        run.warm,
        run.rollouts,
    )
    warm_steps = run.warm_steps
    total = warm_steps + cfg.run.steps
    history: list[dict[str, Any]] = []
    done = 0
    lead = groups.rank == 0
    if cfg.run.resume is not None:
        done, history, changes = load_checkpoint(cfg.run.resume, run)
        if lead:
            print(
                f"resuming at step {done} of {total} from run.resume={cfg.run.resume}; "
                + (f"changed since it was written: {', '.join(changes)}" if changes else "the same config")
            )
        # the drafter's anchor noise is seeded by each step object's count of global batches
        warm.global_batch, step.global_batch = min(done, warm_steps) - 1, max(done - warm_steps, 0) - 1
    # MPO: the driver's running mean reward δ of the BCO term (ref §4.4), carried in the metrics
    reward_shift = (
        None
        if cfg.loss.name != "mpo"
        else next((r["reward_shift"] for r in reversed(history) if "reward_shift" in r), cfg.loss.reward_shift)
    )
    reported: set[str] = set()  # the keys whose non-finite values were reported
    saved: list[Path] = []  # the checkpoints this run wrote, oldest first
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "metrics.jsonl", "w") if lead else contextlib.nullcontext() as log:
        for record in history if lead else ():
            log.write(
                json.dumps(_finite(record, f"metrics.jsonl step {record['step']}", reported), allow_nan=False) + "\n"
            )
        for i in range(done + 1, total + 1):
            warming = i <= warm_steps
            if i == warm_steps + 1 and warm_steps:  # the warm-start weights become the KL reference
                reference.load_state_dict(policy.state_dict())
            batch, stats = run.batch(i, None if warming else reward_shift)
            result = (warm if warming else step)(batch)
            if reward_shift is not None and not warming:
                reward_shift = update_reward_shift(
                    reward_shift,
                    result.metrics["bco_reward_sum"],
                    result.metrics["bco_reward_count"],
                    cfg.loss.reward_shift_momentum,
                )
                stats = {**stats, "reward_shift": reward_shift}
            record = {
                "step": i,
                "phase": WARM_START if warming else cfg.loss.name,
                **result.metrics,
                **stats,
                "tokens": result.tokens,
                "tokens_per_s": result.tokens / result.seconds,
                "padding_fraction": 1 - result.tokens / result.slots,
                "step_seconds": result.seconds,
                "slots": result.slots,
                "compiles": step.compiles + warm.compiles + (rollouts.sampler.compiles if rollouts.sampler else 0),
            }
            history.append(record)
            if lead and cfg.run.save_every and (i % cfg.run.save_every == 0 or i == total):
                saved.append(save_checkpoint(output_dir / "checkpoints", run, i, history))
                if cfg.run.keep_last and len(saved) > cfg.run.keep_last:  # the new one is in place
                    saved.pop(0).unlink()
            if not lead:
                continue
            log.write(json.dumps(_finite(record, f"metrics.jsonl step {i}", reported), allow_nan=False) + "\n")
            log.flush()
            if i % cfg.run.log_every == 0 or i == total:
                shown_keys = (() if warming else _KEY_METRICS.get(family, ())) + _draft_metrics(cfg)
                keys = [k for k in shown_keys if k in record]
                shown = " ".join(f"{k} {record[k]:.4g}" for k in keys)
                print(
                    f"\r{_progress(i, total)} {record['phase']} loss {record['loss']:.4f} {shown} reward "
                    f"{record['reward']:.3f} | {record['tokens_per_s']:.0f} tok/s | compiles {record['compiles']}",
                    flush=True,
                )
    summary = _summary(cfg, history, warm_steps, step, warm, rollouts, groups.rank, output_dir)
    name = "summary.json" if lead else f"summary.rank{groups.rank}.json"
    summary = _finite(summary, name, reported if lead else None)
    (output_dir / name).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if lead:
        print(json.dumps(summary, indent=2))
    return summary


def _summary(
    cfg: Config, history, warm_steps: int, step, warm, rollouts: Rollouts, rank: int, output_dir: Path
) -> dict[str, Any]:
    main = [r for r in history if r["phase"] != WARM_START]
    steady = [r for r, before in zip(main[1:], main) if r["compiles"] == before["compiles"]]  # no compile in it
    tokens, seconds = sum(r["tokens"] for r in main), sum(r["step_seconds"] for r in main)
    recorders = [r for s in (step, warm) for r in (s.recorder, s.model_recorder) if r is not None]
    if rollouts.sampler is not None and rollouts.sampler.recorder is not None:
        recorders.append(rollouts.sampler.recorder)
    return {
        "loss": cfg.loss.name,
        "draft": cfg.draft.name,
        "packing": cfg.packing.mode.value,
        "compile": cfg.compile.enabled and cfg.compile.backend,
        "sft_steps": warm_steps,
        "steps": cfg.run.steps,
        "first_loss": main[0]["loss"],
        "final_loss": main[-1]["loss"],
        "first_reward": _mean(main[:5], "reward"),  # the loss's first and last 5 steps
        "final_reward": _mean(main[-5:], "reward"),
        "warm_start_reward": _mean(history[max(warm_steps - 5, 0) : warm_steps], "reward") if warm_steps else None,
        **{f"{end}_{key}": main[at][key] for key in _draft_metrics(cfg) for end, at in (("first", 0), ("final", -1))},
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "steady_tokens_per_s": (
            sum(r["tokens"] for r in steady) / sum(r["step_seconds"] for r in steady) if steady else None
        ),
        "padding_fraction": 1 - tokens / sum(r["slots"] for r in main),
        "compiles": step.compiles,
        "buckets": len(step.buckets),
        "compile_seconds": sum(r.report.compile_seconds for r in recorders),
        "sampler_compiles": rollouts.sampler.compiles if rollouts.sampler else 0,
        "compile_problems": [p for r in recorders for p in r.report.problems()],
        "parallel": {"tp": cfg.parallel.tp, "cp": cfg.parallel.cp, "dp": cfg.parallel.dp, "rank": rank},
        "output_dir": str(output_dir),
    }
