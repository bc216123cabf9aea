"""pytest plugin: Liger-Kernel's own chunked-loss tests, run from its source distribution,
against compiled_loss's Liger front-ends (`compiled_loss.integrations.liger`).

Load it with `-p liger_plugin` (this folder on `sys.path`) from the root of an unpacked
`liger_kernel-<version>` sdist; `tools/liger_tests/run.py` does all of that. Options:

- `--liger-target=ours` (default): before the test modules import them, Liger's module
  classes (`liger_kernel.chunked_loss.LigerFusedLinear*Loss`, each name in `MODULES`) and
  functional aliases (`liger_kernel.chunked_loss.functional.liger_fused_linear_*`, each name
  in `FUNCTIONALS`) are replaced by this library's modules. Everything else stays Liger's:
  the tests' torch references (`TorchLMHead*`, `HF*Loss`) are the oracle of the module
  tests, and Liger's own `LigerFused*Function.apply` the oracle of the functional ones. A
  test that stops on one of the front-end's refusals by name (`RefusedOption`, whose
  option is listed in `REFUSED_OPTIONS`) is reported as xfail with the refusal as reason;
  any other error is a failure.
- `--liger-target=liger`: nothing is replaced (the real Liger, for the baseline counts).
- `--liger-compiled=as-passed` (default) or `eager`: with `eager`, this library's modules are
  built with `compiled=False` whatever the test passes (the objective's numbers are the
  same code; compiling is tested by the project's own suite).

Stubs, so that the tests import on a machine without Triton (`--liger-target` either way):

- `liger_kernel.transformers` is a bare package: its `__init__` imports every Triton kernel.
  Its submodules load from their files as usual.
- `liger_kernel.ops` and `liger_kernel.ops.grpo_loss` hold only the two names that
  `liger_kernel/transformers/grpo_loss.py` imports at its top (`GrpoLossFunction`,
  `fused_selective_log_softmax`); calling either raises. Only `triton_grpo_loss` calls
  them, and its test skips itself without Triton (`pytest.importorskip("triton")`). The
  test file imports `_reduce_grpo_loss` from that module, which is plain torch.

A JSON summary (`--liger-summary=PATH`) records every test's outcome: passed, refused (by
name), failed, skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

MODULES: dict[str, str | None] = {
    "LigerFusedLinearGRPOLoss": "FusedLinearGRPOLoss",
    "LigerFusedLinearDPOLoss": "FusedLinearDPOLoss",
    "LigerFusedLinearJSDLoss": "FusedLinearJSDLoss",
    # No front-end here: these tests are not run (run.py's TEST_FILES).
    "LigerFusedLinearCosineSimilarityLoss": None,
    "LigerFusedLinearCPOLoss": None,
    "LigerFusedLinearKTOLoss": None,
    "LigerFusedLinearORPOLoss": None,
    "LigerFusedLinearSimPOLoss": None,
}
"""Every `LigerFusedLinear*` class `liger_kernel.chunked_loss` exports: this library's module
that replaces it, or None where it has none."""

FUNCTIONALS: dict[str, tuple[str, str]] = {
    "liger_fused_linear_grpo": ("LigerFusedLinearGRPOFunction", "FusedLinearGRPOLoss"),
    "liger_fused_linear_dpo": ("LigerFusedLinearDPOFunction", "FusedLinearDPOLoss"),
    "liger_fused_linear_jsd": ("LigerFusedLinearJSDFunction", "FusedLinearJSDLoss"),
}
"""`liger_kernel.chunked_loss.functional` alias: (the Liger autograd Function whose positional
signature it has, this library's module computing it)."""

_RENAMED = {"weight": "lin_weight"}
"""A Function's argument name -> the module forward's, where they differ."""


INTERNAL = frozenset(
    {
        "test_grpo_loss.py::test_selective_chunk_forward_matches_reference",
        "test_grpo_loss.py::test_selective_logprob_backward_skips_frozen_params",
        "test_grpo_loss.py::test_reduce_grpo_loss_matches_reference",
        "test_grpo_loss.py::test_reduce_grpo_loss_requires_max_completion_length",
        "test_grpo_loss.py::test_triton_grpo_loss_matches_reference",
    }
)
"""Tests of Liger's own internals (its chunked log-prob, its loss reduction, its Triton loss):
they call no name this plugin swaps, so they run Liger's code against either target."""

LARGE_SHAPE = "8-128-1024-4096"
"""The large `B-T-H-V` of Liger's parametrized correctness tests (the small ones are 3-47-31-123,
2-2-8-8 and 9-7-41-41)."""

CI_SUBSET = (
    "every case, but Liger's large shape (B, T, H, V = 8, 128, 1024, 4096) in fp32 with a bias only (not in "
    "bf16 nor without a bias)"
)
"""`--liger-ci-subset`: the rule of `in_ci_subset`."""


def in_ci_subset(nodeid: str) -> bool:
    """`CI_SUBSET`. A large-shape id ends `...-<bias>-<scalar>-dtype<i>-<atol>-<rtol>-8-128-1024-4096]`;
    `dtype1` is fp32 in each such parametrization (`(1.0, torch.bfloat16, ...), (1.0,
    torch.float32, ...)`)."""
    if not nodeid.endswith(f"-{LARGE_SHAPE}]"):
        return True
    parts = nodeid.rsplit("[", 1)[1][: -len(LARGE_SHAPE) - 2].split("-")
    return parts[-3] == "dtype1" and parts[-5] == "True"


def _short(nodeid: str) -> str:
    """`test_x.py::test_y` of a node id."""
    return nodeid.split("[", 1)[0].rsplit("/", 1)[-1]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("liger", "Liger-Kernel's tests against compiled_loss")
    group.addoption("--liger-target", choices=("ours", "liger"), default="ours")
    group.addoption("--liger-compiled", choices=("as-passed", "eager"), default="as-passed")
    group.addoption("--liger-ci-subset", action="store_true", help=CI_SUBSET)
    group.addoption("--liger-summary", default=None, help="write every test's outcome here (JSON)")


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _needs_triton(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} needs Triton (stubbed by liger_plugin)")

    return call


def install_stubs() -> None:
    """The stubs the module docstring lists (idempotent)."""
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("liger_plugin: liger_kernel is not importable")
    root = list(spec.submodule_search_locations)[0]
    if "liger_kernel.transformers" not in sys.modules:
        package = _stub("liger_kernel.transformers")
        package.__path__ = [f"{root}/transformers"]
    if "liger_kernel.ops" not in sys.modules:
        ops = _stub("liger_kernel.ops", GrpoLossFunction=_needs_triton("liger_kernel.ops.GrpoLossFunction"))
        ops.__path__ = []
        _stub(
            "liger_kernel.ops.grpo_loss",
            fused_selective_log_softmax=_needs_triton("liger_kernel.ops.grpo_loss.fused_selective_log_softmax"),
        )


def _eager(cls: type) -> type:
    """`cls` built with `compiled=False`, whatever the caller passes."""

    class Eager(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = inspect.signature(cls.__init__).bind(self, *args, **kwargs)
            bound.arguments["compiled"] = False
            super().__init__(*bound.args[1:], **bound.kwargs)

    Eager.__init__.__signature__ = inspect.signature(cls.__init__)
    Eager.__name__ = Eager.__qualname__ = cls.__name__
    return Eager


def functional(function: type, module: type) -> Callable[..., Any]:
    """A Liger functional alias (`function.apply`'s positional signature) computed by `module`:
    each argument goes to the module's constructor or its forward, by name."""
    signature = inspect.signature(function.forward)
    parameters = [p for name, p in signature.parameters.items() if name not in ("cls", "ctx")]
    signature = signature.replace(parameters=parameters)
    init = set(inspect.signature(module.__init__).parameters) - {"self"}
    forward = set(inspect.signature(module.forward).parameters) - {"self"}

    def apply(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        built, called = {}, {}
        for name, value in bound.arguments.items():
            target = _RENAMED.get(name, name)
            if target in forward:
                called[target] = value
            elif target in init:
                built[target] = value
            else:
                raise TypeError(f"liger_plugin: {module.__name__} takes no argument {name!r} of {function.__name__}")
        return module(**built)(**called)

    apply.__signature__ = signature
    apply.__name__ = function.__name__
    return apply


def swap_names(compiled: str) -> None:
    """Liger's module classes and functional aliases replaced by this library's (`MODULES`,
    `FUNCTIONALS`), in `liger_kernel.chunked_loss`, its submodules and `.functional`."""
    import liger_kernel.chunked_loss as chunked_loss
    import liger_kernel.chunked_loss.functional as liger_functional

    from compiled_loss.integrations import liger as ours

    for liger_name, our_name in MODULES.items():
        if our_name is None:
            continue
        cls = getattr(ours, our_name)
        cls = _eager(cls) if compiled == "eager" else cls
        original = getattr(chunked_loss, liger_name)
        for module in (chunked_loss, sys.modules[original.__module__]):
            setattr(module, liger_name, cls)
    for alias, (function_name, our_name) in FUNCTIONALS.items():
        function = getattr(liger_functional, function_name)
        cls = getattr(ours, our_name)
        cls = _eager(cls) if compiled == "eager" else cls
        setattr(liger_functional, alias, functional(function, cls))


def pytest_configure(config: pytest.Config) -> None:
    install_stubs()
    config._liger_target = config.getoption("--liger-target")
    config._liger_outcomes = {}
    if config._liger_target == "ours":
        swap_names(config.getoption("--liger-compiled"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--liger-ci-subset"):
        return
    kept = [item for item in items if in_ci_subset(item.nodeid)]
    config.hook.pytest_deselected(items=[item for item in items if not in_ci_subset(item.nodeid)])
    items[:] = kept


def named_refusal(exc: BaseException | None) -> BaseException | None:
    """The front-end's refusal by name that stopped a test: the exception itself, or the one
    a `pytest.raises(ValueError, match=...)` block got instead of the message it expected
    (the AssertionError pytest raises then has it as its context)."""
    from compiled_loss.integrations.liger import REFUSED_OPTIONS, RefusedOption

    for candidate in (exc, getattr(exc, "__context__", None) if isinstance(exc, AssertionError) else None):
        if isinstance(candidate, RefusedOption) and candidate.option in REFUSED_OPTIONS.get(candidate.who, ()):
            return candidate
    return None


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    try:
        return (yield)
    except Exception as exc:
        if pyfuncitem.config._liger_target == "ours" and (refusal := named_refusal(exc)) is not None:
            pyfuncitem.config._liger_outcomes[pyfuncitem.nodeid] = {
                "outcome": "refused",
                "refused": f"{refusal.who}.{refusal.option}",
            }
            pytest.xfail(f"refused by name: {refusal}")
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Each test's outcome: passed, refused (by name), skipped or failed (any failed phase)."""
    report = yield
    record = item.config._liger_outcomes.setdefault(item.nodeid, {"internal": _short(item.nodeid) in INTERNAL})
    record.setdefault("internal", _short(item.nodeid) in INTERNAL)
    if report.failed:
        record["outcome"] = "failed"
    elif report.skipped and record.get("outcome") != "refused":
        # an xfail that is not a refusal by name is a failure: Liger's tests mark none
        record["outcome"] = "failed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and report.passed:
        record["outcome"] = "passed"
    return report


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.getoption("--liger-summary", None)
    if path and hasattr(config, "_liger_outcomes"):
        with open(path, "w") as f:
            json.dump(config._liger_outcomes, f, indent=0, sort_keys=True)
