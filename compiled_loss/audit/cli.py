"""`compiled-loss-audit` (also `python tools/audit.py`): the graph-break / recompile gate.

Sweeps configurations — by default a representative subset (every loss, packing mode,
draft runtime, dtype and backend at least once, a few minutes on 2 CPU cores); `--full` or a
`loss=` / `packing=` / `draft=` / `dtype=` choice sweeps the matrix of those — and for
each drives (1) the compiled packing wrapper over `batches` micro-batches
drawn from a realistic RL length distribution (once per loss, packing and dtype: it does
not read the drafter) and (2) the compiled training step — with its co-trained drafter —
over `steps` steps. For each it reports graphs, graph breaks (reason, file:line), in-graph host
syncs, frames that fell back to eager, compiles and recompiles (with the failed guard),
buckets hit, compile seconds and warm call time — as a terminal table, `audit.json` and
`audit.md`. It exits non-zero when any configuration has a break, a sync or an eager
fallback, compiles more often than it hit distinct buckets, or recompiles on a bucket it
had already compiled.

    compiled-loss-audit                                   # the representative subset
    compiled-loss-audit --full                            # every loss × packing × draft × dtype
    compiled-loss-audit loss=clipped_pg,dpo packing=fused dtype=bf16 batches=50
    compiled-loss-audit head=linear loss=clipped_pg,distillation   # the fused LM head (LinearLogits)
    compiled-loss-audit metrics=minimal loss=clipped_pg,gspo       # policy-gradient losses' minimal metrics
    compiled-loss-audit --target mypkg.losses:my_loss --inputs mypkg.losses:samples
    torchrun --nproc-per-node 4 -m compiled_loss.audit.cli tp=2 cp=2 loss=clipped_pg packing=fused

With `tp=`, `cp=`, `dp=` (under torchrun, their product ranks) every rank drives the
compiled training step with its process groups, and rank 0 reports every rank's rows.

`--target` audits any callable: the `--inputs` factory returns an iterable of
`(args, kwargs)` samples; a bucket is the samples' tensor shapes and dtypes.
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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from compiled_loss.train.recorder import CompileRecorder, CompileReport

Tensor = torch.Tensor

LOSSES = ("clipped_pg", "gspo", "cispo", "reinforce", "opd_full", "nll", "dpo", "distillation", "mse_value")
_POLICY_GRADIENT = ("clipped_pg", "gspo", "cispo", "reinforce", "opd_full")  # the losses with a metrics_level
PACKINGS = ("none", "per_sequence", "fused")
DRAFTS = ("none", "eagle3", "dflash")
DTYPES = ("fp32", "bf16")

# The default run, as (loss, packing, draft, dtype, backend): every loss, packing mode, draft
# runtime, dtype and backend at least once.
SUBSET = (
    ("clipped_pg", "fused", "none", "bf16", "inductor"),
    ("clipped_pg", "per_sequence", "none", "fp32", "aot_eager"),
    ("gspo", "fused", "none", "fp32", "aot_eager"),
    ("cispo", "none", "none", "bf16", "aot_eager"),
    ("reinforce", "per_sequence", "none", "fp32", "aot_eager"),
    ("nll", "fused", "none", "bf16", "aot_eager"),
    ("dpo", "per_sequence", "none", "fp32", "aot_eager"),
    ("distillation", "fused", "none", "fp32", "aot_eager"),
    ("opd_full", "per_sequence", "none", "fp32", "aot_eager"),
    ("mse_value", "none", "none", "fp32", "aot_eager"),
    ("nll", "per_sequence", "eagle3", "bf16", "aot_eager"),
    ("clipped_pg", "none", "dflash", "fp32", "aot_eager"),
)
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

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
]


@dataclasses.dataclass
class Drive:
    """One audited callable: its compile report plus what the audit tracked per call."""

    name: str
    report: CompileReport
    buckets: int = 0
    warm_ms: float | None = None
    recompiled_seen_buckets: list[str] = dataclasses.field(default_factory=list)

    def failures(self) -> list[str]:
        out = self.report.problems()
        if self.report.compiles > self.buckets:
            out.append(f"{self.report.compiles} compiles for {self.buckets} distinct buckets")
        out += [f"recompiled an already-compiled bucket {b}" for b in self.recompiled_seen_buckets]
        return out

    def row(self) -> dict[str, Any]:
        r = self.report
        return {
            "name": self.name,
            "calls": r.calls,
            "graphs": len(r.graphs),
            "graph_breaks": [f"{g.break_location}: {g.break_reason}" for g in r.graph_breaks],
            "syncs": [f"{g.compile_id}: {g.sync_ops}" for g in r.graphs if g.sync_ops],
            "eager_fallbacks": [f"{f.frame} @ {f.fail_location}: {f.fail_reason}" for f in r.eager_fallbacks],
            "compiles": r.compiles,
            "recompiles": [f"{f.compile_id}: {f.recompile_reason}" for f in r.recompiles],
            "buckets": self.buckets,
            "compile_s": round(r.compile_seconds, 2),
            "warm_ms": None if self.warm_ms is None else round(self.warm_ms, 3),
            "failures": self.failures(),
        }


def drive(
    name: str,
    fn: Callable[..., Any],
    samples: Iterable[tuple[Any, Any, Any]],
    backend: str,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    after: Callable[[Any], None] | None = None,
) -> Drive:
    """Compile `fn` with a recorder and call it on `(bucket, args, kwargs)` samples;
    `after(output)` runs on each result (e.g. the backward)."""
    torch._dynamo.reset()
    recorder = CompileRecorder(backend, name)
    compiled = recorder.compile(fn, fullgraph=fullgraph, dynamic=dynamic)
    result = Drive(name, recorder.report)
    seen: set[Any] = set()
    warm: list[float] = []
    for bucket, args, kwargs in samples:
        before = recorder.report.compiles
        start = time.perf_counter()
        output = compiled(*args, **kwargs)
        if after is not None:
            after(output)
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


def _variant(loss: str, opts: dict[str, list[str]]) -> tuple[list[str], str]:
    """The config overrides and label suffix of the `head=` / `metrics=` choices for `loss`."""
    overrides, suffix = [], ""
    if opts.get("head") == ["linear"]:
        overrides, suffix = ["logprob.fused_linear=true"], "/linear"
    if opts.get("metrics") == ["minimal"] and loss in _POLICY_GRADIENT:
        overrides, suffix = overrides + ["loss.metrics_level=minimal"], suffix + "/minimal"
    return overrides, suffix


def _config(
    loss: str, packing: str, draft: str, dtype: str, backend: str, steps: int, sizes=(1, 1, 1), variant: list[str] = ()
):
    from compiled_loss.app import compose_config

    overrides = [
        f"loss={loss}",
        f"packing={packing}",
        f"draft={draft}",
        f"compile.backend={backend}",
        f"model.dtype={'bfloat16' if dtype == 'bf16' else 'float32'}",
        f"run.steps={steps}",
        *_SIZES,
        *(f"parallel.{k}={n}" for k, n in zip(("tp", "cp", "dp"), sizes)),
        *variant,
    ]
    return compose_config(*overrides)


def _wrapper_samples(cfg, dtype: torch.dtype, batches: int, seed: int):
    """`(bucket, args, kwargs)` for the packing wrapper (or the unpacked loss) on synthetic
    RL micro-batches with random logits (`logprob.fused_linear`: random hidden states and
    LM head, as `LinearLogits`)."""
    from compiled_loss.app.batches import sample_batch
    from compiled_loss.config import PackingMode, loss_family
    from compiled_loss.inputs import Preparation, PrepareOptions
    from compiled_loss.interfaces import InputSpec
    from compiled_loss.packing import PackedLayout, pad_to_bucket, round_to_bucket
    from compiled_loss.train.step import packed_boundaries
    from compiled_loss.vocab import LinearLogits

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    loss_fn = cfg.loss_fn
    prepare = Preparation(loss_fn, InputSpec.of(loss_fn), PrepareOptions())
    family = loss_family(cfg.loss)
    mode, grid = cfg.packing.mode, cfg.packing.grid()
    vocab = 1 if family == "value" else cfg.model.vocab_size

    def random_logits(*positions: int):
        if not cfg.logprob.fused_linear:
            return torch.randn(*positions, vocab, generator=gen).to(dtype).requires_grad_()
        hidden = torch.randn(*positions, cfg.model.hidden_size, generator=gen).to(dtype).requires_grad_()
        return LinearLogits(hidden, torch.randn(vocab, cfg.model.hidden_size, generator=gen).to(dtype).requires_grad_())

    for _ in range(batches):
        batch = sample_batch(cfg.data, cfg.model.vocab_size, rng, pairs=family == "dpo")
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
        loss_fn=prepare.loss_fn,
        spec=prepare.spec,
        prepare=prepare,
        layout=layout,
        per_sequence=per_sequence,
    )


def _audit_step(cfg, name: str, seed: int, groups=None) -> list[Drive]:
    """Drive the compiled training step (model forward + loss + backward + optimizer); with
    parallel `groups` also the model, which then compiles apart (DDP runs around it)."""
    from compiled_loss.app.batches import replica_rows, rollout, sample_batch
    from compiled_loss.app.loop import build_models
    from compiled_loss.config import loss_family
    from compiled_loss.train import build_train_step
    from compiled_loss.train.parallel import ParallelGroups

    groups = groups or ParallelGroups()
    dp = groups.sizes[2]
    torch._dynamo.reset()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    family = loss_family(cfg.loss)
    models = build_models(cfg, groups)  # the run's models and drafter, as `python -m compiled_loss.run` builds them
    step = build_train_step(cfg, models.policy, torch.optim.AdamW(models.trained(), lr=1e-3), groups, models.drafter)
    recorders = [(name, step.recorder)] + ([(f"{name} model", step.model_recorder)] if step.model_recorder else [])
    results = [Drive(label, recorder.report) for label, recorder in recorders]
    warm: list[float] = []
    for i in range(cfg.run.steps):
        batch = sample_batch(cfg.data, cfg.model.vocab_size, rng, pairs=family == "dpo", clean=family == "nll")
        batch = rollout(
            replica_rows(batch, dp, groups.dp_rank),
            family,
            policy=models.policy,
            reference=models.reference,
            teacher=models.teacher,
            topk=cfg.data.teacher_topk,
        )
        seen = set(step.buckets)
        before = [r.report.compiles for r in results]
        outcome = step(batch)
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


def configurations(opts: dict[str, list[str]], full: bool) -> tuple[list[tuple[str, ...]], int, int]:
    """The (loss, packing, draft, dtype, backend) rows to audit, and the default batches and
    steps: the subset (50, 5), or — `--full` or any matrix choice — the matrix (200, 20).
    `head=linear` keeps the rows the fused LM head serves (no value head, no drafter)."""
    dims = ("loss", "packing", "draft", "dtype")
    backend = opts.get("backend", [None])[0]
    if not full and not any(d in opts for d in dims):
        rows, batches, steps = [row[:4] + (backend or row[4],) for row in SUBSET], 50, 5
    else:
        choices = [opts.get(d, list(every)) for d, every in zip(dims, (LOSSES, PACKINGS, DRAFTS, DTYPES))]
        # a drafter reads the policy's logits: the value loss trains without one
        rows = [
            row + (backend or "inductor",)
            for row in itertools.product(*choices)
            if row[0] != "mse_value" or row[2] == "none"
        ]
        batches, steps = 200, 20
    if opts.get("head") == ["linear"]:  # the fused LM head: no value head, OPD or drafter (they read the logits)
        rows = [row for row in rows if row[0] not in ("mse_value", "opd_full") and row[2] == "none"]
    if not rows:
        raise SystemExit(
            "no configuration to audit: loss=mse_value takes no drafter and no head=linear, and "
            "head=linear takes no drafter"
        )
    return rows, batches, steps


def audit_matrix(
    rows: list[tuple[str, ...]], batches: int, steps: int, opts: dict[str, list[str]] | None = None
) -> list[Drive]:
    drives = []
    for i, (loss, packing, draft, dtype, backend) in enumerate(rows, 1):
        variant, suffix = _variant(loss, opts or {})
        label = f"{loss}/{packing}/{draft}/{dtype}{suffix}"
        print(f"[{i}/{len(rows)}] {label} ({backend})", flush=True)
        cfg = _config(loss, packing, draft, dtype, backend, steps, variant=variant)
        found = []
        if draft == "none":  # the wrapper does not read the drafter: audited once per loss / packing / dtype
            samples = _wrapper_samples(cfg, _TORCH_DTYPES[dtype], batches, seed=len(drives))
            found.append(
                drive(
                    f"{label} wrapper",
                    _wrapper_call,
                    samples,
                    backend,
                    dynamic=cfg.compile.dynamic,
                    after=lambda out: out[0].backward(),
                )
            )
        if steps:
            found += _audit_step(cfg, f"{label} step", seed=len(drives))
        for d in found:
            print(_line(d), flush=True)
        drives += found
    return drives


def audit_distributed(
    rows: list[tuple[str, ...]], steps: int, sizes: tuple[int, int, int], opts: dict[str, list[str]] | None = None
) -> list[Drive]:
    """Under torchrun: every rank drives the compiled training step with its (tp, cp, dp)
    groups; every rank returns every rank's drives (the step's loss graph, and the model,
    which compiles apart around DDP), labelled with their rank."""
    import torch.distributed as dist

    from compiled_loss.config import ParallelConfig
    from compiled_loss.train.parallel import init_parallel

    tp, cp, dp = sizes
    groups = init_parallel(ParallelConfig(tp=tp, cp=cp, dp=dp))
    mine: list[Drive] = []
    for i, (loss, packing, draft, dtype, backend) in enumerate(rows, 1):
        variant, suffix = _variant(loss, opts or {})
        label = f"{loss}/{packing}/{draft}/{dtype}{suffix} tp{tp}cp{cp}dp{dp}"
        if groups.rank == 0:
            print(f"[{i}/{len(rows)}] {label} ({backend}, {tp * cp * dp} ranks)", flush=True)
        cfg = _config(loss, packing, draft, dtype, backend, steps, sizes, variant)
        mine += _audit_step(cfg, f"rank {groups.rank} {label} step", seed=i, groups=groups)
    gathered: list[Any] = [None] * groups.rank_count
    dist.all_gather_object(gathered, mine)
    return [d for drives in gathered for d in drives]


# ---- user targets ---------------------------------------------------------------------


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"expected 'package.module:name', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


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
    fn, factory = _load(target), _load(inputs)
    samples = ((_bucket_of((args, kwargs)), args, kwargs) for args, kwargs in factory())
    return drive(target, fn, samples, backend, fullgraph=fullgraph)


# ---- reporting ------------------------------------------------------------------------


def _line(d: Drive) -> str:
    r = d.row()
    status = "ok" if not r["failures"] else "FAIL"
    warm = "-" if r["warm_ms"] is None else f"{r['warm_ms']:.2f}"
    return (
        f"{r['name']:<44} {r['calls']:>5} {r['graphs']:>6} {len(r['graph_breaks']):>6} {len(r['syncs']):>5} "
        f"{len(r['eager_fallbacks']):>6} {r['compiles']:>8} {len(r['recompiles']):>10} {r['buckets']:>7} "
        f"{r['compile_s']:>9.2f} {warm:>9}  {status}"
    )


HEADER = (
    f"{'configuration':<44} {'calls':>5} {'graphs':>6} {'breaks':>6} {'syncs':>5} {'eager':>6} "
    f"{'compiles':>8} {'recompiles':>10} {'buckets':>7} {'compile_s':>9} {'warm_ms':>9}  status"
)


def markdown(drives: list[Drive]) -> str:
    lines = [
        "# compiled_loss compile audit",
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
            f"{r['compile_s']} | {r['warm_ms']} | {'ok' if not r['failures'] else 'FAIL'} |"
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
            lines += [f"- {d.name}: {f.compile_id} {f.recompile_reason}" for f in d.report.recompiles]
    return "\n".join(lines) + "\n"


def _parse_overrides(items: list[str]) -> dict[str, list[str]]:
    allowed = {
        "loss": LOSSES,
        "packing": PACKINGS,
        "draft": DRAFTS,
        "dtype": DTYPES,
        "head": ("logits", "linear"),
        "metrics": ("full", "minimal"),
    }
    scalars = ("batches", "steps", "backend", "tp", "cp", "dp")
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in (*allowed, *scalars):
            raise SystemExit(
                f"bad override {item!r}: expected key=value[,value...] with key in {sorted((*allowed, *scalars))}"
            )
        values = value.split(",")
        if key in allowed:
            bad = [v for v in values if v not in allowed[key]]
            if bad:
                raise SystemExit(f"{key}={','.join(bad)}: not a valid choice; valid choices: {list(allowed[key])}")
        if key == "head" and len(values) != 1:
            raise SystemExit(f"head={value}: one value, logits or linear (a run audits one LM-head path)")
        if key == "metrics" and len(values) != 1:
            raise SystemExit(f"metrics={value}: one value, full or minimal (the policy-gradient losses' metrics_level)")
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
        "backend=…; tp=N cp=N "
        "dp=N under torchrun",
    )
    parser.add_argument("--target", help="audit a callable instead: package.module:function")
    parser.add_argument("--inputs", help="with --target: package.module:factory returning (args, kwargs) samples")
    parser.add_argument("--no-fullgraph", action="store_true", help="with --target: allow graph breaks to be counted")
    parser.add_argument("--full", action="store_true", help="every loss × packing × draft × dtype (default: a subset)")
    parser.add_argument("--out", default="audit_out", help="directory for audit.json and audit.md")
    args = parser.parse_args(argv)
    opts = _parse_overrides(args.overrides)
    sizes = tuple(int(opts.get(k, ["1"])[0]) for k in ("tp", "cp", "dp"))
    lead = int(os.environ.get("RANK", "0")) == 0
    if lead:
        print(HEADER, flush=True)
    if args.target:
        if not args.inputs:
            parser.error("--target needs --inputs")
        backend = opts.get("backend", ["inductor"])[0]
        drives = [audit_target(args.target, args.inputs, backend, fullgraph=not args.no_fullgraph)]
        print(_line(drives[0]))
    elif sizes != (1, 1, 1):
        rows, _, steps = configurations(opts, args.full)
        drives = audit_distributed(rows, int(opts.get("steps", [steps])[0]), sizes, opts)
        if lead:
            for d in drives:
                print(_line(d), flush=True)
    else:
        rows, batches, steps = configurations(opts, args.full)
        drives = audit_matrix(rows, int(opts.get("batches", [batches])[0]), int(opts.get("steps", [steps])[0]), opts)
    failing = [d for d in drives if d.failures()]
    if not lead:
        return 1 if failing else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps([d.row() for d in drives], indent=2) + "\n")
    (out / "audit.md").write_text(markdown(drives))
    for d in failing:
        print(f"\nFAIL {d.name}:\n  " + "\n  ".join(d.failures()))
    print(f"\n{len(drives) - len(failing)}/{len(drives)} configurations clean; report in {out}/audit.md")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
