"""Hydra's side of the configs: the dataclasses of `compiled_loss.config` registered as
schemas in the ConfigStore, and `load_config`, which turns a composed config into a typed,
validated `Config`.

Schemas are stored at the root of the store (`schema_<group>`, `schema_loss_<kind>`, `schema_draft_<kind>`),
outside the config groups, so `--help` lists only the real options; each YAML option under
`conf/<group>/` names its schema first (`- /schema_packing@_here_`), so Hydra type-checks
it. `load_config` rejects, before anything is built: unknown keys (including Hydra's
silently accepted `+key=` additions), invalid values and impossible combinations — each
message names the key — and, beyond what `Config` checks, what only the application knows:
a run whose largest allocations exceed this machine's memory, a seed and step count that
overflow the sampler's generator seed, a warm start that leaves the loss no step, a
logger whose package is not installed, and a `run.compile_cache` the run could not read or
write.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from compiled_loss.app.loggers import check_installed
from compiled_loss.app.sampler import sampling_uniforms
from compiled_loss.checks import ConfigError, require
from compiled_loss.config import (
    DRAFT_KINDS,
    LOSS_KINDS,
    CompileConfig,
    Config,
    DataConfig,
    LogprobConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
    ParallelConfig,
    RunConfig,
    build_draft_runtime,
    draft_kind,
    drafter_name,
    loss_family,
    loss_kind,
)
from compiled_loss.config.drafts import size_keys
from compiled_loss.config.groups import PackingMode
from compiled_loss.demo.data import prompt_width, response_width
from compiled_loss.demo.hf import policy_model
from compiled_loss.packing import round_to_bucket

GROUP_SCHEMAS: dict[str, type] = {
    "packing": PackingConfig,
    "parallel": ParallelConfig,
    "compile": CompileConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "logprob": LogprobConfig,
    "optim": OptimConfig,
    "run": RunConfig,
}


def schema(cls: type) -> DictConfig:
    """The structured config of `cls`, writable: OmegaConf makes the node of a frozen dataclass
    read-only — the `loss` and `draft` options subclass their frozen loss and drafter configs —
    which would refuse every value the YAML and the command line set; the object
    `OmegaConf.to_object` builds from it is frozen."""
    node = OmegaConf.structured(cls)
    OmegaConf.set_readonly(node, False)
    return node


def register() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="schema_config", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        store.store(name=f"schema_{group}", node=node)
    for option in LOSS_KINDS:
        store.store(name=f"schema_loss_{option().name}", node=schema(option))
    for option in DRAFT_KINDS:
        store.store(name=f"schema_draft_{option().name}", node=schema(option))


register()


def _strict(cfg: DictConfig) -> None:
    """Reject keys the schemas do not declare (Hydra accepts `+group.key=` silently)."""
    for group in ("loss", "draft", *GROUP_SCHEMAS):
        node = cfg[group]
        cls = OmegaConf.get_type(node)
        try:
            OmegaConf.merge(schema(cls), OmegaConf.to_container(node))
        except ConfigKeyError as e:
            valid = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"{group}.{e.key}: unknown key; valid keys: {valid}") from None
    top = [f.name for f in dataclasses.fields(Config)]
    extra = sorted(set(cfg) - set(top))
    if extra:
        raise ValueError(f"unknown top-level keys {extra}; valid: {top}")


_GIB = 2**30


def memory_bytes() -> int:
    """This machine's physical memory (the run keeps its models and batches in host memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _parameters(build: Callable[[int], torch.nn.Module], layers: int, keys: str) -> tuple[int, int]:
    """(all, trainable) parameters of `build(layers)`, counted on the meta device from builds
    with one and two layers (the layers are alike): no memory and no time, whatever the sizes
    (`keys`: what sizes them, for the error when a weight has more elements than an int64 counts)."""
    try:
        with torch.device("meta"):
            built = (build(1), build(min(layers, 2)))
    except RuntimeError as e:
        raise ConfigError(f"{keys}: a weight would have more elements than an int64 counts ({e})") from None
    (all_1, trained_1), (all_2, trained_2) = [
        (sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.parameters() if p.requires_grad))
        for m in built
    ]
    return all_1 + (layers - 1) * (all_2 - all_1), trained_1 + (layers - 1) * (trained_2 - trained_1)


