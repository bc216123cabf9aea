"""`compiled-loss-audit` (also `python tools/audit.py`): the graph-break / recompile gate.

Sweeps configurations — by default a covering set (every loss, packing mode, drafter, LM
head, metrics level and dtype at least once, on aot_eager); `--full` or a `loss=` /
`packing=` / `draft=` / `dtype=` choice sweeps the matrix of those — and for each drives
(1) the compiled packing wrapper over `batches` micro-batches drawn from a realistic RL
length distribution (once per loss, packing, dtype, head, metrics level and backend: it
does not read the drafter) and (2) the compiled training step — with its co-trained
drafter — over `steps` steps. For each it reports graphs, graph breaks, in-graph host
syncs, frames that fell back to eager, compiles and recompiles (with the failed guard),
each problem at its `path:line` and source line, plus buckets hit, compile seconds and
warm call time — as a terminal table, `audit.json` and `audit.md`. It exits non-zero when
any configuration has a break (under fullgraph, the error Dynamo raises), a sync or an
eager fallback, compiles more often than it hit distinct buckets, or recompiles on a
bucket it had already compiled.

    compiled-loss-audit                                   # the covering set
    compiled-loss-audit backend=inductor                  # the covering set on Inductor
    compiled-loss-audit --full                            # every loss × packing × draft × dtype
    compiled-loss-audit loss=clipped_pg,dpo packing=fused dtype=bf16 batches=50
    compiled-loss-audit head=linear loss=clipped_pg,distillation   # the fused LM head (LinearLogits)
    compiled-loss-audit metrics=minimal loss=clipped_pg,gspo       # policy-gradient losses' minimal metrics
    compiled-loss-audit --target mypkg.losses:my_loss --inputs mypkg.losses:samples
    torchrun --nproc-per-node 4 -m compiled_loss.audit.cli tp=2 cp=2 loss=clipped_pg packing=fused

With `tp=`, `cp=`, `dp=`, `dp_shard=` (under torchrun, their product ranks) every rank
drives the compiled training step with its process groups and the model sharded, and rank
0 reports every rank's rows.

`--target` audits any callable (its module is imported with the current directory first
on the path): the `--inputs` factory returns an iterable of `(args, kwargs)` samples; a
bucket is the samples' tensor shapes and dtypes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from compiled_loss.config import LOSS_KINDS, draft_names, loss_names
from compiled_loss.train.recorder import CompileRecorder, CompileReport

Tensor = torch.Tensor

_LOSS_CLASSES = loss_names()  # every runner loss with graphs of its own -> its option class
_DRAFT_KINDS = draft_names()
LOSSES = tuple(_LOSS_CLASSES)
_POLICY_GRADIENT = tuple(  # the losses with a metrics_level
    name for name, cls in _LOSS_CLASSES.items() if "metrics_level" in {f.name for f in dataclasses.fields(cls)}
)
# a value head, a teacher's full logits: no fused head
_LOGITS_ONLY = tuple(name for name, cls in _LOSS_CLASSES.items() if not LOSS_KINDS[cls].fused_head)
PACKINGS = ("none", "per_sequence", "fused")
DRAFTS = tuple(_DRAFT_KINDS)
DTYPES = ("fp32", "bf16")
HEADS = ("logits", "linear")
METRICS = ("full", "minimal")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One audited configuration: a loss, its packing mode, drafter, dtype and backend, the LM
    head (`linear`: the loss from hidden states, `LinearLogits`) and the policy-gradient
    losses' metrics level."""

    loss: str
    packing: str
    draft: str
    dtype: str
    backend: str
    head: str = "logits"
    metrics: str = "full"

    @property
    def label(self) -> str:
        head = "/linear" if self.head == "linear" else ""
        metrics = "/minimal" if self.metrics == "minimal" else ""
        return f"{self.loss}/{self.packing}/{self.draft}/{self.dtype}{head}{metrics}"

    def overrides(self) -> list[str]:
        """The run config overrides of the head and the metrics level."""
        head = ["logprob.fused_linear=true"] if self.head == "linear" else []
        return head + (["loss.metrics_level=minimal"] if self.metrics == "minimal" else [])


