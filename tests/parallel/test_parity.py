"""Every wrapper × loss type with real gloo groups at (tp, cp) ∈ {(2, 1), (1, 2), (2, 2)}:
loss and every metric identical on all ranks and equal to the single-process result, the
gradient w.r.t. each rank's logit shard equal to the matching slice of the single-process
gradient — times cp, the reference's context-parallel convention (its all-gather backward
sums over the CP ranks; its trainer divides the loss by cp) — and one clean graph per rank
under torch.compile (a representative subset at (2, 2)). One spawn per configuration
runs every case. The same with the logits as NeMo-RL's DTensor path holds them (and no
vocabulary group argument): the wrappers unwrap them once, at the edge.

`python tests/parallel/test_parity.py` prints the table of maximum errors."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from cases import CASE_BY_NAME, TEACHER_HEADS, boundaries, globals_for, make_batch, pack_logits
from ranks import context_local, run_on_ranks, tp_cp_groups
from tolerances import close
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from compiled_loss.loss_input import prepare_loss_input
from compiled_loss.train import CompileRecorder
from compiled_loss.wrapper import (
    DraftLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

pytestmark = pytest.mark.slow  # torchrun: several processes per test

LOSSES = [
    "grpo",
    "grpo_topk_topp",
    "gspo_tis",
    "nll",
    "dpo_sft",
    "distill_mixed_zero_outside",
    "distill_reverse",
    "opd_full_logits",
    "opd_full_hidden_seq_level",
    "mse_value_clipped",
]
WRAPPERS = ["unpacked", "per_sequence", "fused", "draft_packed", "draft_unpacked"]
LENGTHS, PADS, WIDTH = [6, 3, 8, 2], [2, 1, 0, 2], 8  # padded lengths 8, 4, 8, 4: multiples of 2·cp
D2T = torch.tensor([0, 1, 1, 3, 5, 5, 6, 8])  # an 8-id draft vocabulary
TOL = close(torch.float32, "parallel")
# compiled (aot_eager, fullgraph) at (tp, cp) = (2, 2): one case of each pattern of collectives — every
# wrapper with top-k/top-p GRPO (log-probs, thresholds, draft vocab), top-k distillation (vocab_topk over
# the shards), OPD_FULL from teacher logits and from teacher hidden states; NLL, DPO and the value loss
# read the log-prob / logit inputs GRPO's cases compile. Every case runs eagerly at every (tp, cp).
COMPILED = {("grpo_topk_topp", w) for w in WRAPPERS} | {
    ("distill_mixed_zero_outside", "fused"),
    ("opd_full_logits", "fused"),
    ("opd_full_hidden_seq_level", "per_sequence"),
}


def _batch(name: str):
    case = CASE_BY_NAME[name]
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=11)
    student = torch.randn(len(LENGTHS), WIDTH, len(D2T), generator=torch.Generator().manual_seed(12))
    return case, data, logits.detach(), student


def _wrapper(which, case, student, tp_group=None, cp_group=None, heads_group=None):
    """The wrapper under test, built on the host; `student` is this rank's draft logits; the
    teacher heads are sharded over `heads_group` (default: `tp_group`)."""
    groups = dict(vocab_parallel_group=tp_group, context_parallel_group=cp_group)
    cu, cup = boundaries(LENGTHS, PADS)
    loss_fn = case.make_loss()
    prepare = case.prepare
    heads_group = heads_group or tp_group
    if case.teacher_heads and heads_group is not None:  # each TP rank holds its vocabulary shard of the heads
        tp, rank = dist.get_world_size(heads_group), dist.get_rank(heads_group)
        heads = {k: w.chunk(tp)[rank] for k, w in TEACHER_HEADS.items()}

        def prepare(packed):
            return functools.partial(case.prepare(packed), teacher_output_layer_weight_by_index=heads)

    if which == "unpacked":
        return functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, prepare_fn=prepare(packed=False), **groups
        )
    if which in ("per_sequence", "fused"):
        cls = SequencePackingFusionLossWrapper if which == "fused" else SequencePackingLossWrapper
        return cls(loss_fn, prepare(packed=which == "fused"), cu, cup, **groups)
    if which == "draft_unpacked":
        policy = functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=loss_fn, prepare_fn=prepare(packed=False), **groups
        )
        return DraftLossWrapper(policy, functools.partial(prepare_loss_input, d2t=D2T), None, 0.3, **groups)
    policy = SequencePackingFusionLossWrapper(loss_fn, prepare(packed=True), cu, cup, **groups)
    return DraftLossWrapper(
        policy, None, None, 0.3, cu_seqlens_q=cu, cu_seqlens_q_padded=cup, d2t=D2T, student_logits=student, **groups
    )


def _apply(wrapper, logits, data, gs, gt):
    return wrapper(logits, data, gs, gt)


def _full_inputs(which, logits, student):
    """Single-process logits / student in the wrapper's layout (packed or unpacked)."""
    if which in ("per_sequence", "fused", "draft_packed"):
        cu, cup = boundaries(LENGTHS, PADS)
        return pack_logits(logits, cu, cup, cup[-1], seed=13).detach(), pack_logits(student, cu, cup, cup[-1], 14)
    return logits, student


