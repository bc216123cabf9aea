"""`save_compile_cache` / `load_compile_cache` and `run.compile_cache`: torch's portable
compile-cache artifacts and Inductor's C++ kernel libraries in one file behind a header that
names the setup they were compiled for; a fresh process (empty Inductor cache directories)
that loads them reads its graphs and kernels from them instead of compiling them. A missing
file loads nothing, a file for another setup is skipped with a warning, a file that is no
cache raises."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from common import TINY_TASK
from expecttest import TestCase
from tolerances import approx
from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, CacheInfo, _serialize_single_cache
from torch.utils._appending_byte_serializer import AppendingByteSerializer

from compiled_loss.app import compose_config
from compiled_loss.app.checkpoint import load_checkpoint, save_checkpoint
from compiled_loss.app.loop import build_run
from compiled_loss.checks import ConfigError
from compiled_loss.compile import _options, compile_cache_fingerprint, load_compile_cache, save_compile_cache
from compiled_loss.config import RunConfig
from compiled_loss.train.parallel import init_parallel


@pytest.fixture(autouse=True)
def _options_restored():
    """`load_compile_cache` sets Inductor options for the whole process: this test process's
    other compiles keep theirs."""
    before = [(module, option, getattr(module, option)) for module, option, _ in _options()]
    yield
    for module, option, value in before:
        setattr(module, option, value)


_PROBE = "pr/cprobe.so"  # where Inductor keeps a vector-ISA probe library


def _artifacts(monkeypatch, tmp_path: Path, **keys: list[str]) -> list[bytes]:
    """Stand torch's artifact calls in for a process that compiled the Inductor graphs `keys`
    (kind -> cache keys; none: nothing compiled), with an Inductor cache directory of its own
    that holds an ISA probe library and a kernel library the process has not loaded; the
    list collects the payloads loaded."""
    inductor = tmp_path / f"inductor{len(list(tmp_path.glob('inductor*')))}"
    for name, data in ((_PROBE, b"\x7fELF probe"), ("ke/ckernel.main.so", b"\x7fELF not loaded here")):
        (inductor / name).parent.mkdir(parents=True, exist_ok=True)
        (inductor / name).write_bytes(data)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    CacheArtifactManager._ensure_cache_artifacts_registered()
    info, serializer = CacheInfo(), AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    for kind, names in keys.items():
        info.artifacts[kind].extend(names)
        serializer.append((kind, [CacheArtifactFactory.create(kind, name, f"graph {name}".encode()) for name in names]))
    saved = (serializer.to_bytes(), info) if keys else None
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: saved)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or CacheInfo())
    assert load_compile_cache(tmp_path / "no such file") is False  # how a process starts: it sets the options
    return loaded


_MAGIC = b"compiled_loss compile cache 3\n"


def _batches(path: Path) -> list[bytes]:
    """The artifact batches in the file at `path`, as torch reads each."""
    data = path.read_bytes()
    offset, batches = data.index(b"\n", len(_MAGIC)) + 1, []
    for _, size, _ in _header(path)["artifact_batches"]:
        batches.append(data[offset : offset + size])
        offset += size
    return batches


def _payload(path: Path) -> dict[str, list[tuple[str, bytes]]]:
    """The artifacts (kind -> key, content) in the file at `path`."""
    found = {}
    for batch in _batches(path):
        ((kind, artifacts),) = CacheArtifactManager.deserialize(batch).items()  # one kind a batch
        found[kind] = [(a.key, a.content) for a in artifacts]
    return found


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        assert f.readline() == _MAGIC
        return json.loads(f.readline())


def test_a_missing_file_loads_nothing(monkeypatch, tmp_path):
    loaded = _artifacts(monkeypatch, tmp_path)
    assert load_compile_cache(tmp_path / "absent.bin") is False
    assert loaded == []


def test_nothing_compiled_writes_nothing(monkeypatch, tmp_path):
    _artifacts(monkeypatch, tmp_path)
    assert save_compile_cache(tmp_path / "cache.bin") is False
    assert not (tmp_path / "cache.bin").exists()


def test_save_writes_the_artifacts_behind_a_header_and_load_hands_them_to_torch(monkeypatch, tmp_path):
    path = tmp_path / "deep" / "er" / "cache.bin"
    _artifacts(monkeypatch, tmp_path, inductor=["fx2", "fx1"], aot_autograd=["aot"])
    assert save_compile_cache(path) is True  # parent directories created
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache.bin"]  # no temporary file left
    batches = _batches(path)
    assert _header(path) == {
        **compile_cache_fingerprint(),
        "bytes": sum(map(len, batches)) + len(b"\x7fELF probe"),
        "artifacts": {"inductor": ["fx1", "fx2"], "aot_autograd": ["aot"]},
        "artifact_batches": [
            [kind, len(batch), _sha256(batch)] for kind, batch in zip(("inductor", "aot_autograd"), batches)
        ],
        "kernels": [[_PROBE, len(b"\x7fELF probe"), _sha256(b"\x7fELF probe")]],  # not the library it has not loaded
    }
    assert _payload(path) == {
        "inductor": [("fx2", b"graph fx2"), ("fx1", b"graph fx1")],
        "aot_autograd": [("aot", b"graph aot")],
    }
    loaded = _artifacts(monkeypatch, tmp_path)  # another machine: its Inductor cache directory lacks the probe
    fresh = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    (fresh / _PROBE).unlink()
    assert load_compile_cache(path) is True
    assert loaded == batches
    assert (fresh / _PROBE).read_bytes() == b"\x7fELF probe" and os.access(fresh / _PROBE, os.X_OK)
    assert [(module, option, getattr(module, option)) for module, option, _ in _options()] == _options()


def test_the_kernel_libraries_the_process_loaded_travel(monkeypatch, tmp_path):
    # a kernel compiled by this process and loaded from Inductor's cache directory
    _artifacts(monkeypatch, tmp_path, inductor=["fx1"])
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    kernel = inductor / "ke" / "ckernel.main.so"
    subprocess.run(["cc", "-shared", "-o", str(kernel), "-x", "c", "-"], input=b"int k(void){return 3;}", check=True)
    ctypes.CDLL(str(kernel))
    path = tmp_path / "cache.bin"
    assert save_compile_cache(path) is True
    assert [name for name, _, _ in _header(path)["kernels"]] == ["ke/ckernel.main.so", _PROBE]
    _artifacts(monkeypatch, tmp_path)
    fresh = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    (fresh / "ke" / "ckernel.main.so").unlink()
    assert load_compile_cache(path) is True
    assert (fresh / "ke" / "ckernel.main.so").read_bytes() == kernel.read_bytes()


def test_the_batches_of_several_saves_in_one_process_reach_the_file_as_one_per_kind(monkeypatch, tmp_path):
    # a process that saved after each of two steps: torch returns one batch per save and kind,
    # of which its loader keeps the last per kind; the file holds both steps' graphs
    path = tmp_path / "cache.bin"
    CacheArtifactManager._ensure_cache_artifacts_registered()
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    for kind, name in (("inductor", "fx1"), ("aot_autograd", "aot1"), ("inductor", "fx2")):
        serializer.append((kind, [CacheArtifactFactory.create(kind, name, name.encode())]))
    info = CacheInfo()
    info.artifacts.update(inductor=["fx1", "fx2"], aot_autograd=["aot1"])
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (serializer.to_bytes(), info))
    assert save_compile_cache(path) is True
    assert _payload(path) == {"inductor": [("fx1", b"fx1"), ("fx2", b"fx2")], "aot_autograd": [("aot1", b"aot1")]}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=lambda umask: f"umask {umask:03o}")
def test_the_file_gets_the_mode_open_gives_and_the_kernel_libraries_0755(monkeypatch, tmp_path, umask):
    # a shared cache: workers running as other users read what rank 0 wrote, as umask allows
    path = tmp_path / "cache.bin"
    _artifacts(monkeypatch, tmp_path, inductor=["fx1"])
    before = os.umask(umask)
    try:
        assert save_compile_cache(path) is True
        _artifacts(monkeypatch, tmp_path)
        fresh = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        (fresh / _PROBE).unlink()
        assert load_compile_cache(path) is True
    finally:
        os.umask(before)
    assert (path.stat().st_mode & 0o777, (fresh / _PROBE).stat().st_mode & 0o777) == (0o666 & ~umask, 0o755)


def test_save_leaves_a_file_that_holds_every_artifact_and_rewrites_one_that_lacks_some(monkeypatch, tmp_path):
    path = tmp_path / "cache.bin"
    _artifacts(monkeypatch, tmp_path, inductor=["fx1", "fx2"])
    assert save_compile_cache(path) is True
    _artifacts(monkeypatch, tmp_path, inductor=["fx2"])  # a process that loaded it and compiled nothing new
    assert save_compile_cache(path) is False
    assert [key for key, _ in _payload(path)["inductor"]] == ["fx1", "fx2"]
    _artifacts(monkeypatch, tmp_path, inductor=["fx2", "fx3"])  # one graph the file lacks
    assert save_compile_cache(path) is True
    assert _header(path)["artifacts"] == {"inductor": ["fx2", "fx3"]}


class TestRefusals(TestCase):
    @pytest.fixture(autouse=True)
    def _setup(self, monkeypatch, tmp_path):
        self.path = tmp_path / "cache.bin"
        _artifacts(monkeypatch, tmp_path, inductor=["fx1"])
        assert save_compile_cache(self.path)
        self.loaded = _artifacts(monkeypatch, tmp_path)

    def _error(self) -> str:
        with pytest.raises(ValueError) as info:
            load_compile_cache(self.path)
        assert self.loaded == []
        return str(info.value).replace(str(self.path), "PATH")

    def _warning(self) -> str:
        """The warning of a file skipped with nothing loaded."""
        with pytest.warns(UserWarning) as caught:
            assert load_compile_cache(self.path) is False
        assert self.loaded == []
        return str(caught[0].message).replace(str(self.path), "PATH")

    def test_a_file_for_another_setup_is_skipped_with_a_warning_naming_what_differs(self):
        data = self.path.read_bytes()
        self.path.write_bytes(data.replace(f'"torch": "{torch.__version__}"'.encode(), b'"torch": "2.12.0"'))
        self.assertExpectedInline(
            self._warning().replace(torch.__version__, "VERSION"),
            """compile cache PATH not loaded: written for another setup (torch '2.12.0', here 'VERSION'); everything compiles anew""",
        )

    def test_a_file_saved_without_loading_first_is_skipped_with_a_warning(self):
        ours = " ".join(f"{option}={value}" for _, option, value in _options())
        theirs = " ".join(f"{option}={not value}" for _, option, value in _options())  # torch's defaults
        assert compile_cache_fingerprint()["options"] == ours
        self.path.write_bytes(self.path.read_bytes().replace(ours.encode(), theirs.encode()))
        self.assertExpectedInline(
            self._warning(),
            """compile cache PATH not loaded: written for another setup (options 'cpp_cache_precompile_headers=True autograd_cache_allow_custom_autograd_functions=False', here 'cpp_cache_precompile_headers=False autograd_cache_allow_custom_autograd_functions=True'); everything compiles anew""",
        )

    def test_a_file_another_version_wrote_is_skipped_with_a_warning(self):
        self.path.write_bytes(self.path.read_bytes().replace(_MAGIC, b"compiled_loss compile cache 2\n"))
        self.assertExpectedInline(
            self._warning(),
            """compile cache PATH not loaded: another version of compiled_loss wrote it ('compiled_loss compile cache 2', here 'compiled_loss compile cache 3'); everything compiles anew""",
        )

    def test_a_kernel_outside_the_cache_directory_raises(self):
        self.path.write_bytes(self.path.read_bytes().replace(_PROBE.encode(), b"../probe.so"))
        self.assertExpectedInline(
            self._error(), """compile cache PATH: it is truncated or corrupt (save_compile_cache writes one)"""
        )

    def test_a_kernel_library_corrupt_at_its_length_is_refused_before_anything_is_loaded(self):
        # a library damaged in place: the file's sizes all hold, its sha256 does not; neither
        # torch nor Inductor's cache directory gets anything (the artifacts are intact)
        fresh = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        (fresh / _PROBE).unlink()
        data = self.path.read_bytes()
        assert data.endswith(b"\x7fELF probe")
        self.path.write_bytes(data[:-5] + b"PROBE")
        self.assertExpectedInline(
            self._error(),
            """compile cache PATH: kernel library 'pr/cprobe.so' fails its sha256 check (corrupt); nothing loaded""",
        )
        assert not (fresh / _PROBE).exists()

    def test_a_corrupt_artifact_batch_is_refused_before_anything_is_loaded(self):
        fresh = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        (fresh / _PROBE).unlink()
        data = self.path.read_bytes()
        assert data.count(b"graph fx1") == 1
        self.path.write_bytes(data.replace(b"graph fx1", b"graph fx9"))
        self.assertExpectedInline(
            self._error(),
            """compile cache PATH: artifact batch 'inductor' fails its sha256 check (corrupt); nothing loaded""",
        )
        assert not (fresh / _PROBE).exists()

    def test_a_header_without_checksums_raises(self):
        header = _header(self.path)
        data = self.path.read_bytes()
        start = data.index(b"\n", len(_MAGIC)) + 1
        header["kernels"] = [entry[:2] for entry in header["kernels"]]  # sizes only
        self.path.write_bytes(_MAGIC + json.dumps(header).encode() + b"\n" + data[start:])
        self.assertExpectedInline(
            self._error(), """compile cache PATH: it is truncated or corrupt (save_compile_cache writes one)"""
        )

    def test_a_file_that_is_no_cache_raises(self):
        self.path.write_bytes(b"PK\x03\x04 a checkpoint, say" * 1000)
        self.assertExpectedInline(
            self._error(), """compile cache PATH: it is no compile cache (save_compile_cache writes one)"""
        )

    def test_a_truncated_file_raises(self):
        self.path.write_bytes(self.path.read_bytes()[:-1])
        self.assertExpectedInline(
            self._error(), """compile cache PATH: it is truncated or corrupt (save_compile_cache writes one)"""
        )

    def test_a_directory_raises(self):
        self.path.unlink()
        self.path.mkdir()
        self.assertExpectedInline(self._error(), """compile cache PATH: not a file""")

    def test_an_empty_path_is_refused_when_the_config_loads(self):
        with pytest.raises(ConfigError) as info:
            RunConfig(compile_cache="")
        self.assertExpectedInline(str(info.value), """run.compile_cache must name a file or be null, got ''""")


@contextlib.contextmanager
def _as_another_user():
    """Run the block as a user without root's pass through file modes (as the user `nobody`
    when the tests run as root; as the user itself otherwise)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


