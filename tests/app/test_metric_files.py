"""Metric files hold JSON: a non-finite metric (NaN, ±inf — e.g. EAGLE-3's 0/0 accuracy of
a TTT step no token reaches) is written as null in `metrics.jsonl` and `summary.json`, the
first time per key with a logged warning that names the key and the step; the summary the
run returns is the one it wrote."""

from __future__ import annotations

import json
import logging
import math

from common import TINY_TASK

import compiled_loss.app.loop as loop
from compiled_loss.app import compose_config
from compiled_loss.app.loop import train

SMALL = [*TINY_TASK, "compile.enabled=false", "run.sft_steps=1", "run.steps=3"]


def _strict(text: str):
    """json.loads that refuses NaN / Infinity (which Python's json accepts, but JSON does not have)."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_null_and_reported_once_per_key(tmp_path, monkeypatch, caplog):
    batch = loop.Run.batch

    def hostile(self, i, reward_shift=None):  # the loss's steps 2 and 3 report non-finite statistics
        data, stats = batch(self, i, reward_shift)
        bad = {2: {"entropy": math.nan, "reward": math.inf}, 3: {"entropy": -math.inf}}.get(i, {})
        return data, {**stats, **bad}

    monkeypatch.setattr(loop.Run, "batch", hostile)
    returned = train(compose_config(*SMALL), tmp_path)
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["entropy"] is None for r in records] == [False, True, True]
    assert [r["reward"] is None for r in records] == [False, True, False]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    summary = _strict((tmp_path / "summary.json").read_text())
    assert (summary["first_reward"], summary["final_reward"]) == (None, None)  # means over steps with inf
    assert math.isfinite(summary["warm_start_reward"])
    assert returned == summary
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "metrics.jsonl step 2: reward is inf, written as null (later non-finite reward values are not reported)",
        "metrics.jsonl step 2: entropy is nan, written as null (later non-finite entropy values are not reported)",
        "summary.json: first_reward is inf, written as null (later non-finite first_reward values are not reported)",
        "summary.json: final_reward is inf, written as null (later non-finite final_reward values are not reported)",
    ]