def _shard(which, x, tp_rank, tp, cp_group):
    """This rank's shard of full logits: its vocabulary slice, and its CP slots / positions."""
    if x.shape[-1] > 1:
        width = x.shape[-1] // tp
        x = x[..., tp_rank * width : (tp_rank + 1) * width]
    return context_local(x, cp_group, None if which in ("unpacked", "draft_unpacked") else boundaries(LENGTHS, PADS)[1])


def _mesh_logits(local: torch.Tensor, mesh) -> DTensor:
    """A rank's local logits as NeMo-RL's DTensor path holds them: `(Shard(-1),)` on a 1-D "tp"
    mesh, `(Shard(1),)` on a 1-D "cp" mesh, `(Shard(1), Shard(-1))` on ("cp", "tp")."""
    vocab, sequence = Shard(local.dim() - 1), Shard(1)
    if mesh.ndim == 2:
        return DTensor.from_local(local, mesh, [sequence, vocab])
    return DTensor.from_local(local, mesh, [vocab if mesh.mesh_dim_names == ("tp",) else sequence])


def _on_ranks(rank: int, world: int, tp: int, cp: int, dtensor: bool = False):
    """Every case on this rank; `dtensor`: the logits (and draft logits) as DTensors, the wrappers
    given no vocabulary group (a packing wrapper keeps its context-parallel group: its layout is
    built from it), eagerly."""
    tp_group, cp_group = tp_cp_groups(rank, world, tp, cp)
    if dtensor:  # the mesh's groups: the same ranks
        sizes = {name: size for name, size in (("cp", cp), ("tp", tp)) if size > 1}
        mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        tp_group, cp_group = (mesh.get_group("tp") if tp > 1 else None), (mesh.get_group("cp") if cp > 1 else None)
    tp_rank, cp_size = rank % tp, cp
    report = []
    for name in LOSSES:
        for which in WRAPPERS:
            if which.startswith("draft") and not name.startswith("grpo"):
                continue  # the draft wrappers: with a policy-gradient loss
            case, data, logits, student = _batch(name)
            gs, gt = globals_for(data)
            full, full_student = _full_inputs(which, logits, student)
            full = full.requires_grad_()
            data_full = {**data, "student_logits": full_student} if which == "draft_unpacked" else data
            want, want_metrics = _apply(_wrapper(which, case, full_student), full, data_full, gs, gt)
            (want_grad,) = torch.autograd.grad(want, full)
            local = _shard(which, full.detach(), tp_rank, tp, cp_group).requires_grad_()
            local_student = _shard(which, full_student, tp_rank, tp, cp_group)
            want_local_grad = _shard(which, want_grad, tp_rank, tp, cp_group) * cp_size
            packed_cp = cp_group if which in ("per_sequence", "fused", "draft_packed") else None
            student_in = _mesh_logits(local_student, mesh) if dtensor else local_student
            wrapper = (
                _wrapper(which, case, student_in, None, packed_cp, heads_group=tp_group)
                if dtensor
                else _wrapper(which, case, local_student, tp_group, cp_group)
            )
            data_local = {**data, "student_logits": student_in} if which == "draft_unpacked" else data
            modes = ("eager", "compiled") if tp * cp == 4 and (name, which) in COMPILED and not dtensor else ("eager",)
            for mode in modes:
                torch._dynamo.reset()
                recorder = CompileRecorder("aot_eager")
                fn = _apply if mode == "eager" else recorder.compile(_apply, fullgraph=True)
                got, metrics = fn(wrapper, _mesh_logits(local, mesh) if dtensor else local, data_local, gs, gt)
                (grad,) = torch.autograd.grad(got, local)
                label = f"{name}/{which}/{mode}{'/dtensor' if dtensor else ''}"
                errors = {"loss": (got - want).abs().item()}
                try:
                    torch.testing.assert_close(got, want, **TOL)
                    for key in want_metrics:
                        torch.testing.assert_close(
                            metrics[key].float(),
                            want_metrics[key].float(),
                            **TOL,
                            msg=lambda m, k=key: f"metric {k}: {m}",
                        )
                    torch.testing.assert_close(grad, want_local_grad, **close(torch.float32, "parallel"))
                except AssertionError as e:
                    report.append(
                        f"{label}: {str(e).splitlines()[0]} | {[ln for ln in str(e).splitlines() if 'metric' in ln][:1]}"
                    )
                if mode == "compiled" and recorder.report.problems():
                    report.append(f"{label}: {recorder.report.problems()}")
                errors["grad"] = (grad - want_local_grad).abs().max().item() if grad.numel() else 0.0
                errors["metrics"] = max(
                    (
                        0.0
                        if metrics[k] == want_metrics[k]
                        else (metrics[k].float() - want_metrics[k].float()).abs().item()
                        for k in want_metrics
                    ),
                    default=0.0,
                )
                report.append((label, errors, got.item()))
    return report


