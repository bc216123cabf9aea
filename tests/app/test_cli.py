"""The runner's command line: a configuration error is one line with a did-you-mean and exit
status 2 (the traceback only under HYDRA_FULL_ERROR=1), `--help` shows each key's docstring,
the `grpo` / `dapo` aliases set what they say, and `Config(loss="…")` names the options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compiled_loss.app import compose_config
from compiled_loss.app.cli import check_overrides, field_docs, help_text
from compiled_loss.checks import ConfigError
from compiled_loss.config import Config, RunConfig


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["loss=grpoo"],
            "loss=grpoo: no such loss option; did you mean 'grpo'? (options: cispo, clipped_pg, cross_tokenizer, "
            "dapo, distillation, dpo, grpo, gspo, mpo, mse_value, nll, opd_full, reinforce)",
        ),
        (["-m", "packing=none,fusd"], "packing=fusd: no such packing option; did you mean 'fused'?"),
        (["run.stepz=3"], "run.stepz: unknown key; did you mean 'steps'?"),
        (["loss.ratio_clip_mn=0.1"], "loss.ratio_clip_mn: unknown key; did you mean 'ratio_clip_min'?"),
        (["los=dpo"], "los=dpo: no config group 'los'; did you mean 'loss'?"),
        (["run=fast"], "run=fast: no such run option (options: default)"),
    ],
)
def test_a_typo_names_the_closest_valid_choice(argv, message):
    with pytest.raises(ConfigError) as e:
        check_overrides(argv)
    assert str(e.value).startswith(message), e.value


def test_the_keys_of_the_chosen_option_are_the_ones_checked():
    check_overrides(["loss=dpo", "loss.sft_loss_weight=0.5"])  # a DPO key, with loss=dpo
    with pytest.raises(ConfigError, match=r"^loss.sft_loss_weight: unknown key"):
        check_overrides(["loss.sft_loss_weight=0.5"])  # not a key of the default, clipped_pg
    check_overrides(["hydra.run.dir=/tmp/x", "+foo=1", "--cfg", "job"])  # Hydra's own forms pass through


def _run(*argv, env=None):
    return subprocess.run(
        [sys.executable, "-m", "compiled_loss.run", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_a_configuration_error_is_one_line_and_exit_status_2():
    typo = _run("loss=grpoo")
    assert (typo.returncode, typo.stdout) == (2, "")
    assert typo.stderr.splitlines() == [
        "error: loss=grpoo: no such loss option; did you mean 'grpo'? (options: cispo, clipped_pg, cross_tokenizer, "
        "dapo, distillation, dpo, grpo, gspo, mpo, mse_value, nll, opd_full, reinforce)"
    ]
    value = _run("optim.lr=-1")  # a value load_config refuses, after Hydra composed the config
    assert value.returncode == 2
    assert value.stderr.splitlines() == ["error: optim.lr must be > 0, got -1.0"]
    full = _run("optim.lr=-1", env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr and "optim.lr must be > 0" in full.stderr


@pytest.mark.slow  # a process that composes the config
def test_an_unusable_compile_cache_is_one_line_and_exit_status_2():
    cache = _run("run.compile_cache=/dev/null/cache.bin")
    assert (cache.returncode, cache.stdout) == (2, "")
    assert cache.stderr.splitlines() == [
        "error: run.compile_cache=/dev/null/cache.bin: /dev/null is not a directory (rank 0 writes it after a step "
        "that compiled something it lacks)"
    ]


def test_help_lists_groups_options_and_every_keys_docstring():
    text = help_text()
    groups = text.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "packing: fused, none, per_sequence" in groups
    assert "schema" not in groups
    docs = field_docs(RunConfig)
    assert docs["steps"] and f"run.steps={RunConfig().steps}  {docs['steps']}" in text
    assert "loss.ratio_clip_max=0.2  ε_high >= 0" in text
    assert "[dpo]" in text and "[eagle3]" in text


def test_the_aliases_set_what_they_document():
    grpo, clipped = compose_config("loss=grpo"), compose_config("loss=clipped_pg")
    assert grpo.loss_fn == clipped.loss_fn
    dapo = compose_config("loss=dapo").loss_fn.cfg
    assert (dapo.ratio_clip_min, dapo.ratio_clip_max, dapo.token_level_loss, dapo.reference_policy_kl_penalty) == (
        0.2,
        0.28,
        True,
        0.0,
    )


def test_a_config_given_a_name_lists_the_option_objects():
    with pytest.raises(ConfigError, match=r"^Config\(loss='gspo'\): loss takes an option object, one of "):
        Config(loss="gspo")


def test_options_of_a_config_dir_are_checked_with_the_packaged_ones(tmp_path):
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "mine.yaml").write_text(
        "defaults:\n  - /schema_loss_clipped_pg@_here_\n  - _self_\nname: mine\nratio_clip_max: 0.3\n"
    )
    check_overrides(["--config-dir", str(tmp_path), "loss=mine", "loss.ratio_clip_min=0.1"])
    check_overrides([f"--config-dir={tmp_path}", "-m", "loss=mine,gspo"])
    with pytest.raises(ConfigError, match=r"^loss=mine: no such loss option"):
        check_overrides(["loss=mine"])
