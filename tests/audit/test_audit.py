"""The audit tool finds what fullgraph=True and Dynamo's counters hide, and gates on it; every
problem it reports names the whole path, the line and the source line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import audit_targets
import pytest

from compiled_loss.audit.cli import (
    DEFAULT_BATCHES,
    DEFAULT_STEPS,
    DRAFTS,
    DTYPES,
    FULL_BATCHES,
    FULL_STEPS,
    HEADS,
    LOSSES,
    METRICS,
    PACKINGS,
    Configuration,
    Drive,
    configurations,
    main,
    summary,
)
from compiled_loss.train.recorder import CompileReport, GraphRecord


def run(tmp_path, *argv):
    code = main([*argv, "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "audit.json").read_text())


def where(text: str) -> str:
    """`path:line `source`` of the line of tests/audit_targets.py that holds `text`."""
    lines = Path(audit_targets.__file__).read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if text in line)
    return f"{audit_targets.__file__}:{number} `{lines[number - 1].strip()}`"


def test_planted_item_sync_fails_at_its_line(tmp_path):
    code, rows = run(
        tmp_path, "--target", "audit_targets:with_item", "--inputs", "audit_targets:eight_floats", "backend=eager"
    )
    assert code == 1
    assert rows[0]["graph_breaks"] == [] and rows[0]["syncs"]  # no break counted, yet a sync
    sync = where("n = int((x > 0).sum().item())")
    assert any(f"item at {sync}" in s for s in rows[0]["syncs"])
    assert any("host sync" in f and f"item at {sync}" in f for f in rows[0]["failures"])


def test_planted_recompile_on_a_seen_bucket_fails(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:per_value",
        "--inputs",
        "audit_targets:same_shape_new_ints",
        "backend=eager",
    )
    assert code == 1
    assert rows[0]["buckets"] == 1 and rows[0]["compiles"] > 1
    assert rows[0]["recompiles"] and "scale" in rows[0]["recompiles"][0]
    assert any(f.startswith("recompile ") and where("return x * scale") in f for f in rows[0]["failures"])


def test_recompile_reason_names_the_whole_guard_at_its_line(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:per_nested_value",
        "--inputs",
        "audit_targets:same_shape_new_nested_ints",
        "backend=eager",
    )
    guard = f"options['{audit_targets.SECTION}']['{audit_targets.KEY}'] == 2"
    assert code == 1 and len(guard) > 100
    assert any(f"{guard} at {where('return x * options[SECTION][KEY]')}" in r for r in rows[0]["recompiles"])
    assert guard in (tmp_path / "audit.md").read_text()


def test_planted_graph_break_is_reported_with_its_line(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:with_item",
        "--inputs",
        "audit_targets:eight_floats",
        "backend=eager",
        "--no-fullgraph",
    )
    assert code == 1
    assert any(b.startswith(where("n = int((x > 0).sum().item())")) for b in rows[0]["graph_breaks"])


def test_frame_that_fell_back_to_eager_is_reported_at_its_lines(tmp_path):
    code, rows = run(
        tmp_path,
        "--target",
        "audit_targets:breaks_in_a_loop",
        "--inputs",
        "audit_targets:eight_floats",
        "backend=eager",
        "--no-fullgraph",
    )
    frame, stop = where("def breaks_in_a_loop(x):"), where("torch._dynamo.graph_break()  # a break inside a loop")
    assert code == 1 and rows[0]["eager_fallbacks"][0].startswith(f"breaks_in_a_loop at {frame} @ {stop}: ")
    assert any(f"frame breaks_in_a_loop at {frame} fell back to eager" in f for f in rows[0]["failures"])


@pytest.mark.parametrize(
    "target, line",
    [
        ("branches_on_data", "if x.sum() > 0:"),  # Dynamo raises Unsupported
        ("branches_on_item", "if x.sum().item() > 0:"),  # Dynamo raises UserError
    ],
)
def test_break_under_fullgraph_is_a_fail_row(tmp_path, capsys, target, line):
    code, rows = run(
        tmp_path, "--target", f"audit_targets:{target}", "--inputs", "audit_targets:eight_floats", "backend=eager"
    )
    printed = capsys.readouterr()
    assert code == 1 and "Traceback" not in printed.out + printed.err
    assert where(line) in rows[0]["error"] and rows[0]["error"] in rows[0]["failures"]
    assert where(line) in (tmp_path / "audit.md").read_text()
    assert f"{target} " in printed.out and "FAIL" in printed.out and "0/1 configurations clean" in printed.out


@pytest.mark.parametrize(
    "target, inputs, line, guards",
    [
        (
            "per_count",  # a Python int that changes every call
            "twelve_counts",
            "for _ in range(count):",
            [f"0/{n - 1}: count == {n}" for n in range(1, 9)],
        ),
        (
            "per_length",  # a shape that changes every call
            "twelve_lengths",
            "def per_length(x):",
            [f"0/{n - 1}: tensor 'x' size mismatch at index 0. expected {n}, actual {n + 1}" for n in range(1, 9)],
        ),
    ],
)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "no-fullgraph"])
def test_a_target_that_recompiles_every_call_is_a_fail_row_naming_its_recompiles(
    tmp_path, capsys, target, inputs, line, guards, fullgraph
):
    code, rows = run(
        tmp_path,
        "--target",
        f"audit_targets:{target}",
        "--inputs",
        f"audit_targets:{inputs}",
        "backend=eager",
        *([] if fullgraph else ["--no-fullgraph"]),
    )
    printed = capsys.readouterr()
    assert code == 1 and "Traceback" not in printed.out + printed.err
    assert f"audit_targets:{target} " in printed.out and "FAIL" in printed.out
    assert "0/1 configurations clean" in printed.out
    (row,) = rows
    frame = f"{target} at {where(f'def {target}(')}"
    if fullgraph:  # the ninth call raised: the drive's error, then every recompile with its guard
        assert row["calls"] == 9 and row["compiles"] == 8
        assert row["error"] == (
            f"recompile limit hit: call 9 failed the guards of all 8 graphs of {frame} "
            "(torch._dynamo.config.recompile_limit=8; fullgraph=True raises FailOnRecompileLimitHit there, without "
            "it the calls past the limit run eager)"
        )
        assert row["error"] in row["failures"] and row["error"] in printed.out
    else:  # the calls past the limit ran eager
        assert row["calls"] == 12 and row["compiles"] == 8 and row["error"] is None
        assert any("fell back to eager (Unsupported)" in f and "recompile limit" in f for f in row["failures"])
    recompiles = [f for f in row["failures"] if f.startswith("recompile 0/")]
    assert len(recompiles) == len(guards) == 8  # compiles 0/1 … 0/8, each with the guard of the one before
    for n, (recompile, guard) in enumerate(zip(recompiles, guards), 1):
        assert recompile.startswith(f"recompile 0/{n} of ") and f": {guard} " in recompile, recompile
        assert recompile in printed.out
    assert recompiles[0].startswith(f"recompile 0/1 of {frame}: ") and recompiles[0].endswith(f" at {where(line)}")


def test_target_in_the_current_directory_is_importable(tmp_path, monkeypatch):
    (tmp_path / "audit_cwd_target.py").write_text(
        "import torch\n\n\ndef double(x):\n    return 2 * x\n\n\ndef samples():\n    return [((torch.ones(4),), {})]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    try:
        code, rows = run(
            tmp_path / "out",
            "--target",
            "audit_cwd_target:double",
            "--inputs",
            "audit_cwd_target:samples",
            "backend=eager",
        )
    finally:
        sys.modules.pop("audit_cwd_target", None)
    assert code == 0 and rows[0]["failures"] == []


@pytest.mark.slow
def test_console_script_in_a_project_directory(tmp_path):
    """`compiled-loss-audit --target` as a user runs it: the module in the current directory
    (no PYTHONPATH), a graph break under fullgraph a FAIL row, exit status 1, no traceback."""
    (tmp_path / "my_losses.py").write_text(
        "import torch\n\n\ndef loss(x):\n    print(x)\n    return x.sum()\n\n\n"
        "def samples():\n    return [((torch.ones(4),), {})]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "compiled-loss-audit"), "--target", "my_losses:loss"]
        + ["--inputs", "my_losses:samples", "backend=eager", "--out", "report"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{tmp_path / 'my_losses.py'}:5 `print(x)`" in proc.stdout
    assert f"{tmp_path / 'my_losses.py'}:5 `print(x)`" in (tmp_path / "report" / "audit.md").read_text()


def test_clean_target_passes(tmp_path):
    code, rows = run(
        tmp_path, "--target", "audit_targets:clean", "--inputs", "audit_targets:masked_samples", "backend=eager"
    )
    assert code == 0 and rows[0]["failures"] == [] and rows[0]["buckets"] == 2


def test_count_is_of_configurations():
    """A configuration's drives (its wrapper, its step) count once: clean when all are."""

    def drive(name: str, configuration: str, sync: bool = False) -> Drive:
        graph = GraphRecord("0/0", 3, None, None, ["item at f.py:1 `x.item()`"] if sync else [])
        return Drive(name, configuration, CompileReport(name, graphs=[graph]))

    drives = [drive("a wrapper", "a"), drive("a step", "a"), drive("b wrapper", "b"), drive("b step", "b", sync=True)]
    assert summary(drives) == "1/2 configurations clean"
    assert summary(drives[:2]) == "1/1 configurations clean"


