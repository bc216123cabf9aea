"""Checkpoints: a run resumed from `run.save_every`'s checkpoint — in the warm start or in
the loss's steps, with a co-trained drafter too, with a longer warm start or more steps —
continues with the uninterrupted run's metrics and ends with its weights (fp32, eager:
bitwise), stating what changed; a file is written to a temporary name and renamed, so an
interrupted write leaves the previous one whole; `run.keep_last` deletes older checkpoints
once a newer one is in place; and every file a run cannot continue from — missing, empty,
truncated, garbage, foreign, corrupt, of another model / loss / drafter / schedule, or at
the run's end — is refused with a ValueError naming `run.resume`, the path and what is wrong."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch
from common import TINY_TASK

import compiled_loss.app.checkpoint as checkpoint
import compiled_loss.app.loop as loop
from compiled_loss.app import compose_config
from compiled_loss.app.checkpoint import load_checkpoint, save_checkpoint
from compiled_loss.app.loop import build_run, train
from compiled_loss.train.parallel import init_parallel

SMALL = [*TINY_TASK, "compile.enabled=false", "run.sft_steps=3", "run.steps=7", "run.save_every=2"]
TIMING = {"sample_seconds", "step_seconds", "tokens_per_s"}
MAY = (
    "a resume may change only compile.*, packing.*, parallel.*, run.micro_batches, logprob.chunk_size, "
    "logprob.fused_linear, run.deterministic, run.validate_inputs, run.log_every, run.loggers, run.save_every, "
    "run.keep_last, run.steps, run.sft_steps"
)


def _train(out, *overrides: str) -> list[dict]:
    train(compose_config(*SMALL, *overrides), out)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _build(*overrides: str) -> loop.Run:
    cfg = compose_config(*SMALL, *overrides)
    return build_run(cfg, init_parallel(cfg.parallel))


def _same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in TIMING} == {k: v for k, v in w.items() if k not in TIMING}, g[
            "step"
        ]


def _same_weights(got, want) -> None:
    for part in ("policy", "reference", "drafter"):
        for key, value in (want[part] or {}).items():
            assert torch.equal(got[part][key], value), (part, key)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted runs (7 steps, the first 3 the warm start; checkpoints at 2, 4, 6, 7), by drafter."""
    runs = {}

    def get(draft: str):
        if draft not in runs:
            out = tmp_path_factory.mktemp(f"whole_{draft}")
            runs[draft] = out, _train(out, f"draft={draft}")
        return runs[draft]

    return get


def _error(path, run) -> str:
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), run.training_state())
    return str(e.value)


@pytest.mark.parametrize("draft", ["none", "dflash"])
def test_a_resumed_run_continues_as_the_uninterrupted_one(draft, whole, tmp_path, caplog):
    out, metrics = whole(draft)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_2.pt",
        "step_4.pt",
        "step_6.pt",
        "step_7.pt",
    ]
    final = torch.load(out / "checkpoints" / "step_7.pt", weights_only=True)
    for at in (2, 4):  # in the warm start (the reference is still to be set), in the loss's steps
        path = out / "checkpoints" / f"step_{at}.pt"
        caplog.clear()
        caplog.set_level(logging.INFO)
        _same_metrics(_train(tmp_path / f"from{at}", f"draft={draft}", f"run.resume={path}"), metrics)
        assert caplog.messages[0] == (f"resuming at step {at} of 7 from run.resume={path}; the same config")
        _same_weights(torch.load(tmp_path / f"from{at}" / "checkpoints" / "step_7.pt", weights_only=True), final)


def test_a_resume_may_lengthen_the_warm_start_and_the_run_and_says_so(whole, tmp_path, caplog):
    """From step 2 of a 3-step warm start: a 4-step warm start in 9 steps continues as the
    uninterrupted run with those, bitwise; the logged line names both changes."""
    out, _ = whole("none")
    longer = ("run.sft_steps=4", "run.steps=9", "run.log_every=3")
    want = _train(tmp_path / "longer", *longer)
    path = out / "checkpoints" / "step_2.pt"
    caplog.clear()
    caplog.set_level(logging.INFO)
    got = _train(tmp_path / "resumed", *longer, f"run.resume={path}")
    assert caplog.messages[0] == (
        f"resuming at step 2 of 9 from run.resume={path}; changed since it was written: run.log_every 1 -> 3, "
        "run.sft_steps 3 -> 4, run.steps 7 -> 9"
    )
    _same_metrics(got, want)
    _same_weights(
        *(
            torch.load(d / "checkpoints" / "step_9.pt", weights_only=True)
            for d in (tmp_path / "resumed", tmp_path / "longer")
        )
    )


