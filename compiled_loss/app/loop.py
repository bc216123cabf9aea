"""The embedded training loop: the demo model on the demo task through the compiled
training step, with its progress logged (`compiled_loss.app.loggers`), each step's metrics
to the loggers of `run.loggers` and `summary.json`.

A run trains `run.steps` optimizer steps in two phases. The warm start: the first
`run.sft_steps` steps train NLL on correct responses through the same compiled step built
for `loss=nll` (none for `loss=mse_value`: a value head has no LM head). Then the rest
train the run's loss on on-policy rollouts (`compiled_loss.app.rollouts`), with the
warm-start weights as the KL reference. Each step: the batch (sampled by the policy,
annotated), one optimizer step, a metrics record.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import random
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from compiled_loss.app.batches import annotate_cross_tokenizer
from compiled_loss.app.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from compiled_loss.app.curves import WARM_START
from compiled_loss.app.loggers import MetricsLogger, Progress, finite, open_loggers, step_line
from compiled_loss.app.rollouts import Rollouts, RolloutSources
from compiled_loss.compile import load_compile_cache, save_compile_cache
from compiled_loss.config import Config, LossKind, Teacher, build_draft_runtime, draft_kind, drafter_name, loss_kind
from compiled_loss.config.losses import NllLossOption
from compiled_loss.demo import cross_tokenizer
from compiled_loss.demo.hf import Policy, policy_model
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft import DraftRuntimeBase
from compiled_loss.interfaces import LossFunction
from compiled_loss.losses import update_reward_shift
from compiled_loss.train import build_train_step
from compiled_loss.train.parallel import ParallelGroups, init_parallel, shard_model
from compiled_loss.train.recorder import CompileRecorder
from compiled_loss.train.step import TrainStep

log = logging.getLogger(__name__)


def _draft_metrics(cfg: Config) -> tuple[str, ...]:
    """The draft metrics shown on the per-step line: its loss and how well it agrees with
    the policy (`DraftKind.metrics`: EAGLE-3: top-1 agreement at the first and last TTT step;
    DFlash: τ, the first slot's accept rate and top-1 agreement) and, with `run.speculative`,
    the sampler's acceptance length and speed-up over plain decoding."""
    kind = draft_kind(cfg.draft)
    if not kind.co_trained:
        return ()
    speculative = ("speculative_tau", "speculative_speedup") if cfg.run.speculative else ()
    return kind.metrics(cfg.draft) + speculative


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

    Under `torchrun` (`parallel.dp · dp_shard · cp · tp` processes) the policy and its
    reference are sharded with torch.distributed's engine (`compiled_loss.train.shard_model`:
    FSDP2 and a DTensor TP plan); each data-parallel rank trains on its share of every
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
    kind: LossKind
    policy: Policy
    reference: Policy
    drafter: DraftRuntimeBase | None
    loss_fn: LossFunction
    teachers: list[TinyLM] | None  # cross-tokenizer distillation's teachers
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer]  # the warm start's, the loss's
    warm: TrainStep
    step: TrainStep
    rollouts: Rollouts
    warm_steps: int
    layers_recorder: CompileRecorder | None  # the decoder layers, compiled apart in a parallel run

    def training_state(self) -> TrainingState:
        """What a checkpoint of this run carries (`save_checkpoint`, `load_checkpoint`)."""
        return TrainingState(
            self.cfg, self.policy, self.reference, self.drafter, self.optimizers, self.rollouts.rng, self.warm_steps
        )

    def hand_over_drafter(self) -> None:
        """At the end of the warm start, the drafter's AdamW moments pass from the warm start's
        optimizer to the loss's, so that it trains on through the switch: a fresh AdamW's
        first steps move every weight by about `optim.draft_lr` and throw it off the policy."""
        warm, loss = self.optimizers
        for p in trained_parameters(self.drafter):
            if p in warm.state:
                loss.state[p] = warm.state[p]

    def recorders(self) -> list[CompileRecorder]:
        """The compile recorders of both steps and the sampler (none where nothing compiles)."""
        found = [r for r in (self.step.recorder, self.warm.recorder, self.layers_recorder) if r is not None]
        samplers = (self.rollouts.sampler, self.rollouts.speculative)
        return found + [s.recorder for s in samplers if s is not None and s.recorder is not None]

    def compiles(self) -> int:
        """The graphs compiled so far, of every recorder (what each step's line counts)."""
        return sum(r.report.compiles for r in self.recorders())

    def compile_seconds(self) -> float:
        """The seconds spent compiling so far."""
        return sum(r.report.compile_seconds for r in self.recorders())

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

    policy: Policy
    reference: Policy
    teacher: TinyLM | None
    teachers: list[TinyLM] | None
    drafter: DraftRuntimeBase | None
    layers_recorder: CompileRecorder | None = None
    """The policy's decoder layers, compiled one by one inside their FSDP units (a parallel run)."""
    generator: Policy | None = None
    """What the samplers generate with: the policy itself, or in a parallel run its unsharded
    copy, which `Rollouts` loads with the policy's gathered weights before each sampling."""

    def trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizers step: the policy's and the drafter's that take gradients."""
        return trained_parameters(self.policy, self.drafter)

    def parameter_groups(self, lr: float, draft_lr: float) -> list[dict[str, Any]]:
        """An optimizer's parameter groups: the policy's at `lr`, then the drafter's (if any) at
        `draft_lr` (`optim.draft_lr`)."""
        groups = [{"params": trained_parameters(self.policy), "lr": lr}]
        return groups + (
            [{"params": trained_parameters(self.drafter), "lr": draft_lr}] if self.drafter is not None else []
        )


def trained_parameters(*models: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    """The parameters of `models` that take gradients."""
    return [p for m in models if m is not None for p in m.parameters() if p.requires_grad]


def build_models(cfg: Config, groups: ParallelGroups) -> Models:
    """The models of a run (`build_run`) or an audited step (`compiled-loss-audit`),
    initialised from torch's current seed: the policy (a value head for the value loss), the
    reference, the teachers the loss family reads and the drafter (its denominators summed
    over the data-parallel group). A parallel run shards the policy and the reference
    (`shard_model`: FSDP2, the TP plan; the policy's decoder layers compiled inside their
    FSDP units) and keeps an unsharded copy of the policy to generate with; the teachers and
    the drafter are replicated."""
    kind = loss_kind(cfg.loss)
    policy = policy_model(cfg.model, value_head=kind.value_head, draft=drafter_name(cfg.draft))
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    teacher = TinyLM(cfg.model).requires_grad_(False).eval() if kind.teacher is Teacher.same_tokenizer else None
    teachers = cross_tokenizer.teacher_models(cfg) if kind.teacher is Teacher.cross_tokenizer else None
    drafter = build_draft_runtime(cfg.draft, cfg.model, policy, groups.dp)
    recorder, generator = None, policy
    if groups.mesh is not None:
        generator = copy.deepcopy(policy).requires_grad_(False) if kind.samples else None
        c = cfg.compile
        recorder = CompileRecorder(c.backend, "decoder layers", c.mode) if c.enabled else None
        compile_kwargs = dict(fullgraph=c.fullgraph, dynamic=c.dynamic)
        shard_model(policy, groups, recorder=recorder, recompile_limit=c.max_buckets, compile_kwargs=compile_kwargs)
        shard_model(reference, groups)
    return Models(
        policy=policy,
        reference=reference,
        teacher=teacher,
        teachers=teachers,
        drafter=drafter,
        layers_recorder=recorder,
        generator=generator,
    )


def build_run(cfg: Config, groups: ParallelGroups) -> Run:
    """The run's models (seeded by `run.seed`), loss, optimizers, steps and rollouts."""
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    kind = loss_kind(cfg.loss)
    models = build_models(cfg, groups)
    policy, drafter = models.policy, models.drafter
    # cross-tokenizer distillation: its projections come from the demo task
    loss_fn = cross_tokenizer.build_cross_tokenizer_loss(cfg) if kind.teacher is Teacher.cross_tokenizer else None
    o = cfg.optim
    warm_optimizer, optimizer = (
        torch.optim.AdamW(
            models.parameter_groups(lr, o.draft_lr), betas=(o.beta1, o.beta2), weight_decay=o.weight_decay
        )
        for lr in (o.sft_lr, o.lr)
    )
    step = build_train_step(cfg, policy, optimizer, groups, drafter, loss_fn=loss_fn)
    warm = build_train_step(dataclasses.replace(cfg, loss=NllLossOption()), policy, warm_optimizer, groups, drafter)
    sources = RolloutSources(policy, models.reference, models.generator, models.teacher, drafter)
    rollouts = Rollouts(cfg, groups, rng, sources)
    return Run(
        cfg=cfg,
        groups=groups,
        kind=kind,
        policy=policy,
        reference=models.reference,
        drafter=drafter,
        loss_fn=step.loss_fn,
        teachers=models.teachers,
        optimizers=(warm_optimizer, optimizer),
        warm=warm,
        step=step,
        rollouts=rollouts,
        warm_steps=cfg.run.warm_start_steps(kind.family),
        layers_recorder=models.layers_recorder,
    )