def _configuration(
    loss: str, packing: str, draft: str, dtype: str, backend: str, head: str, metrics: str
) -> Configuration | None:
    """The configuration, or None where the run refuses it: a value head takes no drafter, the
    fused head no drafter and no loss that reads logits (`_LOGITS_ONLY`). The metrics level
    is the policy-gradient losses' (others audit as `full`)."""
    drafter = _DRAFT_KINDS[draft].co_trained
    if (LOSS_KINDS[_LOSS_CLASSES[loss]].value_head and drafter) or (
        head == "linear" and (loss in _LOGITS_ONLY or drafter)
    ):
        return None
    return Configuration(loss, packing, draft, dtype, backend, head, metrics if loss in _POLICY_GRADIENT else "full")


# The default run: every loss, packing mode, drafter, head, metrics level and dtype at least
# once (a covering set, not their product), on aot_eager (what Dynamo traces, guards and
# captures does not depend on the backend; `backend=inductor` runs the set on Inductor).
DEFAULT = (
    Configuration("clipped_pg", "fused", "none", "bf16", "aot_eager"),
    Configuration("gspo", "per_sequence", "none", "fp32", "aot_eager", "linear", "minimal"),
    Configuration("cispo", "none", "none", "bf16", "aot_eager", "logits", "minimal"),
    Configuration("reinforce", "none", "eagle3", "fp32", "aot_eager"),
    Configuration("opd_full", "per_sequence", "none", "fp32", "aot_eager"),
    Configuration("nll", "fused", "none", "fp32", "aot_eager", "linear"),
    Configuration("dpo", "none", "dflash", "fp32", "aot_eager"),
    Configuration("mpo", "fused", "none", "bf16", "aot_eager"),
    Configuration("distillation", "per_sequence", "none", "fp32", "aot_eager", "linear"),
    Configuration("cross_tokenizer", "fused", "none", "fp32", "aot_eager"),
    Configuration("mse_value", "none", "none", "fp32", "aot_eager"),
)
DEFAULT_BATCHES, DEFAULT_STEPS = 4, 2
FULL_BATCHES, FULL_STEPS = 200, 20

# Small model / data sizes: what is audited is tracing, not speed.
_SIZES = [
    "model.vocab_size=256",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.max_positions=160",
    "data.prompts=4",
    "data.group_size=4",
    "data.modulus=32",
    "data.teacher_topk=8",
    "packing.tokens=128",
    "packing.rows=4",
    "packing.width=64",
    "run.micro_batches=2",
    "run.sft_steps=0",  # the audit drives the loss's own step
]


@dataclasses.dataclass
class Drive:
    """One audited callable of a configuration: its compile report plus what the audit tracked
    per call — the buckets, the recompiles on a bucket already compiled and what Dynamo
    raised (`error`: under fullgraph a graph break raises, and so does a call past Dynamo's
    recompile limit)."""

    name: str
    configuration: str
    report: CompileReport
    buckets: int = 0
    warm_ms: float | None = None
    recompiled_seen_buckets: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def recompile_limit_hit(self) -> bool:
        """Whether a frame hit Dynamo's recompile limit: under fullgraph it raised, without it
        the frame runs eager from then on (`Unsupported`, "Dynamo recompile limit exceeded")."""
        return any(
            f.fail_type == "FailOnRecompileLimitHit" or (f.fail_reason or "").startswith("Dynamo recompile limit")
            for f in self.report.frames
        )

    def failures(self) -> list[str]:
        out = self.report.problems() + ([self.error] if self.error else [])
        too_many = self.report.compiles > self.buckets
        if too_many:
            out.append(f"{self.report.compiles} compiles for {self.buckets} distinct buckets")
        out += [f"recompiled the already-compiled bucket {b}" for b in self.recompiled_seen_buckets]
        if too_many or self.recompiled_seen_buckets or self.recompile_limit_hit:
            out += [f"recompile {f.compile_id} of {f.frame}: {f.recompile_reason}" for f in self.report.recompiles]
        return out

    def row(self) -> dict[str, Any]:
        r = self.report
        return {
            "name": self.name,
            "configuration": self.configuration,
            "calls": r.calls,
            "graphs": len(r.graphs),
            "graph_breaks": [f"{g.break_location}: {g.break_reason}" for g in r.graph_breaks],
            "error": self.error,
            "syncs": [f"{g.compile_id}: {'; '.join(g.sync_ops)}" for g in r.graphs if g.sync_ops],
            "eager_fallbacks": [f"{f.frame} @ {f.fail_location}: {f.fail_reason}" for f in r.eager_fallbacks],
            "compiles": r.compiles,
            "recompiles": [f"{f.compile_id} of {f.frame}: {f.recompile_reason}" for f in r.recompiles],
            "buckets": self.buckets,
            "compile_s": round(r.compile_seconds, 2),
            "warm_ms": None if self.warm_ms is None else round(self.warm_ms, 3),
            "failures": self.failures(),
        }