@pytest.mark.parametrize("dtensor", [False, True], ids=["groups", "dtensor"])
@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "cp2", "tp2cp2"])
def test_parallel_parity_table(tp, cp, dtensor):
    """`dtensor`: NeMo-RL-shaped DTensor logits into every wrapper, with no vocabulary group."""
    results = run_on_ranks(_on_ranks, tp, cp, dtensor, world_size=tp * cp, timeout=600)
    problems = [p for r in results for p in (r if isinstance(r, list) else [r]) if isinstance(p, str)]
    assert problems == []
    losses = [[p[2] for p in r if isinstance(p, tuple)] for r in results]
    assert all(lo == losses[0] for lo in losses)  # identical on every rank


if __name__ == "__main__":  # the parity table: max |error| of loss, metrics and gradients per (tp, cp)
    for tp, cp in ((2, 1), (1, 2), (2, 2)):
        rows = [p for r in run_on_ranks(_on_ranks, tp, cp, world_size=tp * cp, timeout=1200) for p in r]
        problems = [p for p in rows if isinstance(p, str)]
        loss = max(p[1]["loss"] for p in rows if isinstance(p, tuple))
        grad = max(p[1]["grad"] for p in rows if isinstance(p, tuple))
        metric = max(p[1]["metrics"] for p in rows if isinstance(p, tuple))
        print(
            f"tp={tp} cp={cp}: {len(rows) - len(problems)} case-rank runs, max |loss err| {loss:.2e}, "
            f"max |metric err| {metric:.2e}, max |grad err| {grad:.2e}, problems {problems}"
        )
