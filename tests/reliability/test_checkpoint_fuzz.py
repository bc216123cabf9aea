"""The checkpoint surface under random damage and random configs: a checkpoint truncated at
a random byte, with random bytes flipped (anywhere, in its pickle, in its zip directory),
resumed under random config changes or a random schedule, either restores exactly the
state the intact file restores (so the run continues bitwise as it would have) or is
refused with a ValueError naming `run.resume` and the path — never a raw torch error,
never a silently different state.

Tiny model, eager, one trained checkpoint (a warm-start step and a loss step, both AdamW
states filled); configs are changed with `dataclasses.replace` (validated as Hydra's would
be) and each example only builds a run and loads, so the module takes seconds."""

from __future__ import annotations

import dataclasses
import re
import zipfile

import pytest
import torch
from common import TINY_TASK
from hypothesis import given
from hypothesis import strategies as st
from reliability.oracle import hyp

from compiled_loss.app import compose_config
from compiled_loss.app.checkpoint import load_checkpoint, save_checkpoint
from compiled_loss.app.loop import build_run, train
from compiled_loss.config import DRAFT_KINDS, LOSS_KINDS, PackingMode
from compiled_loss.train.parallel import init_parallel

SMALL = [*TINY_TASK, "compile.enabled=false", "run.sft_steps=1", "run.steps=3", "run.save_every=2"]
LOSS = {kind().name: kind for kind in LOSS_KINDS}
DRAFT = {kind().name: kind for kind in DRAFT_KINDS}
# (group, field or None for the whole option, value, whether a resume must refuse it)
CHANGES = [
    ("model", "hidden_size", 64, True),
    ("model", "num_layers", 1, True),
    ("model", "dtype", "bfloat16", True),
    ("loss", None, LOSS["dpo"](), True),
    ("loss", "reference_policy_kl_penalty", 0.1, True),
    ("draft", None, DRAFT["eagle3"](), True),
    ("data", "group_size", 2, True),
    ("data", "use_leave_one_out_baseline", True, True),
    ("optim", "lr", 1e-3, True),
    ("run", "seed", 1, True),
    ("logprob", "temperature", 0.5, True),
    ("packing", "mode", PackingMode.per_sequence, False),
    ("compile", "backend", "aot_eager", False),
    ("logprob", "chunk_size", 8, False),
    ("run", "micro_batches", 1, False),
    ("run", "log_every", 3, False),
    ("run", "save_every", 0, False),
    ("run", "keep_last", 1, False),
    ("run", "validate_inputs", False, False),
    ("run", "deterministic", True, False),
    ("run", "steps", 5, False),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The base config and its checkpoint at step 2 (after the warm start's step and one loss step)."""
    cfg = compose_config(*SMALL)
    out = tmp_path_factory.mktemp("trained")
    train(cfg, out)
    return cfg, out / "checkpoints" / "step_2.pt"


def _restored(path, cfg) -> tuple[dict, list[str]]:
    """The state a run of `cfg` holds after loading `path`, and the changes it names."""
    run = build_run(cfg, init_parallel(cfg.parallel))
    step, history, changes = load_checkpoint(str(path), run.training_state())
    state = {
        "step": step,
        "history": history,
        "policy": run.policy.state_dict(),
        "reference": run.reference.state_dict(),
        "optimizers": [o.state_dict() for o in run.optimizers],
        "python_rng": run.rollouts.rng.getstate(),
        "torch_rng": torch.get_rng_state(),
    }
    return state, changes


def _assert_same_state(got: dict, want: dict) -> None:
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _refusal(path, cfg) -> str | None:
    """The message of the ValueError a resume of `path` under `cfg` raises (None: it loads)."""
    try:
        _restored(path, cfg)
    except ValueError as e:
        assert str(e).startswith(f"run.resume={str(path)!r}"), e
        return str(e)
    return None


def _damaged(tmp_path_factory, data: bytes):
    path = tmp_path_factory.getbasetemp() / "damaged.pt"
    path.write_bytes(data)
    return path


def test_a_truncated_checkpoint_is_refused(trained, tmp_path_factory):
    cfg, good = trained
    intact = good.read_bytes()

    @hyp(15)
    @given(st.floats(0, 1, exclude_max=True))
    def run(fraction):
        path = _damaged(tmp_path_factory, intact[: int(fraction * len(intact))])
        # which exception the unpickler raises (RuntimeError, OSError, EOFError ...) depends on
        # where the cut falls; the refusal names it, the test only needs it named
        message = _refusal(path, cfg)
        assert message == f"run.resume={str(path)!r}: the file is empty" or re.fullmatch(
            re.escape(f"run.resume={str(path)!r}: torch.load cannot read it (a truncated, corrupt or foreign file: ")
            + r"\w+\)",
            message or "",
        ), message

    run()


def test_flipped_bytes_restore_the_intact_state_or_are_refused(trained, tmp_path_factory):
    cfg, good = trained
    intact = good.read_bytes()
    want, _ = _restored(good, cfg)
    with zipfile.ZipFile(good) as z:  # the pickle is the archive's first record
        pickle_end = sorted(i.header_offset for i in z.infolist())[1]
    regions = {"anywhere": (0, len(intact)), "pickle": (0, pickle_end), "directory": (len(intact) - 4096, len(intact))}
    outcomes = []

    @hyp(40)
    @given(st.data())
    def run(data):
        start, end = regions[data.draw(st.sampled_from(list(regions)))]
        damaged = bytearray(intact)
        for _ in range(data.draw(st.integers(1, 3))):
            damaged[data.draw(st.integers(start, end - 1))] ^= data.draw(st.integers(1, 255))
        path = _damaged(tmp_path_factory, bytes(damaged))
        message = _refusal(path, cfg)
        outcomes.append(message is None)
        if message is None:  # the flips touched nothing it reads (zip bookkeeping, an unused pickle memo)
            _assert_same_state(_restored(path, cfg)[0], want)

    run()
    assert 0 < sum(outcomes) < len(outcomes)  # both outcomes were exercised


@st.composite
def config_changes(draw):
    """1–3 changes, at most one per loss / draft option and one per other key."""
    return draw(
        st.lists(
            st.sampled_from(CHANGES),
            min_size=1,
            max_size=3,
            unique_by=lambda c: c[0] if c[0] in ("loss", "draft") else c[:2],
        )
    )


def _changed(cfg, changes):
    for group, field, value, _ in changes:
        option = value if field is None else dataclasses.replace(getattr(cfg, group), **{field: value})
        cfg = dataclasses.replace(cfg, **{group: option})
    return cfg


def test_random_config_changes_restore_the_intact_state_or_are_refused_naming_each_key(trained):
    cfg, good = trained
    want, _ = _restored(good, cfg)

    @hyp(60)
    @given(config_changes())
    def run(changes):
        keys = {f"{group}.{field or 'name'}": refused for group, field, _, refused in changes}
        message = _refusal(good, _changed(cfg, changes))
        if any(keys.values()):
            prefix = f"run.resume={str(good)!r} was written by a run this config cannot continue: "
            assert message.startswith(prefix), message
            named = message[len(prefix) :].split(" (checkpoint -> this run)")[0].split(", ")
            assert [item.split(" ")[0] for item in named] == sorted(k for k, refused in keys.items() if refused)
        else:
            got, named = _restored(good, _changed(cfg, changes))
            assert [item.split(" ")[0] for item in named] == sorted(keys)
            _assert_same_state(got, want)

    run()


def test_a_random_schedule_resumes_or_is_refused_when_it_rewrites_trained_steps_or_trains_nothing(
    trained, tmp_path_factory
):
    """A checkpoint at step `done` of a run with a `warm`-step warm start, resumed with
    `sft_steps` and `steps`: refused exactly when a step it trained would change phase (warm
    start or loss) or when nothing is left to train."""
    cfg, _ = trained
    path = tmp_path_factory.getbasetemp() / "schedule" / "step.pt"

    def schedule(sft_steps, steps):  # (saving off: run.save_every may not exceed the steps)
        return dataclasses.replace(
            cfg, run=dataclasses.replace(cfg.run, sft_steps=sft_steps, steps=steps, save_every=0)
        )

    @hyp(30)
    @given(st.integers(0, 3), st.integers(1, 7), st.integers(0, 3), st.integers(1, 7))
    def run(warm, done, sft_steps, steps):
        written = save_checkpoint(
            path.parent, build_run(schedule(warm, 2), init_parallel(cfg.parallel)).training_state(), done, []
        )
        message = _refusal(written, schedule(sft_steps, steps))
        rewrites = any((j <= warm) != (j <= sft_steps) for j in range(1, done + 1))
        if rewrites:
            assert message.startswith(
                f"run.resume={str(written)!r} is at step {done} of a run with a warm start of "
                f"{warm} steps; run.sft_steps={sft_steps} would change the phase"
            ), message
        elif done >= steps:
            assert message.startswith(
                f"run.resume={str(written)!r} is at step {done}; this run ends at run.steps={steps}"
            ), message
        else:
            assert message is None
        written.unlink()

    run()