class TestAnUnusablePathIsRefusedWhenTheConfigLoads(TestCase):
    """A `run.compile_cache` the run could not read at start or write after its first
    compiles is refused when the config loads, naming the key, not after minutes of
    compiling."""

    @pytest.fixture(autouse=True)
    def _setup(self, monkeypatch):
        self.root = Path(tempfile.mkdtemp(prefix="compile_cache_"))  # a directory every user may write in
        self.root.chmod(0o777)
        monkeypatch.delenv("RANK", raising=False)
        self.monkeypatch = monkeypatch
        yield
        for path in (self.root, *self.root.rglob("*")):
            path.chmod(0o755)
        shutil.rmtree(self.root)

    def _refusal(self, path: Path) -> str | None:
        with _as_another_user():
            try:
                compose_config(f"run.compile_cache={path}")
            except ConfigError as e:
                return str(e).replace(str(self.root), "ROOT")
        return None

    def test_a_directory(self):
        (self.root / "cache").mkdir()
        self.assertExpectedInline(
            self._refusal(self.root / "cache"),
            """run.compile_cache=ROOT/cache is a directory: name a file (in it, say: ROOT/cache/cache.bin)""",
        )

    def test_a_device(self):
        self.assertExpectedInline(
            self._refusal(Path("/dev/null")),
            """run.compile_cache=/dev/null is not a regular file: name a file the run may read and replace""",
        )

    def test_a_directory_that_cannot_be_created(self):
        (self.root / "file").write_text("a file")
        self.assertExpectedInline(
            self._refusal(self.root / "file" / "cache.bin"),
            """run.compile_cache=ROOT/file/cache.bin: ROOT/file is not a directory (rank 0 writes it after a step that compiled something it lacks)""",
        )
        self.assertExpectedInline(
            self._refusal(self.root / "file" / "deep" / "cache.bin"),
            """run.compile_cache=ROOT/file/deep/cache.bin: the directory ROOT/file/deep cannot be created: ROOT/file is not a directory (rank 0 writes it after a step that compiled something it lacks)""",
        )

    def test_a_read_only_directory(self):
        (self.root / "ro").mkdir()
        (self.root / "ro" / "cache.bin").write_bytes(b"")
        (self.root / "ro" / "cache.bin").chmod(0o666)
        (self.root / "ro").chmod(0o555)
        self.assertExpectedInline(
            self._refusal(self.root / "ro" / "cache.bin"),
            """run.compile_cache=ROOT/ro/cache.bin: the directory ROOT/ro is not writable (rank 0 writes it after a step that compiled something it lacks)""",
        )
        self.assertExpectedInline(
            self._refusal(self.root / "ro" / "new" / "cache.bin"),
            """run.compile_cache=ROOT/ro/new/cache.bin: the directory ROOT/ro/new cannot be created: the directory ROOT/ro is not writable (rank 0 writes it after a step that compiled something it lacks)""",
        )
        self.monkeypatch.setenv("RANK", "1")  # a rank that only reads it
        assert self._refusal(self.root / "ro" / "cache.bin") is None

    def test_a_file_the_run_may_not_read_or_write(self):
        cache = self.root / "cache.bin"
        cache.write_bytes(b"")
        cache.chmod(0o222)
        self.assertExpectedInline(
            self._refusal(cache),
            """run.compile_cache=ROOT/cache.bin: the file is not readable (every rank reads it at start)""",
        )
        cache.chmod(0o444)
        self.assertExpectedInline(
            self._refusal(cache),
            """run.compile_cache=ROOT/cache.bin: the file is not writable (rank 0 writes it after a step that compiled something it lacks)""",
        )
        self.monkeypatch.setenv("RANK", "1")
        assert self._refusal(cache) is None
        self.monkeypatch.setenv("RANK", "0")
        cache.chmod(0o666)
        assert self._refusal(cache) is None
        assert self._refusal(self.root / "new" / "deeper" / "cache.bin") is None  # rank 0 creates them


