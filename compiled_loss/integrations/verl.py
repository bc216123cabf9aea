"""verl's policy losses, `agg_loss` and `kl_penalty` (verl 0.9.1,
`verl.trainer.ppo.core_algos`) with verl's signatures, computed by compiled_loss.

`register()` puts `PolicyLoss` objects into verl's policy-loss registry under verl's names
(`get_policy_loss_fn("vanilla")` then returns this library's), and returns what it
replaced, which `restore` puts back. Importing this module patches nothing and imports no
verl; `register` and `restore` import `verl.trainer.ppo.core_algos`.

The losses it computes, each `(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)` over padded `[bs,
response_length]` tensors, with verl's metric keys and floats:

- `vanilla`: PPO's clipped surrogate with the dual clip (`clip_ratio_low` / `_high`,
  `clip_ratio_c`): `ClippedPGLossFn.token_objective` with `ratio_clip_min`, `ratio_clip_max`,
  `ratio_clip_c`; verl's clamp of the log-ratio at ±20 (no gradient beyond it) is kept;
- `cispo`: `ClippedPGLossFn` with `use_cispo`;
- `gpg`: REINFORCE, `-advantages · log_prob`: `ClippedPGLossFn` with `disable_ppo_ratio`;
- `gspo`: verl's GSPO. NeMo-RL's GSPO (`sequence_level_importance_ratios`) has the same
  value, but its sequence ratio passes its gradient to every token of the sequence alike,
  where verl's gives each token the gradient of its own term (the two agree only when the
  advantages and `rollout_is_weights` are constant over each sequence): so the ratio here is
  verl's, `exp(sg(mean log-ratio) + log_prob - sg(log_prob))`, clamped at log 10;
- `bypass_mode`: verl's rollout-correction helper (its own code, eager, with its host
  syncs) computes the importance weights and the rejection mask, then `vanilla`
  (`loss_type="ppo_clip"`) or REINFORCE with the weights (`"reinforce"`) runs here.

Every loss multiplies its per-token term by `rollout_is_weights` when given and aggregates
it with `agg_loss` in the five modes, with `config.global_batch_info` (dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor). verl's other losses (`dppo_tv`,
`dppo_kl`, `sapo`, `clip_cov`, `kl_cov`, `geo_mean`, `dro`) stay verl's own: `register`
leaves them in place and refuses their names with a ValueError.

Compiled once per shape bucket: `[bs, response_length]` is padded on the host to `bucket`'s
grid (rows and width, masked), and the objective compiles once per bucket (fullgraph, static
shapes, at most `max_buckets` graphs; the call that would compile one more is refused on the
host, naming the bucket). A bucket is everything the graph is specialised on: the padded
shapes and dtypes, which optional tensors are given, the loss and aggregation mode, the clip
ratios, and the grad mode. The normalisers (batch_num_tokens, global_batch_size, dp_size,
loss_scale_factor, and the response length that `seq-mean-token-sum-norm` divides by without
one) reach the graph as 0-d tensors, so a new value never recompiles. The metrics leave the
graph as one tensor, read with one device-to-host copy after it.

Inputs outside `response_mask` never reach a value or a gradient (they are zeroed before any
math), where verl's sequence modes and `gspo` turn a NaN there into a NaN loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from compiled_loss.checks import ConfigError
from compiled_loss.integrations.liger import _Objective
from compiled_loss.losses import ClippedPGLossConfig, ClippedPGLossFn, calculate_kl
from compiled_loss.packing import BucketGrid
from compiled_loss.packing.layout import round_to_bucket

Tensor = torch.Tensor

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""verl's `loss_agg_mode` values."""

POLICY_LOSSES = ("vanilla", "gspo", "cispo", "gpg", "bypass_mode")
"""The verl policy-loss names this module computes (`register`'s default)."""

VERL_OWN = ("dppo_tv", "dppo_kl", "sapo", "clip_cov", "kl_cov", "geo_mean", "dro")
"""verl 0.9.1's other registered policy losses, which stay verl's own."""

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""verl's `kl_penalty` modes; each also with a `+` suffix (the k2 gradient, straight through)."""

DEFAULT_BUCKET = BucketGrid(rows=1, width=16, per_octave=4)
"""Shape buckets: response lengths in multiples of 16, at most 4 per power-of-two octave
(so are the rows: exact up to 4, then 4 per octave)."""

_GLOBAL_BATCH_INFO = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")

