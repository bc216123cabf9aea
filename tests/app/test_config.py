"""Hydra configs: every group option composes into a typed config, and every kind of bad
override fails at start-up with a message that names the key (and the valid choices)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import inspect
import math
import pickle
import re
import subprocess
import sys
import textwrap
import typing
import unittest.mock
import zipfile
from pathlib import Path

import pytest
from expecttest import TestCase
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

import compiled_loss
from compiled_loss.app import load_config
from compiled_loss.app.store import GROUP_SCHEMAS, check_run
from compiled_loss.checks import ConfigError
from compiled_loss.config import DRAFT_KINDS, LOSS_KINDS, Config, PackingMode, RunConfig, build_loss
from compiled_loss.config.drafts import Eagle3DraftOption
from compiled_loss.config.losses import (
    ClippedPgLossOption,
    DistillationLossOption,
    DpoLossOption,
    KlType,
    NllLossOption,
    OpdFullLossOption,
)
from compiled_loss.interfaces import LossType
from compiled_loss.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DistillationLossConfig,
    DPOLossFn,
    NLLLossFn,
    OPDFullConfig,
)


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
    cfg = typed(
        "loss=clipped_pg",
        "loss.ratio_clip_c=3.0",
        "loss.truncated_importance_sampling_ratio=2.0",
        "loss.use_importance_sampling_correction=true",
        "loss.truncated_importance_sampling_type=tis",
    )
    built = build_loss(cfg.loss)
    assert (built.cfg.ratio_clip_c, built.cfg.truncated_importance_sampling_type) == (3.0, "tis")
    assert build_loss(typed("loss=distillation", "loss.kl_type=reverse").loss).cfg.kl_type == "reverse"
    assert build_loss(typed("loss=mse_value", "loss.cliprange=0.2").loss).cfg.cliprange == 0.2


@pytest.mark.parametrize("mode", ["none", "per_sequence", "fused"])
def test_packing_options(mode):
    assert typed(f"packing={mode}").packing.mode == PackingMode(mode)


def test_other_groups_compose():
    cfg = typed(
        "draft=none",
        "parallel.tp=1",
        "compile=eager",
        "model=small",
        "data.prompts=4",
        "logprob.top_k=20",
        "optim.lr=1e-4",
        "run.steps=30",
    )
    assert (cfg.compile.enabled, cfg.model.vocab_size, cfg.logprob.top_k, cfg.run.steps) == (False, 32000, 20, 30)


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
        assert "run.steps" in str(info.value.__cause__) and "could not be converted to Integer" in str(
            info.value.__cause__
        )

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
            """data.prompts=8 must split evenly over the 3 data-parallel ranks (parallel.dp × parallel.dp_shard), each with at least run.micro_batches=2 rows""",
        )

    def test_compile_backend(self):
        message = error("compile.backend=inductr")
        assert message.startswith(
            "compile.backend='inductr' is not a torch.compile backend; did you mean 'inductor'? valid choices: ["
        )
        assert "'inductor'" in message and "'aot_eager'" in message and "TESTING_ONLY" not in message
        assert "did you mean" not in error("compile.backend=xyzzy")

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


@pytest.mark.slow
def test_wheel_ships_the_yaml(tmp_path):
    """A wheel built from the repo carries conf/ as compiled_loss/conf (runs from any dir),
    `py.typed`, the LICENSE and the version `compiled_loss.__version__` states."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        check=True,
        cwd=__file__.rsplit("/tests/", 1)[0],
    )
    (wheel,) = tmp_path.glob("compiled_loss-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "compiled_loss/conf/config.yaml",
        "compiled_loss/conf/__init__.py",
        "compiled_loss/conf/loss/gspo.yaml",
        "compiled_loss/conf/packing/fused.yaml",
        "compiled_loss/py.typed",
    } <= names
    version = compiled_loss.__version__
    assert f"compiled_loss-{version}.dist-info/METADATA" in names
    assert any(n.startswith(f"compiled_loss-{version}.dist-info/") and n.endswith("LICENSE") for n in names), names


