"""The run's own options — the step count and its warm start, the metric loggers,
checkpoints, determinism, the sampled task and GRPO advantages — compose from Hydra and are
validated naming the key."""

from __future__ import annotations

import sys

import pytest
import torch
from common import TINY_TASK

from compiled_loss.app import compose_config, store
from compiled_loss.app.loop import build_run
from compiled_loss.train.parallel import init_parallel


def error(*overrides: str) -> str:
    try:
        compose_config(*overrides)
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


def test_the_default_run_warm_starts_then_runs_grpo_on_its_own_samples():
    cfg = compose_config()
    assert (cfg.loss.name, cfg.run.sft_steps, cfg.run.steps, cfg.run.loggers) == ("clipped_pg", 27, 177, ["jsonl"])
    assert (cfg.optim.sft_lr, cfg.optim.lr, cfg.data.prompts, cfg.data.group_size) == (3e-3, 5e-4, 8, 16)
    assert cfg.optim.draft_lr == 3e-3
    assert (cfg.data.use_leave_one_out_baseline, cfg.data.normalize_rewards) == (False, True)
    assert (cfg.run.save_every, cfg.run.resume, cfg.run.deterministic) == (0, None, False)


def test_the_options_compose(monkeypatch):
    monkeypatch.setattr(store, "check_installed", lambda loggers: None)  # whether or not the packages are here
    cfg = compose_config(
        "run.sft_steps=0",
        "run.loggers=[jsonl,tensorboard,wandb]",
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
    assert cfg.run.loggers == ["jsonl", "tensorboard", "wandb"]
    assert (cfg.optim.sft_lr, cfg.data.total_terms) == (1e-3, 12)
    assert (cfg.data.use_leave_one_out_baseline, cfg.data.normalize_rewards) == (True, False)


def test_the_drafter_trains_at_its_own_learning_rate_in_both_phases():
    cfg = compose_config(*TINY_TASK, "compile.enabled=false", "draft=eagle3", "optim.draft_lr=1e-2")
    run = build_run(cfg, init_parallel(cfg.parallel))
    drafter = [p for p in run.drafter.parameters() if p.requires_grad]
    for optimizer, lr in zip(run.optimizers, (cfg.optim.sft_lr, cfg.optim.lr)):
        policy, draft = optimizer.param_groups
        assert (policy["lr"], draft["lr"]) == (lr, 1e-2)
        assert [id(p) for p in draft["params"]] == [id(p) for p in drafter]


def test_the_drafters_adamw_moments_pass_to_the_loss_optimizer_at_the_switch():
    cfg = compose_config(*TINY_TASK, "compile.enabled=false", "draft=eagle3")
    run = build_run(cfg, init_parallel(cfg.parallel))
    warm, loss = run.optimizers
    policy = [p for p in run.policy.parameters() if p.requires_grad]
    drafter = [p for p in run.drafter.parameters() if p.requires_grad]
    for p in policy + drafter:
        p.grad = torch.ones_like(p)
    warm.step()
    run.hand_over_drafter()
    assert drafter and all(loss.state[p] is warm.state[p] for p in drafter)
    assert not any(p in loss.state for p in policy)  # the policy's moments start anew at the loss


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.sft_steps=-1", "run.sft_steps must be >= 0, got -1"),
        ("run.save_every=-2", "run.save_every must be >= 0, got -2"),
        (
            "run.loggers=[jsonl,tensorbord]",
            "run.loggers=[jsonl,tensorbord]: unknown logger 'tensorbord'; choices: jsonl, tensorboard, wandb",
        ),
        ("run.loggers=[jsonl,jsonl]", "run.loggers=[jsonl,jsonl] names a logger twice"),
        ("optim.sft_lr=0", "optim.sft_lr must be > 0, got 0.0"),
        ("optim.sft_lr=nan", "optim.sft_lr must be finite, got nan"),
        ("optim.draft_lr=0", "optim.draft_lr must be > 0, got 0.0"),
        ("optim.draft_lr=inf", "optim.draft_lr must be finite, got inf"),
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


def test_run_steps_counts_every_optimizer_step_the_warm_start_included():
    """The warm start is the first run.sft_steps of run.steps; a run whose warm start would
    leave its loss no step is refused, saying how the steps count. A value head has no warm
    start: all its steps train the loss."""
    assert error("run.steps=3") == (
        "run.sft_steps=27 leaves no step of run.steps=3 to loss=clipped_pg: run.steps counts every optimizer step, "
        "the warm start's included; lower run.sft_steps below 3 (0: no warm start) or raise run.steps above 27"
    )
    assert error("run.steps=27").startswith("run.sft_steps=27 leaves no step of run.steps=27 to loss=clipped_pg")
    assert compose_config("run.steps=28").run.steps == 28
    cfg = compose_config("loss=mse_value", "run.steps=3")
    assert (cfg.run.steps, cfg.run.warm_start_steps("value"), cfg.run.warm_start_steps("policy_gradient")) == (3, 0, 27)
    assert error("run.steps=3", "run.log_every=4") == (
        "run.log_every=4 exceeds run.steps=3: a larger value logs the last step's line only, as run.log_every=3 does"
    )


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_logger_whose_package_is_missing_is_refused_when_the_config_loads(logger, monkeypatch):
    monkeypatch.setitem(sys.modules, logger, None)  # what importlib finds for a package that is not installed
    assert error(f"run.loggers=[jsonl,{logger}]") == (
        f"run.loggers=[jsonl,{logger}]: the {logger} logger needs the {logger} package, which is not installed: "
        f"pip install 'compiled_loss[{logger}]'"
    )