@pytest.mark.parametrize(
    ("overrides", "differs"),
    [
        (["loss=gspo"], "loss.name 'clipped_pg' -> 'gspo'"),
        (["draft=eagle3"], "draft.name 'none' -> 'eagle3'"),
        (["model.hidden_size=64", "model.num_heads=4"], "model.hidden_size 32 -> 64, model.num_heads 2 -> 4"),
        (["loss.reference_policy_kl_penalty=0.1"], "loss.reference_policy_kl_penalty 0.01 -> 0.1"),
        (["data.group_size=2", "run.seed=1"], "data.group_size 4 -> 2, run.seed 0 -> 1"),
        (["optim.lr=0.001", "run.steps=9"], "optim.lr 0.0005 -> 0.001"),
        (["logprob.temperature=0.5"], "logprob.temperature 1.0 -> 0.5"),
    ],
)
def test_a_config_the_checkpoint_cannot_continue_is_refused_naming_the_keys(overrides, differs, tmp_path):
    path = save_checkpoint(tmp_path, _build().training_state(), 2, [])
    assert _error(path, _build(*overrides)) == (
        f"run.resume={str(path)!r} was written by a run this config cannot continue: {differs} (checkpoint -> this "
        f"run); {MAY}"
    )


def test_a_refused_resume_stops_the_run_before_it_writes_anything(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoints", _build().training_state(), 2, [])
    with pytest.raises(
        ValueError,
        match=r"^run.resume='.*step_2.pt' was written by a run this config cannot "
        r"continue: model.num_layers 2 -> 1 \(checkpoint -> this run\)",
    ):
        _train(tmp_path / "resumed", "model.num_layers=1", f"run.resume={path}")
    assert not (tmp_path / "resumed").exists()


def test_layout_and_logging_changes_are_accepted_and_named(tmp_path):
    """Keys that change how the same steps are laid out, compiled, logged or saved; parallel
    sizes are compared on the config alone (a single process cannot build dp=2), and with
    DFlash, whose anchors are drawn per replica and micro-batch, dp and micro-batches must
    match."""
    path = save_checkpoint(tmp_path, _build().training_state(), 2, [])
    changed = (
        "packing=none",
        "packing.width=32",
        "compile.enabled=true",
        "compile.backend=aot_eager",
        "run.micro_batches=1",
        "run.keep_last=3",
        "run.validate_inputs=false",
        "run.deterministic=true",
        "logprob.chunk_size=16",
    )
    done, history, changes = load_checkpoint(str(path), _build(*changed).training_state())
    assert (done, history) == (2, [])
    assert changes == [
        "compile.backend 'inductor' -> 'aot_eager'",
        "compile.enabled False -> True",
        "logprob.chunk_size None -> 16",
        "packing.mode 'fused' -> 'none'",
        "packing.width 128 -> 32",
        "run.deterministic False -> True",
        "run.keep_last 0 -> 3",
        "run.micro_batches 2 -> 1",
        "run.validate_inputs True -> False",
    ]
    run = _build()
    run = dataclasses.replace(run, cfg=compose_config(*SMALL, "parallel.dp=2"))
    assert load_checkpoint(str(path), run.training_state())[2] == ["parallel.dp 1 -> 2"]
    dflash = save_checkpoint(tmp_path / "dflash", _build("draft=dflash").training_state(), 2, [])
    run = _build("draft=dflash")
    run = dataclasses.replace(run, cfg=compose_config(*SMALL, "draft=dflash", "parallel.dp=2", "run.micro_batches=1"))
    assert _error(dflash, run) == (
        f"run.resume={str(dflash)!r} was written by a run this config cannot continue: parallel.dp 1 -> 2, "
        "run.micro_batches 2 -> 1 (checkpoint -> this run); a resume may change only compile.*, packing.*, "
        "parallel.*, logprob.chunk_size, logprob.fused_linear, run.deterministic, run.validate_inputs, "
        "run.log_every, run.loggers, run.save_every, run.keep_last, run.steps, run.sft_steps"
    )


@pytest.mark.parametrize(
    ("written", "step", "overrides", "message"),
    [
        # past the warm start: a longer one would take the KL reference from the RL-trained policy
        (
            "run.sft_steps=3",
            5,
            ["run.sft_steps=4"],
            "is at step 5 of a run with a warm start of 3 steps; run.sft_steps=4 would change the phase of steps it has "
            "trained (and the KL reference taken at the warm start's end): resume with run.sft_steps=3",
        ),
        (
            "run.sft_steps=3",
            4,
            ["run.sft_steps=2"],
            "is at step 4 of a run with a warm start of 3 steps; run.sft_steps=2 would change the phase of steps it has "
            "trained (and the KL reference taken at the warm start's end): resume with run.sft_steps=3",
        ),
        # inside the warm start: a shorter one would make trained warm-start steps the loss's
        (
            "run.sft_steps=3",
            2,
            ["run.sft_steps=1", "run.steps=2"],
            "is at step 2 of a run with a warm start of 3 steps; run.sft_steps=1 would change the phase of steps it has "
            "trained (and the KL reference taken at the warm start's end): resume with run.sft_steps >= 2",
        ),
        (
            "run.sft_steps=3",
            7,
            [],
            "is at step 7; this run ends at run.steps=7: nothing to train — raise run.steps",
        ),
        (
            "run.sft_steps=3",
            6,
            ["run.steps=5"],
            "is at step 6; this run ends at run.steps=5: nothing to train — raise run.steps",
        ),
        (
            "run.sft_steps=0",
            3,
            ["run.sft_steps=0", "run.steps=3"],
            "is at step 3; this run ends at run.steps=3: nothing to train — raise run.steps",
        ),
    ],
)
def test_a_schedule_that_would_rewrite_trained_steps_or_train_nothing_is_refused(
    written, step, overrides, message, tmp_path
):
    path = save_checkpoint(tmp_path, _build(written).training_state(), step, [])
    assert _error(path, _build(*overrides)) == f"run.resume={str(path)!r} {message}"


def test_a_value_run_may_change_run_sft_steps_which_it_does_not_use(tmp_path):
    path = save_checkpoint(tmp_path, _build("loss=mse_value").training_state(), 2, [])
    assert load_checkpoint(str(path), _build("loss=mse_value", "run.sft_steps=0").training_state())[2] == [
        "run.sft_steps 3 -> 0"
    ]


def _foreign(tmp_path, state) -> str:
    path = tmp_path / "foreign.pt"
    torch.save(state, path)
    return str(path)


def _rewritten(tmp_path, edit, digest: bool = True) -> str:
    """A real checkpoint with `edit` applied to it, its digest recomputed (`digest`) or kept."""
    state = torch.load(save_checkpoint(tmp_path, _build().training_state(), 2, []), weights_only=True)
    edit(state)
    if digest:
        del state["digest"]
        state["digest"] = checkpoint._digest(state)
    return _foreign(tmp_path, state)


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "bad.pt"
    path.write_bytes(data)
    return str(path)


def _good_bytes(tmp_path) -> bytes:
    return save_checkpoint(tmp_path / "good", _build().training_state(), 2, []).read_bytes()


UNREADABLE = {
    "missing": (lambda t: str(t / "nothing.pt"), ": no such checkpoint file"),
    "empty": (lambda t: _write(t, b""), ": the file is empty"),
    "truncated": (
        lambda t: _write(t, _good_bytes(t)[:-100]),
        ": torch.load cannot read it (a truncated, corrupt or foreign file: RuntimeError)",
    ),
    "garbage": (
        lambda t: _write(t, bytes(range(256)) * 8),
        ": torch.load cannot read it (a truncated, corrupt or foreign file: RuntimeError)",
    ),
    "text": (
        lambda t: _write(t, b"step: 2\n"),
        ": torch.load cannot read it (a truncated, corrupt or foreign file: RuntimeError)",
    ),
    "a tensor": (
        lambda t: _foreign(t, torch.ones(3)),
        " holds a value of type Tensor, not a checkpoint of python -m compiled_loss.run",
    ),
    "a module's state_dict": (
        lambda t: _foreign(t, torch.nn.Linear(2, 2).state_dict()),
        " is not a checkpoint of python -m compiled_loss.run: it lacks the keys ['step', "
        "'warm_steps', 'config', 'policy', 'reference', 'drafter', 'optimizers', 'python_rng', "
        "'torch_rng', 'history', 'digest']",
    ),
    "no config": (
        lambda t: _rewritten(t, lambda s: [s.pop(k) for k in ("config", "warm_steps")]),
        " is not a checkpoint of python -m compiled_loss.run: it lacks the keys ['warm_steps', 'config']",
    ),
    "changed weights": (
        lambda t: _rewritten(t, lambda s: s["policy"]["head.weight"].add_(1), digest=False),
        ": its contents do not match the digest they were written with (a corrupt file)",
    ),
    "weights of other code": (
        lambda t: _rewritten(t, lambda s: s["policy"].update(extra=torch.ones(1))),
        ": its state does not fit this run's objects (Error(s) in loading state_dict for "
        'TinyLM:\n\tUnexpected key(s) in state_dict: "extra". )',
    ),
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_every_unreadable_checkpoint_is_refused_naming_run_resume_the_path_and_why(kind, tmp_path):
    make, why = UNREADABLE[kind]
    path = make(tmp_path)
    assert _error(path, _build()) == f"run.resume={path!r}{why}"


def test_an_interrupted_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """The file is written under a temporary name in the same directory, fsynced, renamed
    over the checkpoint's name, then the directory is fsynced; a write interrupted half way
    (here by KeyboardInterrupt) leaves the previous file as it was and no temporary file."""
    run = _build()
    before = save_checkpoint(tmp_path, run.training_state(), 2, []).read_bytes()
    events = []
    real_save, real_fsync, real_replace = torch.save, os.fsync, os.replace

    def half_save(state, f):
        real_save(state, f)
        f.seek(len(before) // 2)
        f.truncate()
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, run.training_state(), 2, [{"step": 1}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2.pt"]
    assert (tmp_path / "step_2.pt").read_bytes() == before
    monkeypatch.setattr(torch, "save", real_save)
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))) or real_fsync(fd),
    )
    monkeypatch.setattr(
        os,
        "replace",
        lambda a, b: events.append(("replace", os.path.basename(a), os.path.basename(b))) or real_replace(a, b),
    )
    save_checkpoint(tmp_path, run.training_state(), 4, [])
    (temporary,) = {e[1] for e in events[:2]}
    assert temporary.startswith(".step_4.pt.") and temporary.endswith(".tmp")
    assert events == [("fsync", temporary), ("replace", temporary, "step_4.pt"), ("fsync", tmp_path.name)]


def test_keep_last_deletes_older_checkpoints_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    present = []  # the files present as each checkpoint is written

    def recording(directory, state, step, history, write):
        present.append(sorted(p.name for p in directory.glob("step_*.pt")))
        return save_checkpoint(directory, state, step, history, write=write)

    monkeypatch.setattr(loop, "save_checkpoint", recording)
    _train(tmp_path, "run.sft_steps=1", "run.steps=4", "run.save_every=1", "run.keep_last=2")
    assert present == [[], ["step_1.pt"], ["step_1.pt", "step_2.pt"], ["step_2.pt", "step_3.pt"]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3.pt", "step_4.pt"]


def test_run_keep_last_is_validated_naming_the_key():
    with pytest.raises(ValueError) as e:
        compose_config("run.keep_last=-1")
    assert str(e.value) == "run.keep_last must be >= 0, got -1"
    assert compose_config().run.keep_last == 0  # keep every checkpoint