def test_a_resume_reads_its_graphs_from_any_compile_cache(tmp_path):
    # like run.resume, where a run reads its compiled graphs from is no part of what it trains
    overrides = [*TINY_TASK, "compile.enabled=false", "run.steps=2", "run.sft_steps=1"]
    cfg = compose_config(*overrides, f"run.compile_cache={tmp_path / 'written_with.bin'}")
    run = build_run(cfg, init_parallel(cfg.parallel))
    checkpoint = save_checkpoint(tmp_path / "checkpoints", run.training_state(), 1, [])
    for other in ([], [f"run.compile_cache={tmp_path / 'another.bin'}"]):
        resumed = dataclasses.replace(run, cfg=compose_config(*overrides, *other))
        assert load_checkpoint(str(checkpoint), resumed.training_state())[::2] == (
            1,
            [],
        )  # its step; no change reported


# Compiles f's forward and backward (through an autograd.Function whose backward scales its
# gradient by the third argument), then g's forward, with Inductor in a fresh process, and
# saves after each (as the runner does after each phase's first step) or loads before both;
# prints Inductor's and AOTAutograd's cache counters, whether it ran the C++ compiler, what
# it loaded and saved, and the results.
_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import compile_times, counters
    from compiled_loss.compile import load_compile_cache, save_compile_cache
    path, mode, scale = sys.argv[1], sys.argv[2], float(sys.argv[3])
    loaded = load_compile_cache(path)
    class Exp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y
        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * y * scale
    def f(x, w):
        return torch.log_softmax(Exp.apply(x @ w), dim=-1).amax(dim=-1).sum()
    def g(x):
        return torch.softmax(x * 3, dim=0).cumsum(dim=1)
    x, w = torch.linspace(-1, 1, 64).reshape(8, 8), torch.linspace(-2, 2, 96).reshape(8, 12).requires_grad_()
    torch.compile(f, backend="inductor")(x, w).backward()
    saved = [save_compile_cache(path)] if mode == "save" else []
    y = torch.compile(g, backend="inductor")(x)
    saved += [save_compile_cache(path)] if mode == "save" else []
    print(json.dumps({"loaded": loaded, "saved": saved, "inductor": dict(counters["inductor"]),
                      "aot_autograd": dict(counters["aot_autograd"]), "grad": w.grad.tolist(), "y": y.tolist(),
                      "ran_cpp_compiler": "compile_file" in compile_times(repr="str")}))
    """
)


def _fresh(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment of a machine that compiled nothing: empty Inductor cache directories
    (the default one, where Inductor also keeps precompiled headers, and the one it uses)."""
    cache_dir, temporary = tmp_path / f"inductor_{name}", tmp_path / f"tmp_{name}"
    cache_dir.mkdir()
    temporary.mkdir()
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TMPDIR": str(temporary)}


