"""A Hydra sweep (`python -m compiled_loss.run -m ...`) runs its jobs one after the other in
one process: every job finishes, although each compiles its own variants of the same
functions (without a Dynamo reset between jobs they add up to the recompile limit, and the
third job fails with `FailOnRecompileLimitHit` under fullgraph=True)."""

from __future__ import annotations

import json
import sys

import pytest
from common import SMALL_RUN

from compiled_loss.app.run import main

pytestmark = pytest.mark.slow  # a Hydra multirun of several jobs

SMALL = [*SMALL_RUN, "run.micro_batches=2", "compile.backend=eager", "run.steps=2", "run.sft_steps=1"]


def test_every_job_of_a_sweep_in_one_process_finishes(tmp_path, monkeypatch):
    """A sweep of four jobs (loss=clipped_pg,nll × packing=none,fused) at the test size, compiled
    by Dynamo with the eager backend (the recompile limit is Dynamo's, whatever the backend)."""
    monkeypatch.setattr(
        sys,
        "argv",
        ["compiled_loss.run", "-m", *SMALL, "loss=clipped_pg,nll", "packing=none,fused", f"hydra.sweep.dir={tmp_path}"],
    )
    main()
    summaries = [json.loads((tmp_path / str(job) / "summary.json").read_text()) for job in range(4)]
    assert [(s["loss"], s["packing"], s["steps"], s["compile"]) for s in summaries] == [
        ("clipped_pg", "none", 2, "eager"),
        ("clipped_pg", "fused", 2, "eager"),
        ("nll", "none", 2, "eager"),
        ("nll", "fused", 2, "eager"),
    ]
    assert all(s["compile_problems"] == [] for s in summaries)