def allocations(config: Config) -> list[tuple[str, int]]:
    """The run's largest allocations, each (what, with the keys that size it; bytes): a lower
    bound of its peak memory."""
    found = [_policy_allocation(config)]
    batch, slots = _batch_allocations(config)
    found += batch
    if draft_kind(config.draft).co_trained:
        found += _drafter_allocations(config, slots)
    return found


def _policy_allocation(config: Config) -> tuple[str, int]:
    """The policy's weights, gradients, KL reference, AdamW moments (and a teacher)."""
    model, draft, kind = config.model, config.draft, loss_kind(config.loss)
    size = getattr(torch, model.dtype).itemsize
    model_keys = (
        "model.vocab_size, model.hidden_size, model.num_layers, model.mlp_ratio, model.max_positions"
        if model.hf_path is None
        else f"model.hf_path={model.hf_path}"
    )
    params, _ = _parameters(  # a model.hf_path checkpoint is built whole, whatever num_layers says
        lambda n: policy_model(
            dataclasses.replace(model, num_layers=n), value_head=kind.value_head, draft=drafter_name(draft)
        ),
        model.num_layers,
        model_keys,
    )
    copies = kind.state_copies  # the policy, its gradient, the KL reference,
    # two AdamW (the warm start's, the loss's) × two moments, and a teacher
    return (
        f"the policy's weights, gradients, reference and AdamW moments ({params:,} parameters of {model_keys} "
        f"× {copies})",
        params * copies * size,
    )


def _batch_allocations(config: Config) -> tuple[list[tuple[str, int]], int]:
    """The longest micro-batch's ids, attention mask and logits; and its slots."""
    rows, tokens, _ = config.longest_micro_batch()
    grid = config.packing.grid()
    rows = round_to_bucket(rows, grid.rows, grid.per_octave)
    width = round_to_bucket(config.data.max_length(), grid.width, grid.per_octave)
    found = [
        (
            f"the longest micro-batch's token ids ({rows} × {width} int64: its rows rounded up to packing.rows, "
            "its longest sequence to packing.width)",
            rows * width * 8,
        )
    ]
    if config.packing.mode == PackingMode.none:
        slots, mask, shape = rows * width, rows * width * width, f"{rows} × {width}² bools"
    else:
        slots = round_to_bucket(tokens, grid.tokens, grid.per_octave)
        mask, shape = slots * slots, f"1 × {slots}² bools: its tokens rounded up to packing.tokens"
    found.append((f"the longest micro-batch's attention mask ({shape})", mask))
    if not config.logprob.fused_linear:
        found.append(
            (
                f"the longest micro-batch's float32 logits ({slots} slots × model.vocab_size)",
                slots * config.model.vocab_size * 4,
            )
        )
    return found, slots


def _drafter_allocations(config: Config, slots: int) -> list[tuple[str, int]]:
    """The drafter's weights, gradients, AdamW moments and logits."""
    model, draft = config.model, config.draft
    size = getattr(torch, model.dtype).itemsize
    layers = getattr(draft, "num_layers", None)
    keys = size_keys(draft)
    _, trained = _parameters(
        lambda n: build_draft_runtime(draft if layers is None else dataclasses.replace(draft, num_layers=n), model),
        layers or 1,
        keys,
    )
    vocab = draft.draft_vocab_size or model.vocab_size
    logits = draft_kind(draft).logits(draft, slots, vocab)
    return [
        (
            f"the drafter's weights, gradients and AdamW moments ({trained:,} parameters of {keys} × 6)",
            trained * 6 * size,
        ),
        (f"the drafter's float32 logits ({logits[0]})", logits[1]),
    ]


def _check_speculative(config: Config) -> None:
    """`run.speculative_tokens` within the response bucket, and with `run.speculative` a
    drafter to propose and positions for the proposals."""
    run, data = config.run, config.data
    gamma, response = run.speculative_tokens, response_width(data)
    require(
        gamma <= response - 1,
        f"run.speculative_tokens={gamma} exceeds {response - 1}: a round drafts the tokens after the response's "
        f"first, and the response bucket holds {response} (data.total_terms - data.prompt_terms_min + 1)",
    )
    if not run.speculative:
        return
    kind = draft_kind(config.draft)
    require(
        kind.co_trained,
        "run.speculative=true drafts with the co-trained drafter: choose draft=eagle3 or draft=dflash",
    )
    kind.speculative_bound(config.draft, gamma)
    slots = prompt_width(data) + response + gamma + 1
    require(
        slots <= config.model.max_positions,
        f"run.speculative=true needs {slots} positions (prompt and response buckets, "
        f"run.speculative_tokens={gamma} and 1), model.max_positions is {config.model.max_positions}",
    )