@pytest.mark.slow
def test_project_matrix_passes(tmp_path, capsys):
    code, rows = run(
        tmp_path,
        "loss=clipped_pg,distillation",
        "packing=per_sequence,fused",
        "draft=none",
        "dtype=bf16",
        "batches=6",
        "steps=2",
        "backend=eager",
    )
    assert code == 0
    assert len(rows) == 8 and all(r["failures"] == [] and r["compiles"] >= 1 for r in rows)
    assert "| configuration |" in (tmp_path / "audit.md").read_text()
    assert "4/4 configurations clean" in capsys.readouterr().out


def test_default_run_covers_every_choice_once_or_more():
    configs, batches, steps = configurations({}, full=False)
    assert len(configs) == len(LOSSES) and (batches, steps) == (DEFAULT_BATCHES, DEFAULT_STEPS)
    for field, every in [
        ("loss", LOSSES),
        ("packing", PACKINGS),
        ("draft", DRAFTS),
        ("dtype", DTYPES),
        ("head", HEADS),
        ("metrics", METRICS),
        ("backend", ("aot_eager",)),
    ]:
        assert {getattr(c, field) for c in configs} == set(every), field


def test_every_loss_of_the_runner_is_audited():
    aliases = {"grpo", "dapo"}  # ClippedPG under other defaults: the graphs of clipped_pg
    options = {p.name.removesuffix(".yaml") for p in (files("compiled_loss.conf") / "loss").iterdir()}
    assert options - aliases == set(LOSSES)


