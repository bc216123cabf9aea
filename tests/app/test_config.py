"""Hydra configs: every group option composes into a typed config, and every kind of bad
override fails at start-up with a message that names the key (and the valid choices)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from expecttest import TestCase
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException

from compiled_loss.app import load_config
from compiled_loss.config import Config, PackingMode, build_loss
from compiled_loss.interfaces import LossType


def composed(*overrides: str):
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        return compose(config_name="config", overrides=list(overrides))


def typed(*overrides: str) -> Config:
    return load_config(composed(*overrides))


def error(*overrides: str) -> str:
    try:
        typed(*overrides)
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


LOSSES = ["clipped_pg", "gspo", "cispo", "reinforce", "nll", "dpo", "distillation", "mse_value"]


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_option_builds_its_loss(loss):
    cfg = typed(f"loss={loss}")
    assert cfg.loss.name == loss
    built = build_loss(cfg.loss)
    expected = {"gspo": LossType.SEQUENCE_LEVEL, "dpo": LossType.SEQUENCE_LEVEL}.get(loss, LossType.TOKEN_LEVEL)
    assert built.loss_type == expected


def test_loss_options_set_their_variant():
    assert typed("loss=gspo").loss.sequence_level_importance_ratios is True
    assert typed("loss=cispo").loss.use_cispo is True
    assert typed("loss=reinforce").loss.disable_ppo_ratio is True
    default = build_loss(typed().loss)
    assert default.cfg.reference_policy_kl_penalty == 0.01 and default.cfg.ratio_clip_max == 0.2


def test_every_loss_field_is_a_key():
    cfg = typed("loss=clipped_pg", "loss.ratio_clip_c=3.0", "loss.truncated_importance_sampling_ratio=2.0",
                "loss.use_importance_sampling_correction=true", "loss.truncated_importance_sampling_type=tis")
    built = build_loss(cfg.loss)
    assert (built.cfg.ratio_clip_c, built.cfg.truncated_importance_sampling_type) == (3.0, "tis")
    assert build_loss(typed("loss=distillation", "loss.kl_type=reverse").loss).cfg.kl_type == "reverse"
    assert build_loss(typed("loss=mse_value", "loss.cliprange=0.2").loss).cfg.cliprange == 0.2


@pytest.mark.parametrize("mode", ["none", "per_sequence", "fused"])
def test_packing_options(mode):
    assert typed(f"packing={mode}").packing.mode == PackingMode(mode)


def test_other_groups_compose():
    cfg = typed("draft=none", "parallel.tp=1", "compile=eager", "model=small", "data.prompts=4",
                "logprob.top_k=20", "optim.lr=1e-4", "run.steps=3")
    assert (cfg.compile.enabled, cfg.model.vocab_size, cfg.logprob.top_k, cfg.run.steps) == (False, 32000, 20, 3)


class TestStartupErrors(TestCase):
    def test_typo_group_option_lists_choices(self):
        with pytest.raises(MissingConfigException) as info:
            composed("loss=grpoo")
        assert "Could not find 'loss/grpoo'" in str(info.value)
        for option in LOSSES:
            assert option in str(info.value)

    def test_typo_key(self):
        with pytest.raises(ConfigCompositionException) as info:
            composed("loss.ratio_clip=0.3")
        assert "Key 'ratio_clip' not in" in str(info.value.__cause__)

    def test_plus_unknown_key_is_rejected(self):
        self.assertExpectedInline(
            error("+packing.bucket=64"),
            """packing.bucket: unknown key; valid keys: ['mode', 'pad_to_multiple', 'tokens', 'rows', 'width', 'per_octave']""",
        )

    def test_plus_unknown_top_level_key_is_rejected(self):
        self.assertExpectedInline(
            error("+seed=3"),
            """unknown top-level keys ['seed']; valid: ['loss', 'packing', 'draft', 'parallel', 'compile', 'model', 'data', 'logprob', 'optim', 'run']""",
        )

    def test_wrong_type(self):
        with pytest.raises(ConfigCompositionException) as info:
            composed("run.steps=many")
        assert "run.steps" in str(info.value.__cause__) and "could not be converted to Integer" in str(info.value.__cause__)

    def test_closed_choice_lists_values(self):
        with pytest.raises(ConfigCompositionException) as info:
            composed("loss=distillation", "loss.kl_type=jsd")
        assert "expected one of [forward, reverse, mixed]" in str(info.value.__cause__)

    def test_invalid_loss_config(self):
        self.assertExpectedInline(
            error("loss=cispo", "loss.ratio_clip_c=3"),
            """loss=cispo: use_cispo=True is incompatible with ratio_clip_c""",
        )

    def test_logprob_option_with_logit_loss(self):
        self.assertExpectedInline(
            error("loss=mse_value", "logprob.top_k=50"),
            """logprob.top_k=50 applies to log-prob losses only; loss=mse_value reads logit inputs""",
        )

    def test_parallel_sizes_must_fit_the_model_and_packing(self):
        self.assertExpectedInline(
            error("parallel.tp=3"),
            """model.vocab_size=2048 must divide evenly over parallel.tp=3 vocabulary shards""",
        )
        self.assertExpectedInline(
            error("parallel.cp=8"),
            """packing.pad_to_multiple=8 must be a multiple of 2 × parallel.cp = 16 (each sequence is cut into 2·cp context-parallel chunks)""",
        )
        self.assertExpectedInline(
            error("parallel.dp=3"),
            """data.prompts=8 must split evenly over parallel.dp=3 replicas, each with at least run.micro_batches=2 rows""",
        )

    def test_compile_backend(self):
        message = error("compile.backend=inductr")
        assert message.startswith("compile.backend='inductr' is not a torch.compile backend; valid choices: [")
        assert "'inductor'" in message and "'aot_eager'" in message

    def test_positions_too_short(self):
        self.assertExpectedInline(
            error("model.max_positions=64"),
            """model.max_positions=64 is shorter than the longest padded sequence the data can produce (114: data.prompt_terms_max + data.response_max + 2 + packing.pad_to_multiple)""",
        )

    def test_padded_rows_longer_than_the_positions(self):
        self.assertExpectedInline(
            error("packing=none", "model.max_positions=120"),
            """model.max_positions=120 is shorter than the padded row width of the longest sequence under packing=none (128: the data's longest row rounded up to packing.width=128); raise model.max_positions or lower packing.width""",
        )

    def test_too_many_micro_batches_for_dpo(self):
        self.assertExpectedInline(
            error("loss=dpo", "data.prompts=2", "run.micro_batches=3"),
            """run.micro_batches=3 exceeds the 2 pairs of a global batch (data.prompts × 1 pair)""",
        )


