"""The training step compiles once per shape bucket for as many buckets as its grid can
produce: Dynamo's recompile limit (8 per function) is raised to `compile.max_buckets`, the
step holds its distinct buckets to that number on the host, and a grid that can produce
more is refused when the step is built or the run's config loads."""

from __future__ import annotations

import json

import pytest
import torch
from expecttest import assert_expected_inline
from tolerances import approx, close

from compiled_loss.checks import ConfigError
from compiled_loss.config import CompileConfig, ModelConfig, PackingMode
from compiled_loss.demo.model import TinyLM
from compiled_loss.losses import ClippedPGLossConfig, ClippedPGLossFn
from compiled_loss.packing import BucketGrid
from compiled_loss.train import StepOptions, TrainStep

VOCAB = 40
EXACT = BucketGrid()  # exact shapes: every distinct packed length is a bucket of its own


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def _batch(width: int, rows: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, VOCAB, (rows, width), generator=g),
        "input_lengths": torch.full((rows,), width),
        "token_mask": torch.ones(rows, width),
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, width, generator=g),
        "prev_logprobs": -torch.rand(rows, width, generator=g),
        "generation_logprobs": -torch.rand(rows, width, generator=g),
        "reference_policy_logprobs": -torch.rand(rows, width, generator=g),
    }


def _step(packing: PackingMode, compile: CompileConfig | None, **options) -> tuple[TrainStep, TinyLM]:
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(vocab_size=VOCAB, hidden_size=16, num_heads=2, num_layers=1, max_positions=64))
    loss = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.01))
    compile = compile or CompileConfig(enabled=False)
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        loss,
        StepOptions(packing=packing, grid=EXACT, compile=compile, **options),
    )
    return step, model


@pytest.mark.parametrize("packing", [PackingMode.fused, PackingMode.none])
def test_fourteen_buckets_each_compiled_once_and_equal_to_eager(packing):
    """14 distinct buckets (Dynamo's own limit stops a fullgraph function at the ninth):
    every one compiles once, and each step's loss and gradients equal the eager step's."""
    compiled, compiled_model = _step(packing, CompileConfig(backend="eager"))
    eager, eager_model = _step(packing, None)
    for width in range(2, 16):
        got, want = compiled(_batch(width)), eager(_batch(width))
        assert got.metrics["loss"] == approx(want.metrics["loss"], torch.float32, "same")
        for p, q in zip(compiled_model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **close(torch.float32, "reordered"))
    assert (compiled.compiles, len(compiled.buckets), compiled.compile_problems()) == (14, 14, [])


def test_a_bucket_past_max_buckets_is_refused_before_it_compiles():
    step, _ = _step(PackingMode.fused, CompileConfig(backend="eager", max_buckets=3))
    for width in (2, 3, 4, 3, 2):  # three distinct buckets, each seen again
        step(_batch(width))
    with pytest.raises(ValueError) as error:
        step(_batch(5))
    assert_expected_inline(
        str(error.value),
        """TrainStep: shape bucket (10, 2, 5) would be distinct bucket 4, and compile.max_buckets=3 compiles at most that many: raise it, or coarsen the bucket grid (a larger step, a smaller per_octave)""",
    )
    assert step.compiles == 3


def test_a_grid_with_more_buckets_than_max_buckets_is_refused_when_the_step_is_built():
    with pytest.raises(ValueError) as error:
        _step(PackingMode.fused, CompileConfig(backend="eager"), max_rows=8, max_length=40)
    assert_expected_inline(
        str(error.value),
        """TrainStep: the bucket grid BucketGrid(tokens=1, rows=1, width=1, per_octave=0) puts micro-batches of up to 8 rows of up to 40 tokens into up to 102400 distinct shape buckets, more than compile.max_buckets=256 (one compile each): coarsen the grid or raise it""",
    )
    # per_octave bounds it: 6 row × 11 width × 17 token buckets (1, 2, 3, 4, 6, 8, 12, …)
    assert BucketGrid(per_octave=2).bound(8, 40, packed=True) == 6 * 11 * 17


@pytest.mark.parametrize(
    ("limit", "multiple", "per_octave"), [(1, 1, 0), (40, 1, 0), (100, 8, 0), (1000, 16, 2), (777, 1, 3), (5, 8, 4)]
)
def test_the_bound_counts_the_distinct_buckets(limit, multiple, per_octave):
    from compiled_loss.packing import round_to_bucket
    from compiled_loss.packing.layout import _distinct_buckets

    want = len({round_to_bucket(n, multiple, per_octave) for n in range(1, limit + 1)})
    assert _distinct_buckets(limit, multiple, per_octave) == want


def test_the_runner_refuses_a_grid_past_max_buckets_when_the_config_loads():
    from train.test_step import config

    with pytest.raises(ConfigError) as error:
        config("packing.tokens=1", "packing.rows=2", "packing.width=1", "packing.per_octave=0")
    assert_expected_inline(
        str(error.value),
        """the bucket grid (packing.tokens=1, .rows=2, .width=1, .per_octave=0) puts the longest micro-batch (3 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 24 tokens (the longest sequence padded to packing.pad_to_multiple)) and the smaller ones into up to 2880 distinct shape buckets, more than compile.max_buckets=256 (one compile each): coarsen the grid or raise compile.max_buckets""",
    )


@pytest.mark.slow
def test_the_runner_trains_through_twelve_and_more_buckets(tmp_path):
    """Exact shapes and pre-made rows of long-tailed lengths (a value head's batches), 4
    micro-batches a step: 17 distinct buckets in 5 steps, each compiled once."""
    from train.test_step import config

    from compiled_loss.app.loop import train

    cfg = config(
        "loss=mse_value",
        "packing.tokens=1",
        "packing.rows=2",
        "packing.width=1",
        "packing.per_octave=0",
        "compile.max_buckets=10000",
        "data.response_median=12",
        "data.response_max=40",
        "data.group_size=1",
        "data.prompts=8",
        "run.micro_batches=4",
        "run.steps=5",
        "compile.backend=eager",
    )
    summary = train(cfg, tmp_path)
    assert summary["buckets"] >= 12
    assert (summary["compiles"], summary["compile_problems"]) == (summary["buckets"], [])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    assert json.loads((tmp_path / "summary.json").read_text())["compiles"] == summary["compiles"]
