"""The bounds of the float options, measured: at each bound a step of the embedded run still
has a finite, nonzero gradient (the bound refuses the values beyond, where the float32
squares of the gradient overflow or vanish: `compiled_loss.checks.FACTOR_MAX`); the
drafters' decays are refused where a slot's or a step's weight underflows float32."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from common import SMALL_RUN

from compiled_loss.app import compose_config
from compiled_loss.app.loop import train
from compiled_loss.checks import ConfigError
from compiled_loss.draft.dflash import DFlashConfig
from compiled_loss.draft.eagle3 import Eagle3Config

SMALL = [*SMALL_RUN, "run.micro_batches=2", "compile.enabled=false", "run.steps=2", "run.sft_steps=1"]


@pytest.mark.parametrize(
    "overrides",
    [
        "loss=nll logprob.temperature=1e-6",
        "loss=nll logprob.temperature=1e6",
        "loss.reference_policy_kl_penalty=1e6",
        "loss=dpo loss.reference_policy_kl_penalty=1e-6",
        "loss=mse_value loss.scale=1e6",
        "loss=cross_tokenizer loss.temperature=1e-6",
        "loss=cross_tokenizer loss.temperature=1e6",
    ],
)
def test_at_the_bound_the_gradient_is_finite_and_nonzero(overrides, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        train(compose_config(*SMALL, *overrides.split()), tmp_path)
    for record in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()):
        assert math.isfinite(record["loss"]) and 0 < record["grad_norm"] < math.inf, record


@pytest.mark.parametrize(
    ("cls", "fields", "message"),
    [
        (
            DFlashConfig,
            dict(loss_decay_gamma=0.001),
            "loss_decay_gamma must be 0 or >= 0.03435 (with block_size=5), got 0.001: slot k is weighted "
            "exp(-(k-1)/loss_decay_gamma), which underflows float32 (< 1.18e-38) for the block's last slots below that, so "
            "they would train nothing",
        ),
        (
            DFlashConfig,
            dict(loss_decay_gamma=0.01, block_size=2),
            "loss_decay_gamma must be 0 or >= 0.01145 (with block_size=2), got 0.01: slot k is weighted "
            "exp(-(k-1)/loss_decay_gamma), which underflows float32 (< 1.18e-38) for the block's last slots below that, so "
            "they would train nothing",
        ),
        (
            Eagle3Config,
            dict(ttt_steps=400),
            "ttt_step_loss_decay=0.8 with ttt_steps=400: the last step's loss weight decay^399 = 2.15e-39 underflows float32 "
            "(< 1.18e-38), so that step would train nothing; raise ttt_step_loss_decay or lower ttt_steps",
        ),
        (
            Eagle3Config,
            dict(loss_weight=2e6),
            "loss_weight=2000000.0 is outside [1e-06, 1e+06]: it scales the draft loss, and float32 squares of the gradient "
            "overflow (grad_norm inf, no update) or vanish outside that range",
        ),
    ],
)
def test_drafter_decays_and_weights(cls, fields, message):
    with pytest.raises(ConfigError) as info:
        cls(**fields)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        (dict(loss_decay_gamma=0.03435), True),
        (dict(loss_decay_gamma=0.0343), False),
        (dict(loss_decay_gamma=0.0), True),
    ],
)
def test_the_decay_bound_is_where_the_last_slot_weight_leaves_float32(fields, ok):
    """block_size 5: the last slot's weight exp(-3/γ) reaches float32's smallest normal at
    γ = 3 / 87.34 = 0.034349."""
    if ok:
        DFlashConfig(**fields)
    else:
        with pytest.raises(ConfigError):
            DFlashConfig(**fields)