_DEFAULT_MODE = {"gspo": "seq-mean-token-mean"}
"""Each loss's `loss_agg_mode` default in verl (others: token-mean)."""

_METRICS = {
    "vanilla": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "gspo": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "cispo": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "gpg": (),
    "reinforce": ("actor/ppo_kl",),
}
"""verl's metric keys per objective, in the order the objective returns them."""


class UnsupportedKLPenalty(ValueError, NotImplementedError):
    """A `kl_penalty` mode verl does not compute either ("full", or an unknown name): a
    ValueError naming it, and the NotImplementedError verl raises."""


# ---- agg_loss and kl_penalty ----------------------------------------------------------


def _masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """verl's `masked_sum`: entries outside `mask` replaced by 0, then weighted by it."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """verl's `masked_mean`: the masked sum over `mask.sum() + 1e-8`."""
    return _masked_sum(values, mask) / (mask.sum() + 1e-8)


def _check_agg(who: str, mode: str, dp_size: Any, batch_num_tokens: Any, global_batch_size: Any) -> None:
    """verl's refusals of `agg_loss`, on the host: an unknown mode, and a data-parallel run
    without the global normaliser its mode divides by."""
    if mode not in AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {mode} ({who}: one of {', '.join(AGG_MODES)})")
    distributed = bool(dp_size > 1)  # host: a tensor dp_size is read as verl reads it
    if mode == "token-mean" and batch_num_tokens is None and distributed:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if mode.startswith("seq-mean") and global_batch_size is None and distributed:
        raise ValueError("global_batch_size is required when dp_size > 1")


