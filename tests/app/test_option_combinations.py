"""Every combination of options that loads also runs: a combination that cannot work is
refused when the config loads, never after the warm start.

The grid crosses the loss (every option, and OPD_FULL's hidden-state payload), the packing,
the drafter, the fused LM head, the model dtype and a log-prob filter. Every combination is
loaded (`Config` and its checks); of those that load, a set that holds every pair of option
values that loads together (greedy all-pairs cover: a failure needs at most two options to
interact, as every one seen has) runs one warm-start and one loss step, eagerly, at the test
size."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools

import pytest
from common import SMALL_RUN
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from compiled_loss.app import compose_config
from compiled_loss.app.loop import train
from compiled_loss.audit.cli import LOSSES as AUDITED_LOSSES
from compiled_loss.checks import ConfigError
from compiled_loss.config import PackingMode

SMALL = [*SMALL_RUN, "run.micro_batches=2", "compile.enabled=false", "run.steps=2", "run.sft_steps=1"]
LOSSES = [*AUDITED_LOSSES, "opd_full loss.teacher_payload=hidden_states"]  # every runner loss
AXES = {
    "loss": LOSSES,
    "packing": ["none", "per_sequence", "fused"],
    "draft": ["none", "eagle3", "dflash"],
    "logprob.fused_linear": [False, True],
    "model.dtype": ["float32", "bfloat16"],
    "logprob.top_k": [None, 8],
}


def _option(group: str, overrides: str):
    """A group's option object as Hydra composes it, without the checks of the whole config."""
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        return OmegaConf.to_object(compose(config_name="config", overrides=[*SMALL, *overrides.split()])[group])


def _config(base, options, combo):
    loss, packing, draft, fused, dtype, top_k = combo
    return dataclasses.replace(
        base,
        loss=options[loss],
        draft=options[draft],
        packing=dataclasses.replace(base.packing, mode=PackingMode(packing)),
        logprob=dataclasses.replace(base.logprob, fused_linear=fused, top_k=top_k),
        model=dataclasses.replace(base.model, dtype=dtype),
    )


def _pairs(combo) -> set:
    return {((i, a), (j, b)) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2)}


@pytest.fixture(scope="module")
def grid():
    """(every combination, the loaded configs of those that load)."""
    base = compose_config(*SMALL)
    options = {name: _option("loss", f"loss={name}") for name in LOSSES}
    options.update({name: _option("draft", f"draft={name}") for name in AXES["draft"]})
    combos = list(itertools.product(*AXES.values()))
    loaded = {}
    for combo in combos:
        with contextlib.suppress(ConfigError):
            loaded[combo] = _config(base, options, combo)
    return combos, loaded


@pytest.mark.slow
def test_every_pair_of_options_that_loads_runs(grid, tmp_path):
    combos, loaded = grid
    needed = set().union(*(_pairs(c) for c in loaded))
    chosen = []
    while needed:  # greedy: the combination that runs the most pairs not run yet (the first such)
        best = max(loaded, key=lambda c: len(_pairs(c) & needed))
        chosen.append(best)
        needed -= _pairs(best)
    failures = []
    for i, combo in enumerate(chosen):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train(loaded[combo], tmp_path / str(i))
            assert summary["steps"] == 2 and summary["sft_steps"] == (0 if combo[0] == "mse_value" else 1)
        except Exception as e:  # noqa: BLE001 - every failure is listed, with its combination
            failures.append(f"{dict(zip(AXES, combo))}: {type(e).__name__}: {e}")
    assert failures == []
    print(f"{len(combos)} combinations, {len(loaded)} load, {len(chosen)} run (every pair of options)")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            "loss=opd_full loss.teacher_payload=hidden_states",
            "loss.teacher_payload=hidden_states needs the teacher's LM head at input preparation; the embedded run hands "
            "the loss its teacher's logits: use loss.teacher_payload=logits",
        ),
        (
            "loss=cross_tokenizer logprob.fused_linear=true",
            "logprob.fused_linear=true never forms the policy's logits; loss=cross_tokenizer reads "
            "distillation_cross_tokenizer inputs, which are made from them (only log-prob and distillation losses take "
            "the final hidden states and the LM head)",
        ),
    ],
)
def test_combinations_that_fail_after_the_warm_start_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as info:
        compose_config(*SMALL, *overrides.split())
    assert str(info.value) == message
