"""The run's own options — warm start, checkpoints, determinism, the sampled task and GRPO
advantages — compose from Hydra and are validated naming the key."""

from __future__ import annotations

import pytest

from compiled_loss.app import compose_config


def error(*overrides: str) -> str:
    try:
        compose_config(*overrides)
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


def test_the_default_run_warm_starts_then_runs_grpo_on_its_own_samples():
    cfg = compose_config()
    assert (cfg.loss.name, cfg.run.sft_steps, cfg.run.steps) == ("clipped_pg", 27, 150)
    assert (cfg.optim.sft_lr, cfg.optim.lr, cfg.data.prompts, cfg.data.group_size) == (3e-3, 5e-4, 8, 16)
    assert (cfg.data.use_leave_one_out_baseline, cfg.data.normalize_rewards) == (False, True)
    assert (cfg.run.save_every, cfg.run.resume, cfg.run.deterministic) == (0, None, False)


def test_the_options_compose():
    cfg = compose_config(
        "run.sft_steps=0",
        "run.save_every=5",
        "run.resume=/tmp/step_5.pt",
        "run.deterministic=true",
        "optim.sft_lr=1e-3",
        "data.total_terms=12",
        "data.use_leave_one_out_baseline=true",
        "data.normalize_rewards=false",
    )
    assert (cfg.run.sft_steps, cfg.run.save_every, cfg.run.resume, cfg.run.deterministic) == (
        0,
        5,
        "/tmp/step_5.pt",
        True,
    )
    assert (cfg.optim.sft_lr, cfg.data.total_terms) == (1e-3, 12)
    assert (cfg.data.use_leave_one_out_baseline, cfg.data.normalize_rewards) == (True, False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.sft_steps=-1", "run.sft_steps must be >= 0, got -1"),
        ("run.save_every=-2", "run.save_every must be >= 0, got -2"),
        ("optim.sft_lr=0", "optim.sft_lr must be > 0, got 0.0"),
        ("optim.sft_lr=nan", "optim.sft_lr must be finite, got nan"),
        ("data.total_terms=8", "data.total_terms (8) must be > data.prompt_terms_max (8)"),
        (
            "model.max_positions=24",
            "model.max_positions=24 is shorter than the longest padded sequence the data can produce (114: "
            "data.prompt_terms_max + data.response_max + 2 + packing.pad_to_multiple)",
        ),
    ],
)
def test_every_new_option_is_validated_naming_the_key(override, message):
    assert error(override) == message


def test_a_long_sampled_task_names_its_keys_when_positions_run_out():
    assert error("data.response_max=4", "data.total_terms=40", "model.max_positions=48") == (
        "model.max_positions=48 is shorter than the longest padded sequence the data can produce (55: "
        "data.prompt_terms_max + data.total_terms - data.prompt_terms_min + 2 + packing.pad_to_multiple)"
    )