def _accessible(path: Path, mode: int) -> bool:
    """Whether this process (its effective user and groups, as it opens files) may access
    `path` with `mode` (`os.R_OK`, …): a read-only file system included."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _check_compile_cache(path: str | None) -> None:
    """`run.compile_cache` as the run uses it: every rank reads the file at start when it
    exists (a regular file it may read); rank 0 (torchrun's `RANK`) writes it after a step
    that compiled something it lacks — a temporary file in its directory renamed over it, the
    missing directories created — so there the file, when it exists, and the directory must be
    writable, or the nearest existing directory above when it must be created."""
    if path is None:
        return
    given, target = f"run.compile_cache={path}", Path(path)
    require(not target.is_dir(), f"{given} is a directory: name a file (in it, say: {target / 'cache.bin'})")
    exists = target.exists()
    if exists:
        require(target.is_file(), f"{given} is not a regular file: name a file the run may read and replace")
        require(_accessible(target, os.R_OK), f"{given}: the file is not readable (every rank reads it at start)")
    if os.environ.get("RANK", "0") != "0":
        return  # only rank 0 writes it
    writes = "rank 0 writes it after a step that compiled something it lacks"
    if exists:
        require(_accessible(target, os.W_OK), f"{given}: the file is not writable ({writes})")
    directory, above = target.parent, target.parent
    while not above.exists() and not above.is_symlink():  # a dangling link is in the way too
        above = above.parent
    created = "" if above == directory else f"the directory {directory} cannot be created: "
    require(above.is_dir(), f"{given}: {created}{above} is not a directory ({writes})")
    require(
        _accessible(above, os.W_OK | os.X_OK), f"{given}: {created}the directory {above} is not writable ({writes})"
    )


def check_run(config: Config) -> None:
    """What `Config` cannot check: the run's largest allocations (`allocations`) against this
    machine's memory — the bound of every size no data-derived bound covers: the model's and
    the drafter's widths and depths, the batch, the bucket grid —, `run.seed` with the step
    count against the sampler's 64-bit generator seed (tried at the first and the last step),
    that the warm start leaves at least one of `run.steps` to the loss, that each logger
    of `run.loggers` has its package, what speculative sampling needs (`_check_speculative`) and
    that the run can read and write `run.compile_cache` (`_check_compile_cache`)."""
    found = allocations(config)
    need, have = sum(b for _, b in found), memory_bytes()
    _, _, batch_keys = config.longest_micro_batch()
    require(
        need <= have,
        f"the run needs at least {need / _GIB:.3g} GiB of memory, this machine has {have / _GIB:.3g} GiB: "
        + "; ".join(f"{what}: {b / _GIB:.3g} GiB" for what, b in sorted(found, key=lambda f: -f[1]))
        + f" (the longest micro-batch: {batch_keys})",
    )
    run = config.run
    for step in (1, run.steps):
        try:
            sampling_uniforms(run.seed, step, 1, 1)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(
                f"run.seed={run.seed} overflows the sampler's generator seed at step {step} of run.steps ({e}): the "
                "seed of step s is run.seed × 1,000,003 + s, at most 64 bits"
            ) from None
    warm = run.warm_start_steps(loss_family(config.loss))
    require(
        warm < run.steps,
        f"run.sft_steps={warm} leaves no step of run.steps={run.steps} to loss={config.loss.name}: run.steps counts "
        f"every optimizer step, the warm start's included; lower run.sft_steps below {run.steps} (0: no warm start) "
        f"or raise run.steps above {warm}",
    )
    check_installed(run.loggers)
    _check_speculative(config)
    _check_compile_cache(run.compile_cache)


def load_config(cfg: DictConfig) -> Config:
    """Composed Hydra config → validated, typed `Config` (raises ValueError naming the key,
    one line: an interpolation `${…}` that does not resolve to the key's type included),
    checked against this machine's memory and the sampler's seed range (`check_run`)."""
    _strict(cfg)
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve to the key's type
        raise ConfigError(f"{e.full_key}: {str(e.msg).strip().splitlines()[0]}") from None
    check_run(config)
    return config


def compose_config(*overrides: str) -> Config:
    """The typed `Config` of `python -m compiled_loss.run <overrides>`, without running it."""
    with initialize_config_module(version_base="1.3", config_module="compiled_loss.conf"):
        return load_config(compose(config_name="config", overrides=list(overrides)))
