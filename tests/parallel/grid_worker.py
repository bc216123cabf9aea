"""The gradient-parity grid's worker: `python grid_worker.py OUT TP CP DP DP_SHARD [CASE ...]`,
under `torchrun --nproc-per-node=TP·CP·DP·DP_SHARD` (or alone for the single process).

For every case (a loss × head of `CASES`, or those named, of `CASES` or `EXTRA_CASES`) it
builds the runner's run
(`compiled_loss.app.loop.build_run`: the seeded models, the loss, the compiled step — eager
here — and the rollouts) at these parallel sizes (the policy and the reference sharded with
FSDP2 and the TP plan), takes the batch of the loss's first step and runs the step. Rank 0
saves, per case, the step's metrics and every policy parameter's whole gradient after the
step (each DTensor gradient gathered with `full_tensor`; the drafter's too), or the error.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' shared helpers
from common import SMALL_RUN  # noqa: E402

from compiled_loss.app import load_config
from compiled_loss.app.loop import build_run
from compiled_loss.audit.cli import LOSSES
from compiled_loss.train.parallel import init_parallel

# small enough that a case takes about a second on one core
SMALL = [
    *SMALL_RUN,
    "run.micro_batches=2",
    "compile.enabled=false",
    "run.sft_steps=0",
    "run.steps=1",
    "optim.grad_clip=null",
]
# the fused LM head serves every loss over the policy's log-probs; opd_full and cross_tokenizer
# read every logit, and mse_value trains a value head
FUSED = [name for name in LOSSES if name not in ("opd_full", "cross_tokenizer", "mse_value")]
# packing alternates between the packed and the padded layout so that both meet every size
CASES = {
    **{f"{name}-dense": [f"loss={name}", f"packing={'fused' if i % 2 else 'none'}"] for i, name in enumerate(LOSSES)},
    **{
        f"{name}-fused_head": [f"loss={name}", "logprob.fused_linear=true", f"packing={'none' if i % 2 else 'fused'}"]
        for i, name in enumerate(FUSED)
    },
}


# cases the grid runs at some sizes only (`test_gradient_grid.py`): `model=hf` (transformers' Llama under
# the TP plan) on two losses, and the co-trained drafters
EXTRA_CASES = {
    "hf-clipped_pg": ["model=hf", "loss=clipped_pg", "packing=fused"],
    "hf-dpo-fused_head": ["model=hf", "loss=dpo", "packing=none", "logprob.fused_linear=true"],
    "eagle3": ["loss=clipped_pg", "draft=eagle3", "packing=fused"],
    # EAGLE-3 normalises its loss over a step's micro-batches, its denominators summed over the
    # data-parallel ranks: one micro-batch per rank matches one process's one
    "eagle3-one_micro_batch": ["loss=clipped_pg", "draft=eagle3", "packing=fused", "run.micro_batches=1"],
    "dflash": ["loss=clipped_pg", "draft=dflash", "packing=none"],
}


def _first_batch(run) -> dict[str, torch.Tensor]:
    """The batch of the loss's first step, moved off its fixed point. A first step sits where every ratio is 1 and every KL 0 (the reference, the sampler and
    the policy are one model), where a wrong ratio or KL gradient vanishes. Move off it the
    same way on every rank: seeded noise on the reference's weights (whole on every rank),
    and sampler / old-policy log-probs shifted by a function of each token and position (so
    a row gets the same shift in whichever replica and layout it lands)."""
    generator = torch.Generator().manual_seed(1)
    options = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(run.reference, options=options)  # whole, on every rank
    for name in sorted(state):
        state[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=generator)
    set_model_state_dict(run.reference, state, options=options)
    batch, _ = run.batch(1, run.cfg.loss.reward_shift if run.cfg.loss.name == "mpo" else None)
    ids = batch["input_ids"]
    shift = 0.3 * torch.sin(1.7 * ids + 0.3 * torch.arange(ids.shape[1])) * batch["token_mask"]
    for key, sign in (("prev_logprobs", 1.0), ("generation_logprobs", -0.5)):
        if key in batch:
            batch[key] = batch[key] + sign * shift
    return batch


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient gathered whole (a collective for a DTensor: every rank calls it)."""
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def run_case(overrides: list[str], groups) -> dict:
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        cfg = load_config(compose(config_name="config", overrides=SMALL + overrides))
    run = build_run(cfg, groups)
    batch = _first_batch(run)
    metrics = run.step(batch).metrics
    grads = {name: _whole(p.grad) for name, p in run.policy.named_parameters() if p.grad is not None}
    if run.drafter is not None:  # replicated: each rank holds the single-process gradient after the step
        grads |= {f"drafter.{name}": p.grad.clone() for name, p in run.drafter.named_parameters() if p.grad is not None}
    return {"metrics": metrics, "grads": grads}


def main(out: str, tp: int, cp: int, dp: int, dp_shard: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("WORLD_SIZE", "1")
    groups = None
    results = {}
    for name in names or CASES:
        sizes = [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.dp={dp}", f"parallel.dp_shard={dp_shard}"]
        overrides = (CASES | EXTRA_CASES)[name] + sizes
        if groups is None:  # one set of process groups serves every case
            with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
                groups = init_parallel(load_config(compose(config_name="config", overrides=SMALL + overrides)).parallel)
        start = time.perf_counter()
        try:
            results[name] = run_case(overrides, groups)
        except Exception as e:  # reported per case; the grid goes on
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = time.perf_counter() - start
    if groups.rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    out, tp, cp, dp, dp_shard, *names = sys.argv[1:]
    main(out, int(tp), int(cp), int(dp), int(dp_shard), names)