def test_wheel_ships_the_yaml(tmp_path):
    """A wheel built from the repo carries conf/ as compiled_loss/conf (runs from any dir)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        check=True, cwd=__file__.rsplit("/tests/", 1)[0],
    )
    (wheel,) = tmp_path.glob("compiled_loss-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"compiled_loss/conf/config.yaml", "compiled_loss/conf/__init__.py",
            "compiled_loss/conf/loss/gspo.yaml", "compiled_loss/conf/packing/fused.yaml"} <= names


def test_help_lists_the_real_options_of_each_group():
    out = subprocess.run([sys.executable, "-m", "compiled_loss.run", "--help"], check=True, capture_output=True,
                         text=True).stdout
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "loss: cispo, clipped_pg, cross_tokenizer, distillation, dpo, gspo, mpo, mse_value, nll, opd_full, reinforce" in groups
    assert "packing: fused, none, per_sequence" in groups
    assert "schema" not in groups


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.grad_clip=-1", "optim.grad_clip must be > 0 (or null to disable), got -1.0"),
        ("optim.grad_clip=0", "optim.grad_clip must be > 0 (or null to disable), got 0.0"),
        ("optim.lr=nan", "optim.lr must be finite, got nan"),
        ("optim.beta2=1.0", "optim.beta2 must be in [0, 1), got 1.0"),
        ("logprob.temperature=nan", "logprob.temperature must be finite, got nan"),
        ("logprob.temperature=inf", "logprob.temperature must be finite, got inf"),
        ("logprob.top_p=0", "logprob: top_p must be in (0, 1], got 0.0"),
        ("logprob.chunk_size=0", "logprob.chunk_size must be >= 1, got 0"),
        ("loss.ratio_clip_c=nan", "loss=clipped_pg: ratio_clip_c must be finite, got nan"),
        ("loss.truncated_importance_sampling_ratio=nan",
         "loss=clipped_pg: truncated_importance_sampling_ratio must be finite, got nan"),
        ("data.error_rate_max=nan", "data.error_rate_max must be finite, got nan"),
        ("data.response_median=0", "data.response_median must be > 0, got 0.0"),
        ("model.vocab_size=0", "model.vocab_size must be >= 1, got 0"),
        ("packing.tokens=0", "packing: BucketGrid.tokens must be >= 1, got 0"),
        ("run.micro_batches=0", "run.micro_batches must be >= 1, got 0"),
    ],
)
def test_every_numeric_option_is_validated_naming_the_key(override, message):
    assert error(override) == message
