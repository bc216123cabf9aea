"""DTensor inputs at the library's edge (`compiled_loss.vocab.shards`) on 2 gloo ranks, beyond the
wrappers' parity table (`test_parity.py`, which feeds every wrapper NeMo-RL-shaped DTensor
logits):

- uneven vocabulary shards (V = 7 over 2 ranks, torch's chunking: 4 and 3 ids) into the seed
  functions, a packing wrapper and the draft map, and `Replicate()` logits: the loss, every
  metric and the logits' gradient (gathered with `full_tensor`) equal one process on the full
  logits;
- `LinearLogits` whose LM head is a DTensor sharded on its rows (even and uneven): the loss
  and the gradients of the hidden states, the weight and the bias;
- refused with the same ValueError on every rank: a `Partial` placement, a two-dimensional mesh
  of unknown dimension names, a vocabulary group that is not the mesh's;
- a compiled wrapper called with each step's DTensor logits unwrapped at the edge compiles once.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import CASE_BY_NAME, boundaries, globals_for, make_batch
from ranks import run_on_ranks
from tolerances import close
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from compiled_loss.loss_input import get_next_token_logprobs_from_logits, prepare_loss_input
from compiled_loss.parallel import ParallelGroups
from compiled_loss.train import CompileRecorder
from compiled_loss.utils import map_teacher_logits_to_draft_vocab
from compiled_loss.vocab import LinearLogits
from compiled_loss.vocab.shards import local_logits
from compiled_loss.wrapper import SequencePackingFusionLossWrapper, wrap_loss_fn_with_input_preparation

pytestmark = pytest.mark.slow  # spawns gloo ranks

LENGTHS, PADS, WIDTH = [6, 3, 8, 2], [2, 1, 0, 2], 8
TOL = close(torch.float32, "parallel")
UNEVEN = 7  # the vocabulary of the uneven cases: 4 + 3 ids


def _grpo_batch(vocab: int):
    case = CASE_BY_NAME["grpo"]
    data, logits = make_batch(case, LENGTHS, WIDTH, seed=21)
    data = {**data, "input_ids": data["input_ids"] % vocab}
    logits = torch.randn(*logits.shape[:-1], vocab, generator=torch.Generator().manual_seed(22))
    return case, data, logits


def _check(got, want, grad, want_grad, label):
    (loss, metrics), (want_loss, want_metrics) = got, want
    torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{label} loss: {m}")
    for key in want_metrics:
        torch.testing.assert_close(
            metrics[key].float(), want_metrics[key].float(), **TOL, msg=lambda m: f"{label} {key}"
        )
    torch.testing.assert_close(grad, want_grad, **close(torch.float32, "parallel"), msg=lambda m: f"{label} grad: {m}")


def _uneven_and_replicated(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    case, data, full = _grpo_batch(UNEVEN)
    gs, gt = globals_for(data)
    cu, cup = boundaries(LENGTHS, PADS)
    checked = []
    entries = {
        "wrap_loss_fn_with_input_preparation": lambda logits: wrap_loss_fn_with_input_preparation(
            logits, data, gs, gt, loss_fn=case.make_loss(), prepare_fn=case.prepare(False)
        ),
        "prepare_loss_input": lambda logits: (
            prepare_loss_input(logits, data, case.make_loss())[0]["next_token_logprobs"].sum(),
            {},
        ),
        "get_next_token_logprobs_from_logits": lambda logits: (
            get_next_token_logprobs_from_logits(data["input_ids"], logits).sum(),
            {},
        ),
    }
    for name, entry in entries.items():
        for placement in (Shard(2), Replicate()):
            leaf = full.clone().requires_grad_()
            want = entry(leaf)
            (want_grad,) = torch.autograd.grad(want[0], leaf)
            logits = distribute_tensor(full, mesh, [placement]).requires_grad_()
            got = entry(logits)
            (grad,) = torch.autograd.grad(got[0], logits)
            assert grad.placements == (placement,), (name, grad.placements)
            _check(got, want, grad.full_tensor(), want_grad, f"{name} {placement}")
            checked.append(f"{name} {placement}")
    # the teacher mapped to the draft vocabulary: this rank's half of the 6 draft ids
    d2t = torch.tensor([0, 1, 1, 1, 1, 1])  # target ids 0, 2, 3, 4, 5, 6
    mapped = map_teacher_logits_to_draft_vocab(distribute_tensor(full, mesh, [Shard(2)]), d2t)
    want = map_teacher_logits_to_draft_vocab(full, d2t)[..., 3 * rank : 3 * rank + 3]
    torch.testing.assert_close(mapped, want, **close(torch.float32, "exact"))
    # packed, through a wrapper given no group: the [1, T, V] packed logits sharded unevenly
    packed = torch.randn(1, cup[-1], UNEVEN, generator=torch.Generator().manual_seed(23))
    wrapper = SequencePackingFusionLossWrapper(case.make_loss(), case.prepare(True), cu, cup)
    leaf = packed.clone().requires_grad_()
    want = wrapper(leaf, data, gs, gt)
    (want_grad,) = torch.autograd.grad(want[0], leaf)
    logits = distribute_tensor(packed, mesh, [Shard(2)]).requires_grad_()
    got = wrapper(logits, data, gs, gt)
    (grad,) = torch.autograd.grad(got[0], logits)
    _check(got, want, grad.full_tensor(), want_grad, "fused wrapper")
    # an id of the padding (7, beyond V = 7) is refused as on full logits
    bad = {**data, "input_ids": data["input_ids"].clone().index_fill_(1, torch.tensor([1]), UNEVEN)}
    try:
        prepare_loss_input(distribute_tensor(full, mesh, [Shard(2)]), bad, case.make_loss())
    except ValueError as e:
        assert "must hold token ids in [0, 7) (the vocabulary), got 7" in str(e), e
    else:
        raise AssertionError("an id beyond the vocabulary was accepted")
    return checked + ["map_teacher_logits_to_draft_vocab", "fused wrapper"]


def test_uneven_and_replicated_logits_equal_one_process():
    results = run_on_ranks(_uneven_and_replicated, world_size=2, timeout=300)
    assert all(isinstance(r, list) for r in results), results
    assert len(results[0]) == 8  # 3 entries × (uneven shards, Replicate()), the draft map, the wrapper


def _linear_head(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    checked = []
    for vocab, with_bias in ((8, False), (8, True), (UNEVEN, True), (UNEVEN, False)):
        case, data, _ = _grpo_batch(vocab)
        gs, gt = globals_for(data)
        g = torch.Generator().manual_seed(24)
        hidden = torch.randn(len(LENGTHS), WIDTH, 6, generator=g)
        weight, bias = torch.randn(vocab, 6, generator=g), torch.randn(vocab, generator=g) if with_bias else None
        call = functools.partial(
            wrap_loss_fn_with_input_preparation, data=data, global_valid_seqs=gs, global_valid_toks=gt,
            loss_fn=case.make_loss(), prepare_fn=case.prepare(False),
        )  # fmt: skip
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        leaves += [bias.clone().requires_grad_()] if with_bias else []
        want = call(LinearLogits(*leaves))
        want_grads = torch.autograd.grad(want[0], leaves)
        sharded = [hidden.clone().requires_grad_(), distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()]
        sharded += [distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()] if with_bias else []
        got = call(LinearLogits(*sharded))
        grads = torch.autograd.grad(got[0], sharded)
        label = f"V={vocab} bias={with_bias}"
        _check(got, want, grads[0], want_grads[0], f"{label} hidden")
        for name, a, b in zip(("weight", "bias"), grads[1:], want_grads[1:]):
            torch.testing.assert_close(
                a.full_tensor(), b, **close(torch.float32, "parallel"), msg=lambda m, n=name: f"{label} {n}"
            )
        checked.append(label)
    return checked


def test_linear_logits_with_a_sharded_head_equal_one_process():
    results = run_on_ranks(_linear_head, world_size=2, timeout=300)
    assert all(isinstance(r, list) and len(r) == 4 for r in results), results


def _refusals(rank: int, world: int) -> list[str]:
    messages = []
    local = torch.randn(2, 4, 3)
    one = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    two = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for logits, groups in (
        (DTensor.from_local(local, one, [Partial()]), ParallelGroups()),
        (DTensor.from_local(local, two, [Replicate(), Shard(2)]), ParallelGroups()),
        (DTensor.from_local(local, one, [Shard(2)]), ParallelGroups(tp=torch.distributed.new_group([0]))),
        (DTensor.from_local(local, other, [Shard(2)]), ParallelGroups(tp=one.get_group())),
    ):
        try:
            local_logits(logits, groups, "entry")
            messages.append("accepted")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_dtensors_are_refused_alike_on_every_rank():
    results = run_on_ranks(_refusals, world_size=2, timeout=120)
    assert results[0] == results[1]
    partial, names, group, same_ranks = results[0]
    assert partial.startswith("entry: logits's placement P(sum) on mesh dimension 'tp': only Shard(2)")
    assert names == (
        "entry: a DTensor logits must be on a one-dimensional mesh or one with dimensions named 'cp' and 'tp', got a "
        "mesh of dimensions ('dp', 'tp') (shape (1, 2))"
    )
    assert group == "entry: vocab_parallel_group must be None or the DTensor's 'tp' mesh group"
    assert same_ranks == "accepted"  # another mesh over the same ranks is the same group


def _compiled_once(rank: int, world: int) -> tuple[int, list[str]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    case, data, _ = _grpo_batch(8)
    gs, gt = globals_for(data)
    cu, cup = boundaries(LENGTHS, PADS)
    wrapper = SequencePackingFusionLossWrapper(
        case.make_loss(), case.prepare(True), cu, cup, vocab_parallel_group=mesh.get_group()
    )
    recorder = CompileRecorder("aot_eager")
    compiled = recorder.compile(lambda logits: wrapper(logits, data, gs, gt)[0], fullgraph=True)
    for seed in range(3):  # a new DTensor each step, unwrapped on the host before the compiled call
        packed = torch.randn(1, cup[-1], 8, generator=torch.Generator().manual_seed(seed))
        local, groups = local_logits(distribute_tensor(packed, mesh, [Shard(2)]), ParallelGroups(), "step")
        assert groups.tp is mesh.get_group()
        compiled(local.detach().requires_grad_()).backward()
    return recorder.report.compiles, recorder.report.problems()


def test_a_compiled_wrapper_over_unwrapped_dtensors_compiles_once():
    assert run_on_ranks(_compiled_once, world_size=2, timeout=300) == [(1, [])] * 2