@pytest.mark.slow
def test_help_lists_the_real_options_of_each_group():
    out = subprocess.run(
        [sys.executable, "-m", "compiled_loss.run", "--help"], check=True, capture_output=True, text=True
    ).stdout
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert (
        "loss: cispo, clipped_pg, cross_tokenizer, dapo, distillation, dpo, grpo, gspo, mpo, mse_value, nll, opd_full, reinforce"
        in groups
    )
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
        (
            "loss.truncated_importance_sampling_ratio=nan",
            "loss=clipped_pg: truncated_importance_sampling_ratio must be finite, got nan",
        ),
        ("data.error_rate_max=nan", "data.error_rate_max must be finite, got nan"),
        ("data.response_median=0", "data.response_median must be > 0, got 0.0"),
        ("model.vocab_size=0", "model.vocab_size must be >= 1, got 0"),
        ("packing.tokens=0", "packing: BucketGrid.tokens must be >= 1, got 0"),
        ("run.micro_batches=0", "run.micro_batches must be >= 1, got 0"),
    ],
)
def test_every_numeric_option_is_validated_naming_the_key(override, message):
    assert error(override) == message


# ---------------------------------------------------------------------------------------
# option classes written in the source; the loss a Config describes, built once
# ---------------------------------------------------------------------------------------

SCHEMAS = [Config, *GROUP_SCHEMAS.values(), *LOSS_KINDS, *DRAFT_KINDS]


def _documented(cls: type) -> set[str]:
    """The fields `cls`'s own class body declares with a docstring under them."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        stmt.target.id
        for stmt, after in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value.value, str)
    }


@pytest.mark.parametrize("cls", SCHEMAS, ids=lambda c: c.__name__)
def test_every_schema_is_a_class_in_the_source_with_a_docstring_under_each_field(cls):
    """grep finds each class; each key is documented where it is declared (an option's keys
    by its loss's or drafter's config, which the option subclasses)."""
    assert re.search(rf"^class {cls.__name__}\b", Path(inspect.getfile(cls)).read_text(), re.MULTILINE)
    documented = set().union(*(_documented(c) for c in cls.__mro__ if dataclasses.is_dataclass(c)))
    assert {f.name for f in dataclasses.fields(cls)} - documented == set()


def _plain(hint):
    """A field's type with a `Literal` or an Enum as the tuple of its choices."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return args
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        assert [m.name for m in hint] == [m.value for m in hint], hint  # Hydra reads a choice by its name
        return tuple(m.value for m in hint)
    if type(None) in args and len(args) == 2:
        return _plain(next(a for a in args if a is not type(None))), None
    return hint