def test_full_run_is_the_matrix():
    full, batches, steps = configurations({}, full=True)
    value_with_draft = len(PACKINGS) * (len(DRAFTS) - 1) * len(DTYPES)  # refused: a value head has no drafter
    assert len(full) == len(LOSSES) * len(PACKINGS) * len(DRAFTS) * len(DTYPES) - value_with_draft
    assert (batches, steps) == (FULL_BATCHES, FULL_STEPS)
    assert all(c.draft == "none" for c in full if c.loss == "mse_value")
    chosen, _, _ = configurations({"loss": ["dpo"], "backend": ["eager"]}, full=False)
    assert chosen == [Configuration("dpo", p, r, d, "eager") for p in PACKINGS for r in DRAFTS for d in DTYPES]
    linear, _, _ = configurations({"head": ["linear"], "metrics": ["minimal"]}, full=False)
    assert linear and all(c.head == "linear" and c.draft == "none" for c in linear)
    assert all((c.metrics == "minimal") == (c.loss in ("clipped_pg", "gspo", "cispo")) for c in linear)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["batches=many"], "batches=many: batches takes a whole number >= 1"),
        (["steps=0"], "steps=0: steps takes a whole number >= 1"),
        (["backend=fast"], "backend=fast: not a torch.compile backend"),
        (["backend=eager,inductor"], "backend=eager,inductor: backend takes one value"),
        (["head=logits,linear"], "head=logits,linear: head takes one value"),
        (["loss=grpo2"], "loss=grpo2: not a valid choice"),
        (["size=2"], "bad override 'size=2'"),
        (["--target", "nowhere_module:fn", "--inputs", "nowhere_module:samples"], "--target nowhere_module:fn: no"),
        (["--target", "audit_targets:missing", "--inputs", "audit_targets:eight_floats"], "no attribute 'missing'"),
        (["--target", "audit_targets", "--inputs", "audit_targets:eight_floats"], "--target audit_targets: expected"),
    ],
)
def test_bad_arguments_are_named(tmp_path, argv, message):
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--out", str(tmp_path)])
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--target", "audit_targets:clean"],  # no --inputs
        ["--inputs", "audit_targets:eight_floats"],  # no --target
        ["--target", "audit_targets:clean", "--inputs", "audit_targets:masked_samples", "loss=dpo"],
    ],
)
def test_target_options_go_together(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--out", str(tmp_path)])
    assert raised.value.code == 2 and "--target" in capsys.readouterr().err


@pytest.mark.slow
def test_distributed_mode_reports_every_rank(tmp_path):
    """`torchrun … compiled_loss.audit.cli tp=2`: every rank's training step (the compiled loss and
    the decoder layers, compiled one by one inside their FSDP2 units), with and without a co-trained drafter."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free rendezvous port (parallel test workers)
            "--nproc-per-node=2",
            "-m",
            "compiled_loss.audit.cli",
            "tp=2",
            "loss=clipped_pg",
            "packing=fused",
            "dtype=fp32",
            "steps=2",
            "backend=eager",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "audit.json").read_text())
    drafts = [r["name"].split(" ")[2].split("/")[2] for r in rows]
    assert [r["name"].split(" ")[:2] for r in rows] == [["rank", "0"]] * 6 + [["rank", "1"]] * 6
    assert drafts == ["none", "none", "eagle3", "eagle3", "dflash", "dflash"] * 2
    assert all(r["failures"] == [] and 1 <= r["compiles"] <= r["buckets"] for r in rows)
    assert "3/3 configurations clean" in proc.stdout