def schedule(cfg: Config, warm_steps: int) -> str:
    """How the run's `run.steps` optimizer steps divide between the warm start and the loss."""
    total = cfg.run.steps

    def span(first: int, last: int) -> str:
        return f"step {first}" if first == last else f"steps {first}-{last}"

    loss = f"loss={cfg.loss.name} at {span(warm_steps + 1, total)}"
    warm = f"the warm start (NLL, run.sft_steps={warm_steps}) at {span(1, warm_steps)}, " if warm_steps else ""
    return f"run.steps={total}: {warm}{loss}"


def _compiling(cfg: Config, run: Run, warming: bool, first: bool) -> str:
    """What the first step of a phase in this process compiles."""
    step = "the warm start's training step (loss=nll)" if warming else f"the training step of loss={cfg.loss.name}"
    sampler = ["the sampler"] if first and run.rollouts.sampler is not None else []
    return f"compiling {' and '.join([*sampler, step])} (compile.backend={cfg.compile.backend}) …"


def _train(cfg: Config, output_dir: Path) -> dict[str, Any]:
    groups = init_parallel(cfg.parallel)
    lead = groups.rank == 0
    run = build_run(cfg, groups)
    done, history = _resume(cfg, run, lead)  # a checkpoint it refuses stops the run before it writes anything
    reported: set[str] = set()  # the keys whose non-finite values were reported
    output_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        loggers, progress = [], None
        if lead:
            loggers = open_loggers(cfg, output_dir, reported, stack)
            log.info("%s; output in %s", schedule(cfg, run.warm_steps), output_dir)
            for record in history:
                for logger in loggers:
                    logger.log(record["step"], record)
            progress = stack.enter_context(Progress(cfg.run.steps, done, cfg.run.log_every, bar=sys.stderr.isatty()))
        cache = _load_compile_cache(cfg.run.compile_cache, lead)
        _steps(cfg, run, output_dir, done, history, loggers, progress, cache)
    summary = _summary(cfg, history, run, groups.rank, output_dir, cache)
    name = "summary.json" if lead else f"summary.rank{groups.rank}.json"
    summary = finite(summary, name, reported if lead else None)
    (output_dir / name).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if lead:
        log.info("%s:\n%s", output_dir / name, json.dumps(summary, indent=2))
    return summary


