"""The runner's command line: a configuration error is one line with a did-you-mean and exit
status 2 (the traceback only under HYDRA_FULL_ERROR=1), `--help` shows each key's docstring,
the `grpo` / `dapo` aliases set what they say, and `Config(loss="…")` names the options."""

from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import sys
import typing

import pytest
from expecttest import TestCase
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from compiled_loss.app import compose_config
from compiled_loss.app.cli import check_overrides, fail, field_docs, help_text
from compiled_loss.app.store import GROUP_SCHEMAS
from compiled_loss.checks import ConfigError
from compiled_loss.config import DRAFT_KINDS, LOSS_KINDS, Config, RunConfig


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


# ---------------------------------------------------------------------------------------
# a value of the wrong type: one line naming the key, exit status 2, for every key
# ---------------------------------------------------------------------------------------


def _keys():
    """(option override or None, key, field type, default) of every key of every config group
    (every option class of `loss` and `draft`), from the config dataclasses."""
    groups = [f.name for f in dataclasses.fields(Config)]
    assert set(groups) == {"loss", "draft", *GROUP_SCHEMAS}  # every group has its schema(s)
    for group in groups:
        classes = (
            {"loss": LOSS_KINDS, "draft": DRAFT_KINDS}[group] if group in ("loss", "draft") else [GROUP_SCHEMAS[group]]
        )
        for cls in classes:
            option = f"{group}={cls().name}" if group in ("loss", "draft") else None
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if f.name != "name":
                    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    yield option, f"{group}.{f.name}", hints[f.name], default


def _split(hint):
    """(the type without None, whether None is one)."""
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return inner, True
    return hint, False


def _wrong(hint) -> list[str]:
    """Override values Hydra's merge refuses for a field of type `hint`."""
    inner, optional = _split(hint)
    null = [] if optional else ["null"]
    if typing.get_origin(inner) in (list, tuple):
        item = typing.get_args(inner)[0]
        return ["tensorboard" if item is str else "abc", *([] if item is str else ["[abc]"]), *null]
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return ["nope", "[x]", *null]
    return {
        bool: ["maybe", "[true]"],
        int: ["abc", "1e3", "1.5", "true"],
        float: ["abc", "[0.5]"],
        str: ["[a,b]", "{a:1}"],
    }[inner] + null  # a KeyError: a field type this grid does not know yet