@pytest.mark.parametrize("cls", [*LOSS_KINDS, *DRAFT_KINDS], ids=lambda c: c.__name__)
def test_an_option_redeclares_only_its_configs_choices_as_enums_with_the_same_values_and_default(cls):
    """Each key has the type (a `Literal` as an Enum of the same choices) and default of the
    config class that first declares it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        origin = [c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {})][-1]
        declared = next(g for g in dataclasses.fields(origin) if g.name == f.name)
        assert _plain(hints[f.name]) == _plain(typing.get_type_hints(origin)[f.name]), f.name
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        assert f.name == "name" or default == declared.default, f.name


def test_an_option_is_its_config_and_checks_its_fields_naming_itself():
    assert isinstance(ClippedPgLossOption(), ClippedPGLossConfig)
    assert isinstance(OpdFullLossOption(), OPDFullConfig) and isinstance(OpdFullLossOption(), ClippedPGLossConfig)
    self_check = [
        (
            lambda: ClippedPgLossOption(name="gspo", ratio_clip_c=math.nan),
            "loss=gspo: ratio_clip_c must be finite, got nan",
        ),
        (lambda: OpdFullLossOption(chunk_size=0), "loss=opd_full: opd_full.chunk_size must be None or >= 1, got 0"),
        (lambda: OpdFullLossOption(ratio_clip_min=-1.0), "loss=opd_full: ratio_clip_min must be >= 0, got -1.0"),
        (lambda: Eagle3DraftOption(ttt_steps=0), "draft=eagle3: ttt_steps must be >= 1, got 0"),
    ]
    for build, message in self_check:
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value) == message
    # the loss gets plain strings, not the option's Enums
    built = build_loss(DistillationLossOption(kl_type=KlType.reverse))
    assert type(built.cfg) is DistillationLossConfig and type(built.cfg.kl_type) is str


def test_the_loss_is_built_once_and_is_no_field():
    with unittest.mock.patch("compiled_loss.config.root.build_loss", wraps=build_loss) as built:
        cfg = Config(loss=DpoLossOption(sft_loss_weight=0.5))
        assert cfg.loss_fn is cfg.loss_fn
    assert built.call_count == 1  # by the checks of `Config.__post_init__`, then kept
    assert type(cfg.loss_fn) is DPOLossFn and cfg.loss_fn.cfg.sft_loss_weight == 0.5
    assert "loss_fn" not in [f.name for f in dataclasses.fields(Config)]
    assert "loss_fn" not in OmegaConf.structured(Config) and "loss_fn" not in composed()
    assert cfg == Config(loss=DpoLossOption(sft_loss_weight=0.5))


def test_a_config_pickles_copies_and_replaces_with_its_loss():
    cfg = typed("loss=cispo")
    for copied in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):  # a Ray worker's copy
        assert copied == cfg and copied.loss_fn == cfg.loss_fn and copied.loss_fn is not cfg.loss_fn
    other = dataclasses.replace(cfg, loss=NllLossOption())
    assert type(other.loss_fn) is NLLLossFn and type(cfg.loss_fn) is ClippedPGLossFn
    assert cfg.loss_fn.cfg.use_cispo


# ---------------------------------------------------------------------------------------
# bounds: every float checked in float32, factors and exponents, every size bounded
# ---------------------------------------------------------------------------------------

FLOAT32_RANGE = "must be 0 or of magnitude in [1.1754944e-38, 3.4028235e+38] (float32, the dtype the losses and the model compute in)"


def _options():
    """(key prefix of the messages, group, option class) of every config group and option."""
    yield from ((f"{group}.", group, cls) for group, cls in GROUP_SCHEMAS.items())
    yield from ((f"loss={cls().name}: ", "loss", cls) for cls in LOSS_KINDS)
    yield from ((f"draft={cls().name}: ", "draft", cls) for cls in DRAFT_KINDS)


def _fields(kind):
    """(prefix, group, class, field) of every field whose type is `kind` (or `kind | None`)."""
    for prefix, group, cls in _options():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (kind, kind | None, typing.Optional[kind]):
                yield prefix, group, cls, f.name


_OPTIONS: dict[str, object] = {}


def _default(group: str, cls: type):
    """The option `cls` of `group` as its YAML composes it (a group's schema: its defaults)."""
    if group not in ("loss", "draft"):
        return cls()
    name = cls().name
    if name not in _OPTIONS:
        _OPTIONS[name] = OmegaConf.to_object(composed(f"{group}={name}")[group])
    return _OPTIONS[name]


def refusal(group: str, cls: type, field: str, value) -> str | None:
    """The message that refuses `group.field = value` when the config loads (None: it loads)."""
    try:
        check_run(Config(**{group: dataclasses.replace(_default(group, cls), **{field: value})}))
    except ConfigError as e:
        return str(e)
    return None


FLOATS = list(_fields(float))


@pytest.mark.parametrize("value", [1e39, -1e39, 1e-39])
@pytest.mark.parametrize(("prefix", "group", "cls", "field"), FLOATS, ids=[f"{p}{f}" for p, _, _, f in FLOATS])
def test_every_float_option_is_checked_in_float32(prefix, group, cls, field, value):
    """A value float32 cannot hold (it overflows, or rounds to 0 / a subnormal) is refused,
    naming the key, when the config loads, not in the middle of the run."""
    assert refusal(group, cls, field, value) == f"{prefix}{field} {FLOAT32_RANGE}, got {value}"


# chunk sizes: a chunk holds at most the rows it chunks, so a larger value allocates nothing more
# (measured: 1e12 runs as one chunk); run.steps: bounded with run.seed below (run.sft_steps by run.steps)
UNBOUNDED = {"chunk_size", "token_chunk_size", "steps"}
INTS = [(p, g, c, f) for p, g, c, f in _fields(int) if f not in UNBOUNDED]


@pytest.mark.parametrize(("prefix", "group", "cls", "field"), INTS, ids=[f"{p}{f}" for p, _, _, f in INTS])
def test_every_size_has_an_upper_bound_that_names_the_key(prefix, group, cls, field):
    """10**15 of any size is refused when the config loads, naming the key — by a bound from
    the data, the model, the vocabulary, the machine's memory or the sampler's seed."""
    message = refusal(group, cls, field, 10**15)
    key = f"{group}.{field}" if group not in ("loss", "draft") else field
    assert message is not None and key in message, message


def test_the_sizes_without_a_bound_of_their_own():
    """Chunk sizes above the micro-batch load (one chunk); run.steps is bounded by the
    sampler's 64-bit seed with run.seed, and every int by int64."""
    assert all(refusal(g, c, f, 10**15) is None for _, g, c, f in _fields(int) if f in UNBOUNDED)
    assert (
        refusal("run", RunConfig, "steps", 2**63)
        == "run.steps must fit in int64 (|x| < 2**63), got 9223372036854775808"
    )


class TestBounds(TestCase):
    def test_float_options_out_of_float32(self):
        self.assertExpectedInline(
            error("loss=mpo", "loss.reward_shift=1e39"),
            """loss=mpo: reward_shift must be 0 or of magnitude in [1.1754944e-38, 3.4028235e+38] (float32, the dtype the losses and the model compute in), got 1e+39""",
        )
        self.assertExpectedInline(
            error("loss=mpo", "loss.reward_shift=3e38"),
            """loss.reward_shift=3e+38: the BCO term sums about |reward_shift| per row of a micro-batch in float32, which overflows for the 64 rows of the longest one (64 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 112 tokens (the longest sequence padded to packing.pad_to_multiple)); |loss.reward_shift| must be <= 5.317e+36""",
        )

    def test_a_temperature_whose_reciprocal_overflows_the_gradient(self):
        self.assertExpectedInline(
            error("logprob.temperature=1e-30"),
            """logprob.temperature=1e-30 is outside [1e-06, 1e+06]: the logits and their gradient are scaled by 1/temperature, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("logprob.temperature=1e30"),
            """logprob.temperature=1e+30 is outside [1e-06, 1e+06]: the logits and their gradient are scaled by 1/temperature, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("loss=cross_tokenizer", "loss.temperature=1e-7"),
            """loss=cross_tokenizer: temperature=1e-07 is outside [1e-06, 1e+06]: the logits are scaled by 1/temperature and the KD term's gradient by temperature, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )

    def test_factors_of_the_gradient(self):
        self.assertExpectedInline(
            error("loss.reference_policy_kl_penalty=1e30"),
            """loss=clipped_pg: reference_policy_kl_penalty=1e+30 is outside [1e-06, 1e+06]: it scales the reference KL term, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("loss=dpo", "loss.reference_policy_kl_penalty=1e-30"),
            """loss=dpo: reference_policy_kl_penalty=1e-30 is outside [1e-06, 1e+06]: it scales the loss's gradient, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("loss=mse_value", "loss.scale=1e7"),
            """loss=mse_value: scale=10000000.0 is outside [1e-06, 1e+06]: it scales the loss's gradient, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.loss_weight=1e7"),
            """draft=eagle3: loss_weight=10000000.0 is outside [1e-06, 1e+06]: it scales the draft loss, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )
        self.assertExpectedInline(
            error("optim.grad_clip=1e-30"),
            """optim.grad_clip=1e-30 is outside [1e-06, 1e+06]: the gradient is scaled to at most this norm, and float32 squares of the gradient overflow (grad_norm inf, no update) or vanish outside that range""",
        )

    def test_exponents(self):
        self.assertExpectedInline(
            error("loss.kl_input_clamp_value=100"),
            """loss=clipped_pg: kl_input_clamp_value must be <= log(float32 max) = 88.7228, got 100.0: the k3 estimator exponentiates the clamped log-ratio, and exp of a larger value overflows float32 to inf""",
        )
        self.assertExpectedInline(
            error("draft=dflash", "draft.loss_decay_gamma=0.001"),
            """draft=dflash: loss_decay_gamma must be 0 or >= 0.03435 (with block_size=5), got 0.001: slot k is weighted exp(-(k-1)/loss_decay_gamma), which underflows float32 (< 1.18e-38) for the block's last slots below that, so they would train nothing""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.ttt_step_loss_decay=1e-20"),
            """draft=eagle3: ttt_step_loss_decay=1e-20 with ttt_steps=3: the last step's loss weight decay^2 = 1e-40 underflows float32 (< 1.18e-38), so that step would train nothing; raise ttt_step_loss_decay or lower ttt_steps""",
        )
        self.assertExpectedInline(
            error("loss=cross_tokenizer", "loss.alpha=1e7"),
            """loss=cross_tokenizer: alpha must be <= 1e+06, got 10000000.0: softmax(alpha · score) is one-hot for scores 1e-4 apart already, and a larger alpha can overflow alpha · score in float32 (NaN teacher weights)""",
        )

    def test_adamw_step_and_weight_decay(self):
        self.assertExpectedInline(
            error("optim.lr=1e38"),
            """optim.lr=1e+38 with optim.beta1=0.9: AdamW's first step size lr / (1 - beta1) = 1e+39 overflows float32""",
        )
        self.assertExpectedInline(
            error("optim.weight_decay=1e30"),
            """optim.lr × optim.weight_decay = 5e+26 must be < 1: decoupled weight decay multiplies every weight by 1 - lr · weight_decay per step, which zeroes or flips the weights at 1 and above""",
        )

    def test_sizes_against_the_data(self):
        self.assertExpectedInline(
            error("draft=dflash", "draft.num_anchors=1000000000000"),
            """draft.num_anchors=1000000000000 exceeds 7168, the tokens of the longest micro-batch (64 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 112 tokens (the longest sequence padded to packing.pad_to_multiple)): anchors are positions of one micro-batch""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.ttt_steps=100000", "draft.ttt_step_loss_decay=1"),
            """draft.ttt_steps=100000 exceeds 104: step k predicts the token k + 2 places after its slot inside one sequence, and the longest sequence the data can produce holds 106 tokens (data.prompt_terms_max + data.response_max + 2)""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.ttt_steps=100000"),
            """draft=eagle3: ttt_step_loss_decay=0.8 with ttt_steps=100000: the last step's loss weight decay^99999 = 0 underflows float32 (< 1.18e-38), so that step would train nothing; raise ttt_step_loss_decay or lower ttt_steps""",
        )
        self.assertExpectedInline(
            error("draft=dflash", "draft.block_size=200", "draft.loss_decay_gamma=0"),
            """draft.block_size=200 exceeds 106: a block's slots lie inside one sequence, and the longest sequence the data can produce holds 106 tokens (data.prompt_terms_max + data.response_max + 2)""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.hidden_size=64"),
            """draft.hidden_size=64 must be null or model.hidden_size=128: the EAGLE-3 drafter takes the policy's token embedding (frozen)""",
        )
        self.assertExpectedInline(
            error("draft=eagle3", "draft.draft_vocab_size=4096"),
            """draft.draft_vocab_size=4096 exceeds model.vocab_size=2048: the draft vocabulary is a subset of the policy's""",
        )
        self.assertExpectedInline(
            error("logprob.top_k=4096"),
            """logprob.top_k=4096 exceeds model.vocab_size=2048: a top-k of the whole vocabulary filters nothing (null disables the filter)""",
        )
        self.assertExpectedInline(
            error("packing.per_octave=10000"),
            """packing.per_octave=10000 exceeds 7168, the tokens of the longest micro-batch (64 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 112 tokens (the longest sequence padded to packing.pad_to_multiple)): with as many buckets per octave as the sizes it splits, the grid is the plain one (packing.per_octave=0)""",
        )
        self.assertExpectedInline(
            error("run.log_every=1000"),
            """run.log_every=1000 exceeds run.steps=177: a larger value logs the last step's line only, as run.log_every=177 does""",
        )
        self.assertExpectedInline(
            error("data.max_stride=65"),
            """data.max_stride (65) must be <= data.modulus (64): a stride d + modulus continues a progression as the stride d does""",
        )

    def test_sizes_against_the_machine(self):
        with unittest.mock.patch("compiled_loss.app.store.memory_bytes", return_value=2**30):
            self.assertExpectedInline(
                error("model.hidden_size=2048"),
                """the run needs at least 3.02 GiB of memory, this machine has 1 GiB: the policy's weights, gradients, reference and AdamW moments (111,159,296 parameters of model.vocab_size, model.hidden_size, model.num_layers, model.mlp_ratio, model.max_positions × 7): 2.9 GiB; the longest micro-batch's attention mask (1 × 8192² bools: its tokens rounded up to packing.tokens): 0.0625 GiB; the longest micro-batch's float32 logits (8192 slots × model.vocab_size): 0.0625 GiB; the longest micro-batch's token ids (64 × 128 int64: its rows rounded up to packing.rows, its longest sequence to packing.width): 6.1e-05 GiB (the longest micro-batch: 64 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 112 tokens (the longest sequence padded to packing.pad_to_multiple))""",
            )
            self.assertExpectedInline(
                error("packing=none", "packing.rows=100000"),
                """the run needs at least 99.3 GiB of memory, this machine has 1 GiB: the longest micro-batch's float32 logits (12800000 slots × model.vocab_size): 97.7 GiB; the longest micro-batch's attention mask (100000 × 128² bools): 1.53 GiB; the longest micro-batch's token ids (100000 × 128 int64: its rows rounded up to packing.rows, its longest sequence to packing.width): 0.0954 GiB; the policy's weights, gradients, reference and AdamW moments (1,049,216 parameters of model.vocab_size, model.hidden_size, model.num_layers, model.mlp_ratio, model.max_positions × 7): 0.0274 GiB (the longest micro-batch: 64 rows (data.prompts × data.group_size / parallel.dp / parallel.dp_shard / run.micro_batches, rounded up) × 112 tokens (the longest sequence padded to packing.pad_to_multiple))""",
            )
        self.assertExpectedInline(
            error("model.hidden_size=1000000000000"),
            """model.vocab_size, model.hidden_size, model.num_layers, model.mlp_ratio, model.max_positions: a weight would have more elements than an int64 counts (Storage size calculation overflowed with sizes=[1000000000000, 1000000000000])""",
        )

    def test_seed_and_steps_against_the_sampler(self):
        self.assertExpectedInline(
            error("run.seed=100000000000000"),
            """run.seed=100000000000000 overflows the sampler's generator seed at step 1 of run.steps (Overflow when unpacking long long): the seed of step s is run.seed × 1,000,003 + s, at most 64 bits""",
        )
        self.assertExpectedInline(
            error("run.seed=18446744073709"),
            """run.seed=18446744073709 overflows the sampler's generator seed at step 1 of run.steps (Overflow when unpacking long long): the seed of step s is run.seed × 1,000,003 + s, at most 64 bits""",
        )

    def test_cross_tokenizer_runs_at_tp_cp_1(self):
        self.assertExpectedInline(
            error("loss=cross_tokenizer", "parallel.tp=2"),
            """loss=cross_tokenizer reads whole student and teacher distributions: it runs at parallel.tp = parallel.cp = 1 (as NeMo-RL's does), got parallel.tp=2, parallel.cp=1""",
        )