def _load_compile_cache(path: str | None, lead: bool) -> dict[str, Any] | None:
    """`run.compile_cache` loaded on every rank, before anything compiles; what the summary
    reports of it (None without one): its path, whether it loaded, the steps it was written
    after (`_steps` adds them). A file written for another setup is reported and skipped."""
    if path is None:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_compile_cache(path)
    if lead:
        for warning in caught:
            log.warning("run.compile_cache: %s", warning.message)
        if loaded:
            size = Path(path).stat().st_size / 2**20
            log.info(
                "run.compile_cache=%s: loaded %.1f MiB of compiled graphs and kernels (read, not compiled)", path, size
            )
        elif not caught:
            log.info("run.compile_cache=%s: no such file; written once the first steps compiled", path)
    return {"path": path, "loaded": loaded, "saved_after_steps": []}


def _resume(cfg: Config, run: Run, lead: bool) -> tuple[int, list[dict[str, Any]]]:
    """The step `run.resume`'s checkpoint is at and the records of the steps up to it (0 and
    none without one), restored into `run`."""
    if cfg.run.resume is None:
        return 0, []
    done, history, changes = load_checkpoint(cfg.run.resume, run.training_state())
    if lead:
        log.info(
            f"resuming at step {done} of {cfg.run.steps} from run.resume={cfg.run.resume}; "
            + (f"changed since it was written: {', '.join(changes)}" if changes else "the same config")
        )
    # the drafter's anchor noise is seeded by each step object's count of global batches
    run.warm.global_batch, run.step.global_batch = min(done, run.warm_steps) - 1, max(done - run.warm_steps, 0) - 1
    return done, history


