"""pytest plugin: verl's own CPU loss tests, run from its source distribution, against
`compiled_loss.integrations.verl`.

Load it with `-p verl_plugin` (this folder on `sys.path`) from the root of an unpacked
`verl-<version>` sdist, with the installed verl (`pip install --no-deps verl==<version>`) and
`--import-mode=importlib`, so the sdist's own `verl/` folder is never imported;
`tools/verl_tests/run.py` does all of that.

Before the test modules import them, `verl.trainer.ppo.core_algos`'s names are rebound to
this library's (`ROUTED`): `agg_loss` and `kl_penalty`, and the policy losses this library
computes (`compute_policy_loss_vanilla`, `_gspo`, `_cispo`, `_gpg`, `_bypass_mode`), which
also replace verl's registry entries (`register`). verl's own functions that call
`agg_loss` through the module (its value loss, entropy loss and the policy losses that stay
verl's, such as `dro`) then aggregate with this library's. Everything else stays verl's: its
advantage estimators, its rollout-correction helper and its configs.

Each routed name counts its calls per test, so the summary (`--verl-summary=PATH`, JSON)
records for every test its outcome (passed, failed, skipped) and the names of this library
it called: a test that called none ran verl's own code only.

`--verl-compiled`: how the policy losses compile (`PolicyLoss(compiled=...)`): `aot_eager`
(default), `inductor`, or `eager` (not compiled).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

LOSS_FUNCTIONS = {
    "vanilla": "compute_policy_loss_vanilla",
    "gspo": "compute_policy_loss_gspo",
    "cispo": "compute_policy_loss_cispo",
    "gpg": "compute_policy_loss_gpg",
    "bypass_mode": "compute_policy_loss_bypass_mode",
}
"""verl's registry name -> its `core_algos` function, for each loss this library computes."""

ROUTED = ("agg_loss", "kl_penalty", *LOSS_FUNCTIONS.values())
"""The `core_algos` names rebound to this library's."""

COMPILED = {"aot_eager": "aot_eager", "inductor": True, "eager": False}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("verl", "verl's tests against compiled_loss")
    group.addoption("--verl-compiled", choices=tuple(COMPILED), default="aot_eager")
    group.addoption("--verl-summary", default=None, help="write every test's outcome here (JSON)")


def _counted(config: pytest.Config, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (this library's), recording a call under `name` for the running test."""

    @functools.wraps(fn)
    def routed(*args: Any, **kwargs: Any) -> Any:
        config._verl_called.add(name)
        return fn(*args, **kwargs)

    routed.compiled_loss = fn
    return routed


def route(config: pytest.Config, compiled: bool | str) -> None:
    """Rebind `ROUTED` in `core_algos` and its registry to this library's (`register`)."""
    import verl
    from verl.trainer.ppo import core_algos

    from compiled_loss.integrations import verl as ours

    sdist = Path.cwd().resolve()
    if sdist in Path(verl.__file__).resolve().parents:
        raise RuntimeError(f"verl_plugin: verl imports from the sdist ({verl.__file__}); use --import-mode=importlib")
    ours.register(tuple(LOSS_FUNCTIONS), compiled=compiled)
    for name, function in LOSS_FUNCTIONS.items():
        routed = _counted(config, function, core_algos.POLICY_LOSS_REGISTRY[name])
        core_algos.POLICY_LOSS_REGISTRY[name] = routed
        setattr(core_algos, function, routed)
    core_algos.agg_loss = _counted(config, "agg_loss", ours.agg_loss)
    core_algos.kl_penalty = _counted(config, "kl_penalty", ours.kl_penalty)
    config._verl_location = verl.__file__


def pytest_configure(config: pytest.Config) -> None:
    config._verl_called = set()
    config._verl_outcomes = {}
    route(config, COMPILED[config.getoption("--verl-compiled")])


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config._verl_called.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Each test's outcome (any failed phase fails it) and the routed names it called."""
    report = yield
    record = item.config._verl_outcomes.setdefault(item.nodeid, {})
    if report.failed:
        record["outcome"] = "failed"
        record.setdefault("error", report.longreprtext.strip().splitlines()[-1] if report.longreprtext else "")
    elif report.skipped:
        record["outcome"] = "skipped"
    elif report.when == "call" and report.passed:
        record["outcome"] = "passed"
    record["called"] = sorted(item.config._verl_called)
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.getoption("--verl-summary", None)
    if path and hasattr(config, "_verl_outcomes"):
        summary = {"verl": getattr(config, "_verl_location", None), "tests": config._verl_outcomes}
        with open(path, "w") as f:
            json.dump(summary, f, indent=0, sort_keys=True)