def _aggregate(
    loss_mat: Tensor,
    loss_mask: Tensor,
    mode: str,
    dp_size: Any,
    batch_num_tokens: Any,
    global_batch_size: Any,
    loss_scale_factor: Any,
) -> Tensor:
    """verl's `agg_loss` arithmetic, in its order (checks and defaults on the caller's side,
    except the normalisers verl counts from the mask when None); every sum is a masked
    sum. `loss_scale_factor`: what `seq-mean-token-sum-norm` divides by (never None)."""
    if mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return _masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if mode == "token-sum":
        return _masked_sum(loss_mat, loss_mask) * dp_size
    counts = torch.sum(loss_mask, dim=-1)
    seq_losses = _masked_sum(loss_mat, loss_mask, axis=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (counts + 1e-8)
    seq_mask = (counts > 0).float()  # sequences with no valid token are left out
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    loss = _masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / loss_scale_factor
    return loss


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> Tensor:
    """verl's `agg_loss`: `loss_mat [bs, T]` aggregated over `loss_mask [bs, T]` into a
    scalar, micro-batch invariant with the global batch's normalisers (verl's
    `global_batch_info`):

    - `token-mean`: the masked sum / `batch_num_tokens` (default: the mask's count) · dp_size;
    - `token-sum`: the masked sum · dp_size;
    - `seq-mean-token-sum`: per-sequence sums, summed over the sequences with a valid token, /
      `global_batch_size` (default: their count) · dp_size;
    - `seq-mean-token-sum-norm`: that / `loss_scale_factor` (default: T);
    - `seq-mean-token-mean`: per-sequence means (over `count + 1e-8`), reduced the same way.

    verl's refusals are kept: an unknown mode, and `dp_size > 1` without `batch_num_tokens`
    (token-mean) or `global_batch_size` (sequence modes). Entries outside the mask are
    replaced by 0 in every mode (verl's sequence modes multiply by the mask, so a NaN there
    made the loss NaN). Traceable: fullgraph, no host sync for tensor normalisers."""
    _check_agg("agg_loss", loss_agg_mode, dp_size, batch_num_tokens, global_batch_size)
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _aggregate(loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, scale)


def _kl_forward(logprob: Tensor, ref_logprob: Tensor, mode: str) -> Tensor:
    """verl's `kl_penalty_forward` through `calculate_kl` (the k3 estimator with verl's
    clamps: the log-ratio at ±20, the estimate at ±10)."""
    if mode in ("kl", "k1"):
        return calculate_kl(logprob, ref_logprob, "k1", None, None)
    if mode == "abs":
        return calculate_kl(logprob, ref_logprob, "k1", None, None).abs()
    if mode in ("mse", "k2"):
        return calculate_kl(logprob, ref_logprob, "k2", None, None)
    if mode in ("low_var_kl", "k3"):
        return calculate_kl(logprob, ref_logprob, "k3", 20.0, 10.0)
    raise UnsupportedKLPenalty(
        f"kl_penalty: {mode!r} is not computed (verl raises NotImplementedError for it too); "
        f"one of {', '.join(KL_PENALTIES)}, each also with a '+' suffix"
    )


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's `kl_penalty`: the per-token KL estimate of `logprob` against `ref_logprob`
    (`[bs, T]`). `k1`/`kl`: `logprob - ref`; `abs`: its magnitude; `k2`/`mse`: half its
    square; `k3`/`low_var_kl`: `exp(ref - lp) - (ref - lp) - 1` with the log-ratio clamped at
    ±20 and the estimate at ±10. A `+` suffix keeps the value and takes the gradient of `k2`
    (straight through). Another mode is refused with `UnsupportedKLPenalty` (a ValueError and
    the NotImplementedError verl raises)."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


# ---- the policy losses ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What one call's graph is specialised on beyond its tensors: the objective, the
    aggregation mode and the clip ratios (part of its bucket key; `loss_fn` is built from
    them)."""

    objective: str
    mode: str
    clip_low: float = 0.0
    clip_high: float = 0.0
    clip_c: float | None = None
    loss_fn: ClippedPGLossFn | None = dataclasses.field(default=None, repr=False, compare=False)


def _config_value(config: Any, name: str, default: Any) -> Any:
    """`config.get(name, default)` for verl's configs (BaseConfig, DictConfig), else the attribute."""
    getter = getattr(config, "get", None)
    return getter(name, default) if callable(getter) else getattr(config, name, default)


def _clip_ratios(who: str, config: Any) -> tuple[float, float]:
    """`(clip_ratio_low, clip_ratio_high)`, each defaulting to `clip_ratio`, as verl reads them."""
    clip_ratio = _config_value(config, "clip_ratio", None)
    low, high = _config_value(config, "clip_ratio_low", None), _config_value(config, "clip_ratio_high", None)
    low, high = (clip_ratio if v is None else v for v in (low, high))
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{who}: config.{name} (or config.clip_ratio) must be a finite number, got {value!r}")
    return float(low), float(high)


def _check_actor_config(who: str, config: Any) -> None:
    """verl's asserts on `config`: given, and not the algorithm's `AlgoConfig`."""
    if config is None:
        raise ConfigError(f"{who}: config (verl's ActorConfig) is required")
    try:
        from verl.trainer.config import AlgoConfig
    except ImportError:  # without verl no config is an AlgoConfig
        return
    if isinstance(config, AlgoConfig):
        raise ConfigError(f"{who}: config must be the actor's config (ActorConfig), got verl's AlgoConfig")


def _global_batch_info(who: str, config: Any) -> dict[str, Any]:
    info = dict(getattr(config, "global_batch_info", None) or {})
    unknown = sorted(set(info) - set(_GLOBAL_BATCH_INFO))
    if unknown:
        raise ValueError(
            f"{who}: config.global_batch_info has unknown keys {unknown}; known: {list(_GLOBAL_BATCH_INFO)}"
        )
    return info


def _as_scalar(who: str, name: str, value: Any, like: Tensor) -> Tensor | None:
    """A normaliser as a 0-d tensor of `like`'s dtype and device (None stays None): the value
    is never a Python constant of the graph, so a new one does not recompile."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{who}: {name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(()).to(dtype=like.dtype, device=like.device)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{who}: {name} must be a number or a one-element tensor, got {value!r}")
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)


def _pad(x: Tensor | None, rows: int, width: int) -> Tensor | None:
    """`x [bs, T]` zero-padded (False for a bool mask) to `[rows, width]`, contiguous."""
    if x is None:
        return None
    if tuple(x.shape) != (rows, width):
        x = F.pad(x, (0, width - x.shape[1], 0, rows - x.shape[0]))
    return x.contiguous()


def _nemo_data(mask: Tensor, old: Tensor, adv: Tensor) -> dict[str, Tensor]:
    """`ClippedPGLossFn`'s data for `[bs, T]` verl tensors: NeMo-RL's entry t + 1 holds token
    t (a leading column, masked), `prev_logprobs` the old policy's."""

    def shifted(x: Tensor) -> Tensor:
        return F.pad(x, (1, 0))

    return {
        "token_mask": shifted(mask.to(old.dtype)),
        "sample_mask": old.new_ones(old.shape[0]),
        "advantages": shifted(adv),
        "prev_logprobs": shifted(old),
        "generation_logprobs": shifted(old),
    }


def _vanilla(spec: _Spec, old: Tensor, lp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    log_ratio = lp - old
    clamped = log_ratio.clamp(-20.0, 20.0)
    # verl clamps the log-ratio at ±20: beyond it the ratio is exp(±20) with no gradient
    lp_in = torch.where(log_ratio == clamped, lp, (old + clamped).detach())
    per_token = spec.loss_fn.token_objective(lp_in, _nemo_data(mask, old, adv))
    ratio = torch.exp(clamped.detach())
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high)
    clip1 = torch.maximum(pg1, pg2)
    lower = torch.gt(clip1, -adv * spec.clip_c) * (adv < 0).float()
    metrics = [_masked_mean(torch.gt(pg2, pg1).float(), mask), _masked_mean(-clamped.detach(), mask)]
    return per_token, [*metrics, _masked_mean(lower, mask)]


def _cispo(spec: _Spec, old: Tensor, lp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    log_ratio = lp - old
    clamped = log_ratio.clamp(-20.0, 20.0)
    # the ratio (detached) from verl's clamped log-ratio; the log-prob factor is lp itself
    old_in = torch.where(log_ratio == clamped, old, (lp - clamped).detach())
    per_token = spec.loss_fn.token_objective(lp, _nemo_data(mask, old_in, adv))
    ratio = torch.exp(clamped.detach())
    clipped = ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high)
    metrics = [_masked_mean((ratio != clipped).float(), mask), _masked_mean(-clamped.detach(), mask)]
    return per_token, [*metrics, lp.new_zeros(())]


def _gspo(spec: _Spec, old: Tensor, lp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    log_ratio = lp - old
    seq_log_ratio = torch.sum(log_ratio * mask, dim=-1) / torch.sum(mask, dim=-1).clamp(min=1)
    # each token's ratio: the sequence's value, the gradient of its own log-prob (verl's)
    log_seq_ratio = (lp - lp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_seq_ratio)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high)
    metrics = [_masked_mean(torch.gt(pg2, pg1).float().detach(), mask), _masked_mean(-log_ratio.detach(), mask)]
    return torch.maximum(pg1, pg2), [*metrics, lp.new_zeros(())]


def _gpg(spec: _Spec, old: Tensor, lp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    return spec.loss_fn.token_objective(lp, _nemo_data(mask, old, adv)), []


def _reinforce(spec: _Spec, old: Tensor, lp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, list[Tensor]]:
    per_token, _ = _gpg(spec, old, lp, adv, mask)  # old: the rollout policy's log-probs
    return per_token, [_masked_mean(-(lp.detach() - old), mask)]


_OBJECTIVES: dict[str, Callable[..., tuple[Tensor, list[Tensor]]]] = {
    "vanilla": _vanilla,
    "gspo": _gspo,
    "cispo": _cispo,
    "gpg": _gpg,
    "reinforce": _reinforce,
}


def _loss_fn(objective: str, clip_low: float, clip_high: float, clip_c: float | None) -> ClippedPGLossFn | None:
    """The `ClippedPGLossFn` whose per-token objective is verl's `objective` (None for gspo)."""
    common = {"reference_policy_kl_penalty": 0.0, "metrics_level": "minimal"}
    if objective == "vanilla":
        cfg = ClippedPGLossConfig(ratio_clip_min=clip_low, ratio_clip_max=clip_high, ratio_clip_c=clip_c, **common)
    elif objective == "cispo":
        cfg = ClippedPGLossConfig(ratio_clip_min=clip_low, ratio_clip_max=clip_high, use_cispo=True, **common)
    elif objective in ("gpg", "reinforce"):
        cfg = ClippedPGLossConfig(disable_ppo_ratio=True, **common)
    else:
        return None
    return ClippedPGLossFn(cfg)


class PolicyLoss:
    """verl's policy loss `name` (one of `POLICY_LOSSES`) computed by compiled_loss, called
    with verl's signature: `(old_log_prob, log_prob, advantages, response_mask [bs, T],
    loss_agg_mode, config, rollout_is_weights=None) -> (loss, metrics)`, the metrics a dict
    of floats under verl's keys. `config` is verl's `ActorConfig` (or a mapping-like config
    with its fields): `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`
    (vanilla; default 3, must be > 1), `global_batch_info`, and for `bypass_mode`
    `policy_loss.rollout_correction`.

    `compiled`: True compiles with Inductor, a backend name or callable with that
    `torch.compile` backend, False runs eagerly. `bucket`: the grid `[bs, T]` is padded to;
    `max_buckets`: the most graphs it compiles."""

    def __init__(
        self,
        name: str,
        *,
        compiled: bool | str | Callable[..., Any] = True,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        if name not in POLICY_LOSSES:
            own = f" ({name!r} stays verl's own)" if name in VERL_OWN else ""
            raise ValueError(f"PolicyLoss: name must be one of {POLICY_LOSSES}, got {name!r}{own}")
        if not isinstance(bucket, BucketGrid):
            raise ValueError(f"PolicyLoss: bucket must be a BucketGrid, got {bucket!r}")
        self.name, self.bucket = name, bucket
        self.who = f"compiled_loss verl policy loss {name!r}"
        self._objective = _Objective(self.who, self._compute, compiled, max_buckets)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.name!r})"

    def __call__(
        self,
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str | None = None,
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        mode = _DEFAULT_MODE.get(self.name, "token-mean") if loss_agg_mode is None else loss_agg_mode
        if self.name == "bypass_mode":
            return self._bypass(old_log_prob, log_prob, advantages, response_mask, mode, config)
        tensors = (old_log_prob, log_prob, advantages, response_mask)
        return self.compute(self.name, *tensors, mode, config, rollout_is_weights)

    def compute(
        self,
        objective: str,
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        mode: str,
        config: Any,
        weights: Tensor | None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """The objective `objective` (a key of verl's losses, or `reinforce`), checked and
        padded on the host, computed by the compiled objective."""
        who = self.who
        _check_actor_config(who, config)
        clip_low = clip_high = 0.0
        clip_c = None
        if objective in ("vanilla", "gspo", "cispo"):
            clip_low, clip_high = _clip_ratios(who, config)
        if objective == "vanilla":
            clip_c = _config_value(config, "clip_ratio_c", 3.0)
            if not isinstance(clip_c, (int, float)) or isinstance(clip_c, bool) or not clip_c > 1.0:
                raise ConfigError(
                    f"{who}: config.clip_ratio_c, the lower bound of the ratio for dual-clip PPO, must be > 1.0, "
                    f"got {clip_c!r}"
                )
            clip_c = float(clip_c)
        info = _global_batch_info(who, config)
        dp_size = info.get("dp_size", 1)
        _check_agg(who, mode, dp_size, info.get("batch_num_tokens"), info.get("global_batch_size"))
        tensors = {"old_log_prob": old_log_prob, "log_prob": log_prob, "advantages": advantages}
        tensors |= {"response_mask": response_mask, "rollout_is_weights": weights}
        for name, value in tensors.items():
            if value is not None and not isinstance(value, Tensor):
                raise ValueError(f"{who}: {name} must be a tensor, got {type(value).__name__}")
        if log_prob.dim() != 2:
            raise ValueError(f"{who}: log_prob must be [bs, response_length], got {tuple(log_prob.shape)}")
        if not log_prob.is_floating_point():
            raise ValueError(f"{who}: log_prob must be floating point, got {log_prob.dtype}")
        for name, value in tensors.items():
            if value is not None and value.shape != log_prob.shape:
                raise ValueError(f"{who}: {name} must have shape {tuple(log_prob.shape)}, got {tuple(value.shape)}")
        rows, width = log_prob.shape
        scale = info.get("loss_scale_factor")
        norms = [
            _as_scalar(who, name, value, log_prob)
            for name, value in (
                ("dp_size", dp_size),
                ("batch_num_tokens", info.get("batch_num_tokens")),
                ("global_batch_size", info.get("global_batch_size")),
                ("loss_scale_factor", width if scale is None else scale),
            )
        ]
        spec = _Spec(objective, mode, clip_low, clip_high, clip_c, _loss_fn(objective, clip_low, clip_high, clip_c))
        padded_rows = round_to_bucket(rows, self.bucket.rows, self.bucket.per_octave)
        padded_width = round_to_bucket(width, self.bucket.width, self.bucket.per_octave)
        padded = [_pad(t, padded_rows, padded_width) for t in tensors.values()]
        loss, metrics = self._objective(spec, *padded, *norms)
        keys = _METRICS[objective]
        values = metrics.tolist() if keys else []  # host: one device-to-host copy, outside the graph
        return loss, dict(zip(keys, values, strict=True))

    def _compute(self, spec, old, lp, adv, mask, weights, dp_size, tokens, seqs, scale):
        keep = mask != 0  # nothing outside the mask reaches a value or a gradient
        old, lp, adv = (torch.where(keep, x, 0.0) for x in (old, lp, adv))
        per_token, metrics = _OBJECTIVES[spec.objective](spec, old, lp, adv, mask)
        if weights is not None:
            per_token = per_token * torch.where(keep, weights, 0.0)
        loss = _aggregate(per_token, mask, spec.mode, dp_size, tokens, seqs, scale)
        if not metrics:
            return loss, None
        dtype = metrics[0].dtype
        for m in metrics[1:]:
            dtype = torch.promote_types(dtype, m.dtype)
        return loss, torch.stack([m.to(dtype) for m in metrics])

    def _bypass(self, old_log_prob, log_prob, advantages, response_mask, mode, config):
        """verl's `bypass_mode`: `old_log_prob` is the rollout policy's; verl's helper computes
        the importance weights and the rejection mask (no gradient), then PPO-clip without the
        weights or REINFORCE with them."""
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        who = self.who
        _check_actor_config(who, config)
        policy_loss = getattr(config, "policy_loss", None)
        corr = _config_value(policy_loss, "rollout_correction", None) if policy_loss is not None else None
        if corr is None:
            raise ValueError(
                f"{who}: config.policy_loss.rollout_correction is required: with loss_mode='bypass_mode', pass "
                "the rollout_correction config"
            )
        loss_type = _config_value(corr, "loss_type", "ppo_clip")
        if loss_type not in ("ppo_clip", "reinforce"):
            raise ValueError(
                f"{who}: rollout_correction.loss_type must be 'reinforce' or 'ppo_clip', got {loss_type!r}"
            )
        with torch.no_grad():
            weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
                old_log_prob=log_prob,
                rollout_log_prob=old_log_prob,
                response_mask=response_mask,
                rollout_is=_config_value(corr, "rollout_is", None),
                rollout_is_threshold=_config_value(corr, "rollout_is_threshold", 2.0),
                rollout_is_batch_normalize=_config_value(corr, "rollout_is_batch_normalize", False),
                rollout_rs=_config_value(corr, "rollout_rs", None),
                rollout_rs_threshold=_config_value(corr, "rollout_rs_threshold", None),
            )
        if loss_type == "reinforce":
            weights = weights.batch["rollout_is_weights"] if weights else None
            loss, metrics = self.compute("reinforce", old_log_prob, log_prob, advantages, mask, mode, config, weights)
        else:  # the ratio to the rollout policy is the importance correction: no weights
            loss, metrics = self.compute("vanilla", old_log_prob, log_prob, advantages, mask, mode, config, None)
        return loss, {**metrics, **corr_metrics}


# ---- verl's registry ------------------------------------------------------------------


def register(
    names: tuple[str, ...] | list[str] = POLICY_LOSSES,
    *,
    compiled: bool | str | Callable[..., Any] = True,
    bucket: BucketGrid = DEFAULT_BUCKET,
    max_buckets: int = 64,
) -> dict[str, Callable[..., Any] | None]:
    """Put a `PolicyLoss` for each of `names` into verl's policy-loss registry (verl's
    `register_policy_loss`), so `get_policy_loss_fn(name)` — and a verl config's
    `policy_loss.loss_mode` — returns this library's. Return what it replaced, by name (None
    where the name was not registered): `restore` puts it back. A name this module does not
    compute is refused with a ValueError naming it (verl's own losses stay in place)."""
    from verl.trainer.ppo import core_algos

    names = tuple(names)
    for name in names:
        if name not in POLICY_LOSSES:
            own = " (it stays verl's own)" if name in VERL_OWN else ""
            raise ValueError(f"register: {name!r} is not computed by compiled_loss{own}; names: {POLICY_LOSSES}")
    losses = {name: PolicyLoss(name, compiled=compiled, bucket=bucket, max_buckets=max_buckets) for name in names}
    replaced = {name: core_algos.POLICY_LOSS_REGISTRY.get(name) for name in names}
    for name, loss in losses.items():
        core_algos.register_policy_loss(name)(loss)
    return replaced


def restore(replaced: Mapping[str, Callable[..., Any] | None]) -> None:
    """Undo `register`: put back what it returned (a name registered by it alone is removed)."""
    from verl.trainer.ppo import core_algos

    for name, fn in replaced.items():
        if fn is None:
            core_algos.POLICY_LOSS_REGISTRY.pop(name, None)
        else:
            core_algos.POLICY_LOSS_REGISTRY[name] = fn