def _fresh_process(tmp_path: Path, name: str, *args: str) -> dict:
    """`_PROCESS` on a machine that compiled nothing."""
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS, *args],
        env=_fresh(tmp_path, name),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # three processes compile with Inductor
def test_a_fresh_process_given_the_file_reads_every_graph_and_kernel_instead_of_compiling_it(tmp_path):
    path = tmp_path / "cache" / "compile.bin"
    first = _fresh_process(tmp_path, "first", str(path), "save", "1")
    assert first["loaded"] is False and first["saved"] == [True, True] and path.is_file()
    # f's forward and backward, g's forward
    assert first["inductor"].get("fxgraph_cache_miss") == 3 and "fxgraph_cache_hit" not in first["inductor"]
    assert first["ran_cpp_compiler"] is True
    compiled_by_aot = first["aot_autograd"].get("autograd_cache_miss")
    assert compiled_by_aot in (1, 2)  # f's; g's too where its inference graph is cacheable
    assert "autograd_cache_bypass" not in first["aot_autograd"]  # f's graph holds an autograd.Function
    header = _header(path)
    assert {kind: len(keys) for kind, keys in header["artifacts"].items()} == {
        "inductor": 3,
        "aot_autograd": compiled_by_aot,
    }
    assert sum(name.endswith(".main.so") for name, _, _ in header["kernels"]) >= 3  # f's, f's backward's, g's
    second = _fresh_process(tmp_path, "second", str(path), "load", "1")
    assert second["loaded"] is True
    # every graph of both saves read from the artifacts, compiled by neither Inductor nor
    # AOTAutograd, and every kernel from the file: no C++ compiler
    assert second["inductor"].get("fxgraph_cache_hit") == 3 and "fxgraph_cache_miss" not in second["inductor"]
    assert second["aot_autograd"].get("autograd_cache_hit") == compiled_by_aot
    assert "autograd_cache_miss" not in second["aot_autograd"]
    assert second["ran_cpp_compiler"] is False
    assert (second["grad"], second["y"]) == (first["grad"], first["y"])
    # the autograd.Function's backward changed: its graph misses and compiles, the others hit
    third = _fresh_process(tmp_path, "third", str(path), "load", "2")
    assert third["aot_autograd"].get("autograd_cache_miss") == 1
    assert third["grad"] == [[2 * value for value in row] for row in first["grad"]]
    assert third["y"] == first["y"]