def _dynamo_error(exc: Exception) -> str:
    """What Dynamo raised, at the user line it stopped on (else the innermost frame of the
    traceback): `Type at path:line `source`: first line of the message`."""
    frame = (getattr(exc, "real_stack", None) or traceback.extract_tb(exc.__traceback__))[-1]
    reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__} at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`: {reason}"


def _limit_error(report: CompileReport) -> str:
    """The recompile limit's failure under fullgraph: the frame that hit it, its graphs and
    the call that failed the guards of every one (the recompiles, with their guards, follow)."""
    failed = next((f for f in reversed(report.frames) if f.fail_type == "FailOnRecompileLimitHit"), None)
    frame_id = failed.compile_id.split("/")[0] if failed is not None else None
    graphs = [f for f in report.frames if not f.fail_type and f.compile_id.split("/")[0] == frame_id]
    frame = graphs[0].frame if graphs else "a frame"
    config = torch._dynamo.config
    limit = (
        f"recompile_limit={config.recompile_limit}"
        if len(graphs) >= config.recompile_limit
        else f"accumulated_recompile_limit={config.accumulated_recompile_limit}"
    )
    return (
        f"recompile limit hit: call {report.calls} failed the guards of all {len(graphs)} graphs of {frame} "
        f"(torch._dynamo.config.{limit}; fullgraph=True raises FailOnRecompileLimitHit there, without it the "
        "calls past the limit run eager)"
    )


def drive(
    name: str,
    fn: Callable[..., Any],
    samples: Iterable[tuple[Any, Any, Any]],
    backend: str,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    after: Callable[[Any], None] | None = None,
    configuration: str | None = None,
) -> Drive:
    """Compile `fn` with a recorder and call it on `(bucket, args, kwargs)` samples;
    `after(output)` runs on each result (e.g. the backward). The first error Dynamo raises
    (a graph break under fullgraph, the recompile limit) ends the drive and is its `error`."""
    torch._dynamo.reset()
    recorder = CompileRecorder(backend, name)
    compiled = recorder.compile(fn, fullgraph=fullgraph, dynamic=dynamic)
    result = Drive(name, configuration or name, recorder.report)
    seen: set[Any] = set()
    warm: list[float] = []
    for bucket, args, kwargs in samples:
        before = recorder.report.compiles
        start = time.perf_counter()
        try:
            output = compiled(*args, **kwargs)
            if after is not None:
                after(output)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # no TorchDynamoException
            result.error = _limit_error(recorder.report)
            seen.add(bucket)
            break
        except torch._dynamo.exc.TorchDynamoException as exc:
            result.error = _dynamo_error(exc)
            seen.add(bucket)
            break
        elapsed = time.perf_counter() - start
        if recorder.report.compiles > before and bucket in seen:
            result.recompiled_seen_buckets.append(str(bucket))
        if recorder.report.compiles == before:
            warm.append(elapsed)
        seen.add(bucket)
    result.buckets = len(seen)
    result.warm_ms = 1000 * statistics.median(warm) if warm else None
    return result


# ---- the project's own matrix ---------------------------------------------------------


def _config(c: Configuration, steps: int, sizes: tuple[int, ...] = (1, 1, 1, 1)):
    from compiled_loss.app import compose_config

    overrides = [
        f"loss={c.loss}",
        f"packing={c.packing}",
        f"draft={c.draft}",
        f"compile.backend={c.backend}",
        f"model.dtype={'bfloat16' if c.dtype == 'bf16' else 'float32'}",
        f"run.steps={steps}",
        *_SIZES,
        *(f"parallel.{k}={n}" for k, n in zip(_SIZES_KEYS, sizes)),
        *c.overrides(),
    ]
    return compose_config(*overrides)


def _loss_fn(cfg):
    """The run's loss object (cross-tokenizer distillation: with the demo teachers' projections)."""
    from compiled_loss.config import Teacher, loss_kind
    from compiled_loss.demo import cross_tokenizer

    if loss_kind(cfg.loss).teacher is Teacher.cross_tokenizer:
        return cross_tokenizer.build_cross_tokenizer_loss(cfg)
    return cfg.loss_fn


def _annotate(batch: dict[str, Tensor], cfg, loss_fn, teachers) -> dict[str, Tensor]:
    """`batch` (with `input_lengths`) plus what the run's driver adds for its loss: MPO's
    running reward shift, cross-tokenizer distillation's teacher logits and alignments."""
    from compiled_loss.app.batches import annotate_cross_tokenizer
    from compiled_loss.config import loss_kind

    if teachers is not None:
        batch = annotate_cross_tokenizer(batch, loss_fn, teachers, cfg)
    if loss_kind(cfg.loss).reward_shift:
        batch = {**batch, "reward_shift": torch.full((batch["input_ids"].shape[0],), cfg.loss.reward_shift)}
    return batch


def _wrapper_samples(cfg, dtype: torch.dtype, batches: int, seed: int):
    """`(bucket, args, kwargs)` for the packing wrapper (or the unpacked loss) on synthetic
    RL micro-batches with random logits (`logprob.fused_linear`: random hidden states and
    LM head, as `LinearLogits`)."""
    from compiled_loss.app.batches import sample_batch
    from compiled_loss.config import PackingMode, Teacher, loss_kind
    from compiled_loss.demo import cross_tokenizer
    from compiled_loss.inputs import Preparation, PrepareOptions
    from compiled_loss.interfaces import InputSpec
    from compiled_loss.packing import PackedLayout, pad_to_bucket, round_to_bucket
    from compiled_loss.train.step import packed_boundaries
    from compiled_loss.vocab import LinearLogits

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    loss_fn = _loss_fn(cfg)
    prepare = Preparation(loss_fn, InputSpec.of(loss_fn), PrepareOptions())
    kind = loss_kind(cfg.loss)
    teachers = cross_tokenizer.teacher_models(cfg) if kind.teacher is Teacher.cross_tokenizer else None
    mode, grid = cfg.packing.mode, cfg.packing.grid()
    vocab = 1 if kind.value_head else cfg.model.vocab_size

    def random_logits(*positions: int):
        if not cfg.logprob.fused_linear:
            return torch.randn(*positions, vocab, generator=gen).to(dtype).requires_grad_()
        hidden = torch.randn(*positions, cfg.model.hidden_size, generator=gen).to(dtype).requires_grad_()
        return LinearLogits(hidden, torch.randn(vocab, cfg.model.hidden_size, generator=gen).to(dtype).requires_grad_())

    for _ in range(batches):
        batch = sample_batch(cfg.data, cfg.model.vocab_size, rng, pairs=kind.pairs)
        batch = _annotate(batch, cfg, loss_fn, teachers)
        lengths = batch.pop("input_lengths").tolist()  # host
        data = {**batch, **_random_model_outputs(batch, cfg, gen)}
        rows = len(lengths)
        if mode == PackingMode.none:
            data = pad_to_bucket(data, rows, round_to_bucket(rows, grid.rows, grid.per_octave), grid)
            logits = random_logits(*data["input_ids"].shape)
            bucket = tuple(logits.shape)
            yield bucket, (logits, data, prepare, None), {}
        else:
            cu, cu_padded = packed_boundaries(lengths, cfg.packing.pad_to_multiple)
            layout = PackedLayout.build(cu, cu_padded, grid=grid)
            data = layout.pad_data(data)
            logits = random_logits(1, layout.tokens)
            bucket = (layout.tokens,) + tuple(data["input_ids"].shape)
            yield bucket, (logits, data, prepare, layout), {"per_sequence": mode == PackingMode.per_sequence}


def _random_model_outputs(batch: dict[str, Tensor], cfg, gen: torch.Generator) -> dict[str, Tensor]:
    """The model-produced keys of every loss, random but plausible."""
    rows, width = batch["input_ids"].shape
    lp = -torch.rand(rows, width, generator=gen) * 4
    k = cfg.data.teacher_topk
    return {
        "prev_logprobs": lp + 0.05 * torch.randn(rows, width, generator=gen),
        "generation_logprobs": lp,
        "reference_policy_logprobs": lp + 0.1 * torch.randn(rows, width, generator=gen),
        "teacher_topk_logits": torch.randn(rows, width, k, generator=gen),
        "teacher_topk_indices": torch.randint(0, cfg.model.vocab_size, (rows, width, k), generator=gen),
        "opd_full_teacher_payload": torch.randn(rows, width, cfg.model.vocab_size, generator=gen),
        "values": torch.randn(rows, width, generator=gen),
        "returns": batch["rewards"][:, None] * batch["token_mask"],
    }


def _wrapper_call(logits, data, prepare, layout, per_sequence: bool = False):
    """The audited micro-batch (the wrappers' and the step's entry point, `micro_batch_loss`;
    its backward runs after it, compiled by AOTAutograd)."""
    from compiled_loss.packing import micro_batch_loss

    g_seqs = data["sample_mask"].sum()
    g_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    return micro_batch_loss(
        logits,
        data,
        g_seqs,
        g_toks,
        prepare=prepare,
        layout=layout,
        per_sequence=per_sequence,
    )


def _audit_step(cfg, name: str, configuration: str, seed: int, groups=None) -> list[Drive]:
    """Drive the compiled training step (model forward + loss + backward + optimizer); with
    parallel `groups` also the model's decoder layers, which then compile apart (inside FSDP2's units). The
    first error Dynamo raises ends the drive and is the step's `error`."""
    from compiled_loss.app.batches import replica_rows, rollout, sample_batch
    from compiled_loss.app.loop import build_models
    from compiled_loss.config import loss_kind
    from compiled_loss.train import build_train_step
    from compiled_loss.train.parallel import ParallelGroups, gather_weights

    groups = groups or ParallelGroups()
    dp = groups.sizes[2]
    torch._dynamo.reset()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    kind = loss_kind(cfg.loss)
    models = build_models(cfg, groups)  # the run's models and drafter, as `python -m compiled_loss.run` builds them
    step = build_train_step(
        cfg,
        models.policy,
        torch.optim.AdamW(models.trained(), lr=1e-3),
        groups,
        models.drafter,
        loss_fn=_loss_fn(cfg),
    )
    layers = models.layers_recorder
    recorders = [(name, step.recorder)] + ([(f"{name} decoder layers", layers)] if layers is not None else [])
    results = [Drive(label, configuration, recorder.report) for label, recorder in recorders]
    warm: list[float] = []
    for i in range(cfg.run.steps):
        batch = sample_batch(cfg.data, cfg.model.vocab_size, rng, pairs=kind.pairs, clean=kind.clean)
        if models.generator is not None and models.generator is not models.policy:  # as `Rollouts` scores rows
            gather_weights(models.policy, models.generator)
        batch = rollout(
            replica_rows(batch, dp, groups.dp_rank),
            kind,
            policy=models.generator or models.policy,
            reference=models.reference,
            teacher=models.teacher,
            topk=cfg.data.teacher_topk,
        )
        batch = _annotate(batch, cfg, step.loss_fn, models.teachers)
        seen = set(step.buckets)
        before = [r.report.compiles for r in results]
        try:
            outcome = step(batch)
        except torch._dynamo.exc.TorchDynamoException as exc:
            results[0].error = _dynamo_error(exc)
            break
        new = step.buckets - seen
        for result, count in zip(results, before):
            if result.report.compiles > count + len(new):
                result.recompiled_seen_buckets.append(f"step {i}: {sorted(step.buckets & seen)}")
        if [r.report.compiles for r in results] == before:
            warm.append(outcome.seconds)
    for result in results:
        result.buckets = len(step.buckets)
        result.warm_ms = 1000 * statistics.median(warm) if warm else None
    return results


def configurations(opts: dict[str, list[str]], full: bool) -> tuple[list[Configuration], int, int]:
    """The configurations to audit, and the default batches and steps: the covering set
    `DEFAULT`, or — `--full` or any `loss=` / `packing=` / `draft=` / `dtype=` choice — the
    matrix of those (on `inductor`). `backend=`, `head=` and `metrics=` apply to every
    configuration; those the run refuses (see `_configuration`) are left out."""
    dims = ("loss", "packing", "draft", "dtype")
    if not full and not any(d in opts for d in dims):
        rows, batches, steps = list(DEFAULT), DEFAULT_BATCHES, DEFAULT_STEPS
    else:
        choices = [opts.get(d, list(every)) for d, every in zip(dims, (LOSSES, PACKINGS, DRAFTS, DTYPES))]
        rows = [Configuration(*row, "inductor") for row in itertools.product(*choices)]
        batches, steps = FULL_BATCHES, FULL_STEPS
    chosen = {key: opts[key][0] for key in ("backend", "head", "metrics") if key in opts}
    found = (_configuration(**{**dataclasses.asdict(c), **chosen}) for c in rows)
    configs = list(dict.fromkeys(c for c in found if c is not None))
    if not configs:
        raise SystemExit(
            "no configuration to audit: loss=mse_value takes no drafter, head=linear takes no drafter and "
            f"none of {', '.join(f'loss={name}' for name in _LOGITS_ONLY)}"
        )
    return configs, batches, steps


def audit_matrix(configs: list[Configuration], batches: int, steps: int) -> list[Drive]:
    """Drive every configuration's training step, and its packing wrapper once per wrapper
    configuration (the wrapper does not read the drafter)."""
    drives: list[Drive] = []
    wrapped: set[Configuration] = set()
    for i, c in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {c.label} ({c.backend})", flush=True)
        cfg = _config(c, steps)
        found = []
        wrapper = dataclasses.replace(c, draft="none")
        if wrapper not in wrapped:
            wrapped.add(wrapper)
            found.append(
                drive(
                    f"{c.label} wrapper",
                    _wrapper_call,
                    _wrapper_samples(cfg, _TORCH_DTYPES[c.dtype], batches, seed=len(drives)),
                    c.backend,
                    dynamic=cfg.compile.dynamic,
                    after=lambda out: out[0].backward(),
                    configuration=c.label,
                )
            )
        found += _audit_step(cfg, f"{c.label} step", c.label, seed=len(drives))
        for d in found:
            print(_line(d), flush=True)
        drives += found
    return drives


def audit_distributed(configs: list[Configuration], steps: int, sizes: tuple[int, ...]) -> list[Drive]:
    """Under torchrun: every rank drives the compiled training step with its (tp, cp, dp,
    dp_shard) groups, the model sharded; every rank returns every rank's drives (the step's
    loss graph, and the decoder layers, which compile apart inside FSDP2's units), labelled
    with their rank."""
    import torch.distributed as dist

    from compiled_loss.config import ParallelConfig
    from compiled_loss.train.parallel import init_parallel

    parallel = ParallelConfig(**dict(zip(_SIZES_KEYS, sizes)))
    groups = init_parallel(parallel)
    mine: list[Drive] = []
    for i, c in enumerate(configs, 1):
        label = f"{c.label} " + "".join(f"{k}{n}" for k, n in zip(_SIZES_KEYS, sizes) if k != "dp_shard" or n > 1)
        if groups.rank == 0:
            print(f"[{i}/{len(configs)}] {label} ({c.backend}, {parallel.world} ranks)", flush=True)
        mine += _audit_step(_config(c, steps, sizes), f"rank {groups.rank} {label} step", label, seed=i, groups=groups)
    gathered: list[Any] = [None] * groups.rank_count
    dist.all_gather_object(gathered, mine)
    return [d for drives in gathered for d in drives]


# ---- user targets ---------------------------------------------------------------------


def _load(option: str, spec: str) -> Any:
    """The object `spec` (`package.module:name`) of the command-line option `option` names."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise SystemExit(f"{option} {spec}: expected package.module:name (e.g. mypkg.losses:my_loss)")
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(f"{exc.name}.")):
            raise  # a module the target itself imports
        raise SystemExit(
            f"{option} {spec}: no module named {exc.name!r} in the current directory ({os.getcwd()}) or on sys.path"
        ) from None
    if not hasattr(found, attr):
        raise SystemExit(f"{option} {spec}: module {module!r} ({found.__file__}) has no attribute {attr!r}")
    return getattr(found, attr)


def _bucket_of(value: Any) -> Any:
    """Shapes and dtypes of every tensor inside `value` (the compile-relevant signature)."""
    if isinstance(value, Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return tuple((k, _bucket_of(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_bucket_of(v) for v in value)
    return None


def audit_target(target: str, inputs: str, backend: str, fullgraph: bool) -> Drive:
    fn, factory = _load("--target", target), _load("--inputs", inputs)
    samples = ((_bucket_of((args, kwargs)), args, kwargs) for args, kwargs in factory())
    return drive(target, fn, samples, backend, fullgraph=fullgraph)


# ---- reporting ------------------------------------------------------------------------


def _status(d: Drive) -> str:
    return "ok" if not d.failures() else "FAIL"


def _line(d: Drive) -> str:
    r = d.row()
    warm = "-" if r["warm_ms"] is None else f"{r['warm_ms']:.2f}"
    return (
        f"{r['name']:<44} {r['calls']:>5} {r['graphs']:>6} {len(r['graph_breaks']):>6} {len(r['syncs']):>5} "
        f"{len(r['eager_fallbacks']):>6} {r['compiles']:>8} {len(r['recompiles']):>10} {r['buckets']:>7} "
        f"{r['compile_s']:>9.2f} {warm:>9}  {_status(d)}"
    )


HEADER = (
    f"{'configuration':<44} {'calls':>5} {'graphs':>6} {'breaks':>6} {'syncs':>5} {'eager':>6} "
    f"{'compiles':>8} {'recompiles':>10} {'buckets':>7} {'compile_s':>9} {'warm_ms':>9}  status"
)


def summary(drives: list[Drive]) -> str:
    """`clean/total configurations clean`: a configuration is clean when all its drives are."""
    configs = list(dict.fromkeys(d.configuration for d in drives))
    failing = {d.configuration for d in drives if d.failures()}
    return f"{len(configs) - len(failing)}/{len(configs)} configurations clean"


def markdown(drives: list[Drive]) -> str:
    lines = [
        "# compiled_loss compile audit",
        "",
        summary(drives),
        "",
        "| configuration | calls | graphs | breaks | syncs | eager fallbacks | compiles | recompiles "
        "| buckets | compile s | warm ms | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in drives:
        r = d.row()
        lines.append(
            f"| {r['name']} | {r['calls']} | {r['graphs']} | {len(r['graph_breaks'])} | {len(r['syncs'])} | "
            f"{len(r['eager_fallbacks'])} | {r['compiles']} | {len(r['recompiles'])} | {r['buckets']} | "
            f"{r['compile_s']} | {r['warm_ms']} | {_status(d)} |"
        )
    failing = [d for d in drives if d.failures()]
    if failing:
        lines += ["", "## Failures", ""]
        for d in failing:
            lines += [f"### {d.name}", ""] + [f"- {f}" for f in d.failures()] + [""]
    recompiling = [d for d in drives if d.report.recompiles]
    if recompiling:
        lines += ["", "## Recompile reasons (guard that failed)", ""]
        for d in recompiling:
            lines += [f"- {d.name}: {f.compile_id} of {f.frame}: {f.recompile_reason}" for f in d.report.recompiles]
    return "\n".join(lines) + "\n"


_CHOICES = {"loss": LOSSES, "packing": PACKINGS, "draft": DRAFTS, "dtype": DTYPES, "head": HEADS, "metrics": METRICS}
_ONE_CHOICE = ("head", "metrics")  # a run audits one LM-head path and one metrics level
_SIZES_KEYS = ("tp", "cp", "dp", "dp_shard")  # the parallel sizes, as `parallel.*` names them
_COUNTS = {"batches": 1, "steps": 1, **dict.fromkeys(_SIZES_KEYS, 1)}  # whole numbers, with their least value


def _parse_overrides(items: list[str]) -> dict[str, list[str]]:
    """`key=value[,value...]` items as {key: values}, each key and value checked."""
    keys = sorted((*_CHOICES, *_COUNTS, "backend"))
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise SystemExit(f"bad override {item!r}: expected key=value[,value...] with key in {keys}")
        values = value.split(",")
        if key in _CHOICES:
            bad = [v for v in values if v not in _CHOICES[key]]
            if bad:
                raise SystemExit(f"{key}={','.join(bad)}: not a valid choice; valid choices: {list(_CHOICES[key])}")
        elif len(values) != 1:
            raise SystemExit(f"{item}: {key} takes one value")
        if key in _ONE_CHOICE and len(values) != 1:
            raise SystemExit(f"{item}: {key} takes one value, one of {list(_CHOICES[key])}")
        if key in _COUNTS and not (value.isdigit() and int(value) >= _COUNTS[key]):
            raise SystemExit(f"{item}: {key} takes a whole number >= {_COUNTS[key]}")
        if key == "backend" and value not in (backends := torch._dynamo.list_backends(exclude_tags=())):
            raise SystemExit(f"{item}: not a torch.compile backend; one of {backends}")
        out[key] = values
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compiled-loss-audit",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="loss=…, packing=…, draft=…, dtype=…, head=logits|linear, metrics=full|minimal, batches=N, steps=N, "
        "backend=…; tp=N cp=N dp=N dp_shard=N under torchrun",
    )
    parser.add_argument("--target", help="audit a callable instead: package.module:function")
    parser.add_argument("--inputs", help="with --target: package.module:factory returning (args, kwargs) samples")
    parser.add_argument("--no-fullgraph", action="store_true", help="with --target: allow graph breaks to be counted")
    parser.add_argument(
        "--full", action="store_true", help="every loss × packing × draft × dtype (default: a covering set)"
    )
    parser.add_argument("--out", default="audit_out", help="directory for audit.json and audit.md")
    args = parser.parse_args(argv)
    opts = _parse_overrides(args.overrides)
    if args.target is None and (args.inputs or args.no_fullgraph):
        parser.error("--inputs and --no-fullgraph go with --target")
    if args.target is not None and (args.inputs is None or args.full or set(opts) - {"backend"}):
        parser.error("--target needs --inputs, and takes neither --full nor any override but backend=")
    sizes = tuple(int(opts.get(k, ["1"])[0]) for k in _SIZES_KEYS)
    lead = int(os.environ.get("RANK", "0")) == 0
    if lead:
        print(HEADER, flush=True)
    if args.target:
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does
            sys.path.insert(0, os.getcwd())
        backend = opts.get("backend", ["inductor"])[0]
        drives = [audit_target(args.target, args.inputs, backend, fullgraph=not args.no_fullgraph)]
        print(_line(drives[0]))
    elif sizes != (1,) * len(_SIZES_KEYS):
        configs, _, steps = configurations(opts, args.full)
        drives = audit_distributed(configs, int(opts.get("steps", [steps])[0]), sizes)
        if lead:
            for d in drives:
                print(_line(d), flush=True)
    else:
        configs, batches, steps = configurations(opts, args.full)
        drives = audit_matrix(configs, int(opts.get("batches", [batches])[0]), int(opts.get("steps", [steps])[0]))
    failing = [d for d in drives if d.failures()]
    if not lead:
        return 1 if failing else 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps([d.row() for d in drives], indent=2) + "\n")
    (out / "audit.md").write_text(markdown(drives))
    for d in failing:
        print(f"\nFAIL {d.name}:\n  " + "\n  ".join(d.failures()))
    print(f"\n{summary(drives)}; report in {out / 'audit.md'}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