def _rendered(value) -> str:
    """`value` written as an override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(_rendered, value))}]"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


KEYS = list(_keys())
WRONG = [(option, key, value) for option, key, hint, _ in KEYS for value in _wrong(hint)]


def _argv(option, *overrides):
    return [*([option] if option else []), *overrides]


@pytest.mark.parametrize(("option", "key", "value"), WRONG, ids=[f"{o or ''} {k}={v}".strip() for o, k, v in WRONG])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key_and_exit_status_2(capsys, option, key, value):
    with pytest.raises(ConfigError) as refused:
        check_overrides(_argv(option, f"{key}={value}"))
    with pytest.raises(SystemExit) as exited:
        fail(refused.value)  # what the runner does with it
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {key}: {value} is not a valid "), err


@pytest.mark.parametrize(
    ("option", "key", "hint", "default"), KEYS, ids=[f"{o or ''} {k}".strip() for o, k, _, _ in KEYS]
)
def test_every_key_takes_its_default(option, key, hint, default):
    check_overrides(_argv(option, f"{key}={_rendered(default)}"))  # no false refusal


_KINDS = {}
for _option, _key, _hint, _ in KEYS:  # one key of each field type
    _KINDS.setdefault(str(_hint), (_option, _key, _wrong(_hint)[0]))


@pytest.mark.parametrize(("option", "key", "value"), list(_KINDS.values()), ids=list(_KINDS))
def test_hydra_refuses_what_the_grid_calls_wrong(option, key, value):
    # the grid's values are ones Hydra's own merge refuses (its multi-line error, before check_overrides)
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        with pytest.raises(ConfigCompositionException):
            compose(config_name="config", overrides=_argv(option, f"{key}={value}"))


class TestValueMessages(TestCase):
    def _message(self, *argv: str) -> str:
        with pytest.raises(ConfigError) as refused:
            check_overrides(list(argv))
        return str(refused.value)

    def test_the_messages(self):
        self.assertExpectedInline(
            self._message("run.steps=1e3"), """run.steps: 1e3 is not a valid int (a whole number: run.steps=1000)"""
        )
        self.assertExpectedInline(
            self._message("run.loggers=tensorboard"),
            """run.loggers: tensorboard is not a valid list of strings (a list of strings in brackets: run.loggers=[tensorboard])""",
        )
        self.assertExpectedInline(
            self._message("run.speculative=maybe"), """run.speculative: maybe is not a valid bool (true or false)"""
        )
        self.assertExpectedInline(
            self._message("loss.ratio_clip_max=abc"),
            """loss.ratio_clip_max: abc is not a valid float (a number, like 0.5 or 1e-3)""",
        )
        self.assertExpectedInline(
            self._message("run.steps=null"),
            """run.steps: null is not a valid int (run.steps cannot be null; a whole number)""",
        )
        self.assertExpectedInline(
            self._message("loss=distillation", "loss.kl_type=jsd"),
            """loss.kl_type: jsd is not a valid KlType (one of forward, reverse, mixed)""",
        )
        self.assertExpectedInline(
            self._message("compile.dynamic=maybe"),
            """compile.dynamic: maybe is not a valid bool or null (true or false)""",
        )
        self.assertExpectedInline(
            self._message("model.dtype=[a]"),
            """model.dtype: [a] is not a valid string (text; quote one that holds brackets, braces or commas)""",
        )
        self.assertExpectedInline(
            self._message("-m", "run.steps=1,x"), """run.steps: x is not a valid int (a whole number)"""
        )
        self.assertExpectedInline(
            self._message("++run.steps=abc"), """run.steps: abc is not a valid int (a whole number)"""
        )

    def test_what_hydra_cannot_parse_or_calls_ambiguous(self):
        self.assertExpectedInline(
            self._message("run.steps=[1,"),
            """run.steps: [1, is not a valid value (Hydra's override grammar: no viable alternative at input '[1,')""",
        )
        self.assertExpectedInline(
            self._message("run.steps=1,2"),
            """run.steps: 1,2 is a sweep, which runs with -m (--multirun); a list is written run.steps=[1,2], text quoted: run.steps='1,2'""",
        )
        self.assertExpectedInline(
            self._message("loss=dpo,nll"), """loss=dpo,nll: a sweep over loss options runs with -m (--multirun)"""
        )

    def test_what_passes(self):
        for argv in (
            ["run.steps='7'"],  # OmegaConf converts it, as Hydra's merge does
            ["run.steps=${run.seed}"],  # an interpolation: load_config resolves and checks it
            ["-m", "run.steps=range(1,3)"],
            ["-m", "loss=dpo,clipped_pg", "loss.sft_loss_weight=0.5"],  # a key of one option of the sweep
            ["compile.dynamic=null", "run.resume=null", "run.loggers=[jsonl,tensorboard]"],
        ):
            check_overrides(argv)

    def test_an_interpolation_of_the_wrong_type_is_one_line_when_the_config_loads(self):
        with pytest.raises(ConfigError) as refused:
            compose_config("run.steps=${run.loggers}")
        self.assertExpectedInline(
            str(refused.value),
            """run.steps: While dereferencing interpolation '${run.loggers}': Value '['jsonl']' of type 'ListConfig' could not be converted to Integer""",
        )


@pytest.mark.slow  # four processes
def test_the_wrong_types_of_the_command_line_are_one_line_and_exit_status_2():
    for override, line in [
        ("run.steps=1e3", "error: run.steps: 1e3 is not a valid int (a whole number: run.steps=1000)"),
        (
            "run.loggers=tensorboard",
            "error: run.loggers: tensorboard is not a valid list of strings (a list of strings in brackets: "
            "run.loggers=[tensorboard])",
        ),
        ("run.speculative=maybe", "error: run.speculative: maybe is not a valid bool (true or false)"),
        (
            "loss.ratio_clip_max=abc",
            "error: loss.ratio_clip_max: abc is not a valid float (a number, like 0.5 or 1e-3)",
        ),
    ]:
        refused = _run(override)
        assert (refused.returncode, refused.stdout, refused.stderr.splitlines()) == (2, "", [line]), override
