"""What the supported torch releases (2.11 through the newest) differ on, gated by version:
torch 2.11's Dynamo drops the gradient of a collective inside an autograd.Function under
compile.backend=eager, so that combination is refused when the config loads there, naming
the version; every later release accepts it."""

from __future__ import annotations

import pytest
import torch

from compiled_loss.app import compose_config
from compiled_loss.checks import ConfigError

TORCH_2_11 = torch.__version__ < "2.12"


@pytest.mark.parametrize("sizes", [("parallel.tp=2",), ("parallel.cp=2",), ("parallel.tp=2", "parallel.cp=2")])
def test_eager_backend_with_tp_or_cp(sizes):
    overrides = ("compile.backend=eager", *sizes, "data.prompts=2", "data.group_size=2", "packing.pad_to_multiple=8")
    if not TORCH_2_11:
        cfg = compose_config(*overrides)
        assert (cfg.compile.backend, cfg.parallel.tp * cfg.parallel.cp) == ("eager", 2 ** len(sizes))
        return
    with pytest.raises(ConfigError) as e:
        compose_config(*overrides)
    tp, cp = ("2" if f"parallel.{k}=2" in sizes else "1" for k in ("tp", "cp"))
    assert str(e.value) == (
        f"compile.backend=eager with parallel.tp={tp}, parallel.cp={cp} is refused on torch {torch.__version__}: "
        "torch 2.11's Dynamo drops the gradient of a collective inside an autograd.Function under the eager "
        "backend (the gradients come out zero, with no error); use compile.backend=aot_eager or inductor"
    )


@pytest.mark.parametrize("overrides", [("compile.backend=aot_eager", "parallel.tp=2"), ("compile.backend=eager",)])
def test_other_backends_and_one_process_load_on_every_release(overrides):
    assert compose_config(*overrides).compile.backend == overrides[0].split("=")[1]


def test_eager_step_with_tp_loads_when_compile_is_off():
    cfg = compose_config("compile.enabled=false", "compile.backend=eager", "parallel.tp=2")
    assert (cfg.compile.enabled, cfg.parallel.tp) == (False, 2)