def _steps(
    cfg: Config,
    run: Run,
    output_dir: Path,
    done: int,
    history: list[dict[str, Any]],
    loggers: list[MetricsLogger],
    progress: Progress | None,
    cache: dict[str, Any] | None,
) -> None:
    """Train the run's steps after step `done`, appending their records to `history`. Every
    rank gathers the checkpoints' state; rank 0 (the one with a `progress`) writes them, logs the progress, hands each
    record to the `loggers` and, after a step that compiled, writes `run.compile_cache`
    (`cache`: `_load_compile_cache`'s) when it lacks something compiled."""
    kind, policy, reference, step, warm = run.kind, run.policy, run.reference, run.step, run.warm
    warm_steps, total, lead = run.warm_steps, cfg.run.steps, progress is not None
    # MPO: the driver's running mean reward δ of the BCO term (ref §4.4), carried in the metrics
    reward_shift = (
        None
        if not kind.reward_shift
        else next((r["reward_shift"] for r in reversed(history) if "reward_shift" in r), cfg.loss.reward_shift)
    )
    saved: list[Path] = []  # the checkpoints this run wrote, oldest first
    for i in range(done + 1, total + 1):
        warming = i <= warm_steps
        if i == warm_steps + 1 and warm_steps:  # the warm-start weights become the KL reference
            reference.load_state_dict(policy.state_dict())
            run.hand_over_drafter()
        if lead and cfg.compile.enabled and i in (done + 1, warm_steps + 1):  # a phase's first step compiles
            log.info("step %d: %s", i, _compiling(cfg, run, warming, first=i == done + 1))
        start, compiling = time.perf_counter(), run.compile_seconds()
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
            "compiles": run.compiles(),
        }
        history.append(record)
        if cfg.run.save_every and (i % cfg.run.save_every == 0 or i == total):  # every rank gathers, rank 0 writes
            path = save_checkpoint(output_dir / "checkpoints", run.training_state(), i, history, write=lead)
            saved += [path] if lead else []
            if cfg.run.keep_last and len(saved) > cfg.run.keep_last:  # the new one is in place
                saved.pop(0).unlink()
        if not lead:
            continue
        seconds, compiled = time.perf_counter() - start, run.compile_seconds() - compiling
        if compiled:
            log.info("step %d: %.1f s, %.1f s of it compiling", i, seconds, compiled)
            if cache is not None and save_compile_cache(cache["path"]):
                cache["saved_after_steps"].append(i)
                size = Path(cache["path"]).stat().st_size / 2**20
                log.info("step %d: wrote run.compile_cache=%s (%.1f MiB)", i, cache["path"], size)
        for logger in loggers:
            logger.log(i, record)
        shown = (() if warming else kind.key_metrics) + _draft_metrics(cfg)
        progress.step(record, step_line(record, total, shown), seconds, compiled=bool(compiled))


def _local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard)."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in local)


def state_bytes(parameters: list[torch.nn.Parameter], optimizers: Any) -> dict[str, int]:
    """This rank's bytes of the trained parameters, their gradients and the optimizers' state
    (sharded by FSDP2 and the TP plan in a parallel run)."""
    optimizer_state = (v for o in optimizers for state in o.state.values() for v in state.values())
    return {
        "parameters": _local_bytes(parameters),
        "gradients": _local_bytes(p.grad for p in parameters),
        "optimizer": _local_bytes(v for v in optimizer_state if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def _summary(
    cfg: Config, history: list[dict[str, Any]], run: Run, rank: int, output_dir: Path, cache: dict[str, Any] | None
) -> dict[str, Any]:
    main = [r for r in history if r["phase"] != WARM_START]
    steady = [r for r, before in zip(main[1:], main) if r["compiles"] == before["compiles"]]  # no compile in it
    tokens, seconds = sum(r["tokens"] for r in main), sum(r["step_seconds"] for r in main)
    warm_steps, step, rollouts, recorders = run.warm_steps, run.step, run.rollouts, run.recorders()
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
        "compiles": step.compiles,  # the loss step's graphs, one per bucket at most
        "buckets": len(step.buckets),
        "compiles_total": run.compiles(),  # every graph of the run, as each step's line counts them
        "compile_seconds": run.compile_seconds(),
        "compile_cache": cache,
        "sampler_compiles": rollouts.compiles,
        "compile_problems": [p for r in recorders for p in r.report.problems()],
        "parallel": {
            "tp": cfg.parallel.tp,
            "cp": cfg.parallel.cp,
            "dp": cfg.parallel.dp,
            "dp_shard": cfg.parallel.dp_shard,
            "rank": rank,
        },
        "state_bytes": state_bytes(trained_parameters(run.policy, run.drafter), run.optimizers),
        "output_dir": str(output_dir),
    }