def _run(tmp_path: Path, name: str, cache: Path) -> tuple[dict, str]:
    """The runner at test size in a fresh process on a machine that compiled nothing."""
    out = tmp_path / name
    overrides = [*TINY_TASK, "run.steps=2", "run.sft_steps=1", f"run.compile_cache={cache}", f"hydra.run.dir={out}"]
    subprocess.run(
        [sys.executable, "-m", "compiled_loss.run", *overrides],
        env=_fresh(tmp_path, name),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads((out / "summary.json").read_text()), (out / "run.log").read_text()


@pytest.mark.slow  # two runs compile the sampler and both training steps with Inductor
def test_the_runner_writes_its_compile_cache_and_a_fresh_run_reads_it(tmp_path):
    cache = tmp_path / "cc" / "cache.bin"
    first, log = _run(tmp_path, "first", cache)  # no file yet: a cold run that writes it
    assert first["compile_cache"] == {"path": str(cache), "loaded": False, "saved_after_steps": [1, 2]}
    assert f"run.compile_cache={cache}: no such file" in log and f"step 2: wrote run.compile_cache={cache}" in log
    artifacts = _header(cache)["artifacts"]
    assert len(artifacts["inductor"]) >= 4 and len(artifacts["aot_autograd"]) >= 2  # the sampler's and the steps'
    second, log = _run(tmp_path, "second", cache)
    # it loaded the file, and no step compiled a graph the file lacks: nothing to write back
    assert second["compile_cache"] == {"path": str(cache), "loaded": True, "saved_after_steps": []}
    assert f"run.compile_cache={cache}: loaded" in log and "wrote run.compile_cache" not in log
    assert second["compiles"] == first["compiles"] and second["compile_problems"] == []
    assert second["first_loss"] == approx(first["first_loss"], torch.float32, "compiled")
    assert _header(cache)["artifacts"] == artifacts
