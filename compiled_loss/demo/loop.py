"""The embedded training loop: the demo model on the demo task through the compiled
training step, with a progress line per step and `metrics.jsonl` / `summary.json`."""

from __future__ import annotations

import contextlib
import copy
import json
import random
from pathlib import Path
from typing import Any

import torch

from compiled_loss.config import Config, build_draft_runtime, loss_family
from compiled_loss.demo.data import replica_rows, rollout, sample_batch
from compiled_loss.demo.model import TinyLM
from compiled_loss.train import build_train_step
from compiled_loss.train.parallel import init_parallel

# the metrics shown on the per-step line, per loss family (when present)
_KEY_METRICS = {
    "policy_gradient": ("probs_ratio", "kl_penalty", "sampling_importance_ratio"),
    "nll": ("num_unmasked_tokens",),
    "dpo": ("accuracy", "rewards_chosen_mean", "rewards_rejected_mean"),
    "distillation": (),
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


def train(cfg: Config, output_dir: Path) -> dict[str, Any]:
    """Run `cfg.run.steps` steps; write metrics.jsonl and summary.json (rank 0; other ranks
    write their compile report as `summary.rank<r>.json`); return the summary.

    Under `torchrun` (`parallel.tp · cp · dp` processes) every rank holds the whole model —
    the LM head returns this rank's vocabulary shard — and the step replicates it with
    DistributedDataParallel; each data-parallel replica trains on its share of every
    global batch."""
    groups = init_parallel(cfg.parallel)
    tp, _, dp = groups.sizes
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    family = loss_family(cfg.loss)
    policy = TinyLM(cfg.model, value_head=family == "value", vocab_shard=(groups.tp_rank, tp))
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    teacher = TinyLM(cfg.model).requires_grad_(False).eval() if family == "distillation" else None
    drafter = build_draft_runtime(cfg.draft, cfg.model, policy, groups.dp)
    trained = [p for m in (policy, drafter) if m is not None for p in m.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    step = build_train_step(cfg, policy, optimizer, groups, drafter)
    lead = groups.rank == 0
    output_dir.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, Any]] = []
    tokens = slots = steady_tokens = 0
    train_seconds = steady_seconds = 0.0
    with open(output_dir / "metrics.jsonl", "w") if lead else contextlib.nullcontext() as log:
        for i in range(1, cfg.run.steps + 1):
            batch = sample_batch(cfg.data, cfg.model.vocab_size, rng, pairs=family == "dpo", clean=family == "nll")
            reward = float(batch["rewards"].mean())
            batch = rollout(replica_rows(batch, dp, groups.dp_rank), family, policy=policy, reference=reference,
                            teacher=teacher, topk=cfg.data.teacher_topk)
            result = step(batch)
            tokens, slots, train_seconds = tokens + result.tokens, slots + result.slots, train_seconds + result.seconds
            record = {
                "step": i,
                **result.metrics,
                "reward": reward,
                "tokens": result.tokens,
                "tokens_per_s": result.tokens / result.seconds,
                "padding_fraction": 1 - result.tokens / result.slots,
                "step_seconds": result.seconds,
                "compiles": step.compiles,
            }
            if history and step.compiles == history[-1]["compiles"]:  # no compile in this step
                steady_tokens, steady_seconds = steady_tokens + result.tokens, steady_seconds + result.seconds
            history.append(record)
            if not lead:
                continue
            log.write(json.dumps(record) + "\n")
            log.flush()
            if i % cfg.run.log_every == 0 or i == cfg.run.steps:
                keys = [k for k in _KEY_METRICS[family] + _draft_metrics(cfg) if k in record]
                shown = " ".join(f"{k} {record[k]:.4g}" for k in keys)
                print(
                    f"\r{_progress(i, cfg.run.steps)} loss {record['loss']:.4f} {shown} reward "
                    f"{record['reward']:.3f} | {record['tokens_per_s']:.0f} tok/s | compiles {step.compiles}",
                    flush=True,
                )
    report = step.recorder.report if step.recorder else None
    summary = {
        "loss": cfg.loss.name,
        "draft": cfg.draft.name,
        "packing": cfg.packing.mode.value,
        "compile": cfg.compile.enabled and cfg.compile.backend,
        "steps": cfg.run.steps,
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        **{f"{end}_{key}": history[at][key] for key in _draft_metrics(cfg)
           for end, at in (("first", 0), ("final", -1))},
        "tokens": tokens,
        "tokens_per_s": tokens / train_seconds,
        "steady_tokens_per_s": steady_tokens / steady_seconds if steady_seconds else None,
        "padding_fraction": 1 - tokens / slots,
        "compiles": step.compiles,
        "buckets": len(step.buckets),
        "compile_seconds": report.compile_seconds if report else 0.0,
        "compile_problems": step.compile_problems(),
        "parallel": {"tp": cfg.parallel.tp, "cp": cfg.parallel.cp, "dp": cfg.parallel.dp, "rank": groups.rank},
        "output_dir": str(output_dir),
    }
    name = "summary.json" if lead else f"summary.rank{groups.rank}.json"
    (output_dir / name).write_text(json.dumps(summary, indent=2) + "\n")
    if lead:
        print(json.dumps(summary, indent=2))
    return summary
