"""Liger-Kernel's chunked-loss modules with their forward signatures, computed by
compiled_loss: `FusedLinearGRPOLoss`, `FusedLinearCrossEntropyLoss`, `FusedLinearDPOLoss`,
`FusedLinearJSDLoss`.

Each takes hidden states and an LM head where Liger does and never forms the `[N, V]`
logits: the log-probabilities come from `LinearLogits` (`compiled_loss.vocab`: row chunks,
a recomputing backward), the JSD from row chunks recomputed in the backward. The GRPO and
NLL objectives are the library's `ClippedPGLossFn` and `NLLLossFn` with the normalisers the
module computes from its arguments, as TRL's trainers and Liger do. Each module compiles its
objective once per shape bucket (`compiled=True`, fullgraph; a `torch.compile` backend name
or callable in place of True compiles with that backend): the token dimension is padded on
the host to `bucket`'s width grid (masked), so a new completion length recompiles only when
it crosses into a new bucket. A module compiles at most `max_buckets` buckets (default 64;
Dynamo's recompile limit for its objective is raised to that, and each instance has a
budget of its own): the call that would compile one more is refused on the host with a
ValueError naming the bucket and `max_buckets`, before anything compiles. A bucket is
everything the graph is specialised on: the padded shapes, the dtypes, which optional
tensors are None, which require a gradient, and the grad mode.

Dtypes are Liger's: the hidden states may differ from the head (bf16 hidden states with an
fp32 head and bias, say). The head's projection runs in the autocast dtype inside
`torch.autocast`, else in the hidden states' dtype, the head and bias cast to it (Liger's
GRPO casts the head so; its DPO and JSD multiply with `@`, which under autocast does the
same and outside it refuses mixed dtypes, which these modules take); the log-softmax and
everything after it run in fp32, and each gradient comes back in its tensor's dtype.

An argument a module cannot honour at the value given is refused in the constructor (or,
for a forward argument, the call) with a `RefusedOption`: a ValueError naming it, its
`option` one of `REFUSED_OPTIONS[module]`, which says at which values.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from compiled_loss.compile import admit_bucket, compile_loss
from compiled_loss.losses import ClippedPGLossConfig, ClippedPGLossFn, NLLLossFn, calculate_kl
from compiled_loss.packing import BucketGrid
from compiled_loss.packing.layout import round_to_bucket
from compiled_loss.vocab import LinearLogits, token_logprobs

Tensor = torch.Tensor

DEFAULT_BUCKET = BucketGrid(width=16, per_octave=4)
"""Token-dimension buckets: multiples of 16, at most 4 per power-of-two octave."""

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
"""TRL's `GRPOConfig.loss_type` values `FusedLinearGRPOLoss` computes."""

LIGER_GRPO_LOSS_TYPES = (*GRPO_LOSS_TYPES, "sapo", "luspo", "vespo")
"""Liger 0.8.5's GRPO loss types."""

DPO_LOSS_TYPES = ("sigmoid", "bco_pair")
"""Liger's DPO `loss_type` values `FusedLinearDPOLoss` computes."""

LIGER_DPO_LOSS_TYPES = (
    *DPO_LOSS_TYPES,
    *("hinge", "exo_pair", "nca_pair", "robust", "sppo_hard", "apo_zero", "apo_down", "discopop"),
)
"""Liger 0.8.5's DPO loss types."""

_CE_NEUTRAL = {
    "ce_weight": None,
    "lse_square_scale": 0.0,
    "label_smoothing": 0.0,
    "softcap": None,
    "return_z_loss": False,
    "accum_dtype": None,
    "use_token_scaling": False,
    "return_token_accuracy": False,
    "return_predicted_tokens": False,
}
"""`FusedLinearCrossEntropyLoss`'s options that only their neutral value (Liger's default) honours."""

REFUSED_OPTIONS: dict[str, dict[str, str]] = {
    "FusedLinearGRPOLoss": {
        "loss_type": "'sapo', 'luspo' and 'vespo': no objective of the library computes them",
        "epsilon_high": "below 1 with loss_type='cispo': Liger's CISPO bounds the ratio at epsilon_high, the "
        "library's (use_cispo) at 1 + ratio_clip_max with ratio_clip_max >= 0",
        "delta": "at most 1, or below 1 + epsilon_high: the library's dual clip (ratio_clip_c > 1) equals Liger's "
        "two-sided clipping from 1 + epsilon_high up",
    },
    "FusedLinearCrossEntropyLoss": {name: f"other than {value!r}" for name, value in _CE_NEUTRAL.items()},
    "FusedLinearDPOLoss": {
        "loss_type": ", ".join(repr(t) for t in LIGER_DPO_LOSS_TYPES[len(DPO_LOSS_TYPES) :])
        + ": no objective of the library computes them",
        "label_smoothing": "other than 0: only Liger's 'robust' and 'exo_pair' read it (TRL's sigmoid loss reads it as "
        "cDPO, Liger's does not)",
        "discopop_tau": "other than 0.05: only Liger's 'discopop' reads it",
    },
    "FusedLinearJSDLoss": {},
}
"""Per module, each Liger argument it may refuse by name (`RefusedOption`), and at which values."""


class RefusedOption(ValueError):
    """A Liger argument at a value the module `who` cannot honour; `option` names it (one of
    `REFUSED_OPTIONS[who]`)."""

    def __init__(self, who: str, option: str, message: str) -> None:
        super().__init__(f"{who}: {message}")
        self.who, self.option = who, option


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _refuse(who: str, option: str, message: str) -> None:
    raise RefusedOption(who, option, message)


def _neutral(who: str, option: str, value: Any, default: Any, reader: str) -> None:
    """`option` at its default: only `reader`, which the module does not compute, reads it —
    another value would change nothing here while the caller means it to."""
    if not (value is default or value == default):
        _refuse(
            who,
            option,
            f"{option} is read only by {reader}, which this module does not compute: leave it at {default!r}, "
            f"got {value!r}",
        )


def _shape(who: str, name: str, value: Tensor | None, shape: tuple[int, ...]) -> None:
    """`value` (when given) has exactly `shape`."""
    if value is not None and tuple(value.shape) != shape:
        raise ValueError(f"{who}: {name} must have shape {shape}, got {tuple(value.shape)}")


def _pad_width(width: int, *tensors: Tensor | None) -> list[Tensor | None]:
    """Each tensor zero-padded along dimension 1 to `width`, contiguous (a view's strides,
    which compiled code specialises on, never reach it)."""
    out = []
    for t in tensors:
        if t is not None and t.shape[1] != width:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
            t = F.pad(t, pad)
        out.append(None if t is None else t.contiguous())
    return out


def _describe(value: Any) -> str:
    """One argument of a compiled objective as its bucket key writes it: a tensor's dtype,
    shape, strides when not contiguous and `grad` when it requires one; anything else as is."""
    if not isinstance(value, Tensor):
        return str(value).removeprefix("torch.")
    text = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if not value.is_contiguous():
        text += f" strides {list(value.stride())}"
    return text + (" grad" if value.requires_grad else "")


def _bucket(args: tuple[Any, ...]) -> str:
    """The shape bucket of a call to a compiled objective: everything its graph is
    specialised on — each argument (`_describe`: which optional tensors are None, every
    shape and dtype) and the grad mode."""
    return f"({', '.join(map(_describe, args))}; grad {'on' if torch.is_grad_enabled() else 'off'})"


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """The bound `method` on a copy of its function with a code object of its own. Dynamo
    keeps a function's graphs, and counts them against the recompile limit, per code
    object: without the copy, every instance of a module class (each with its own config)
    would draw on one shared budget of graphs."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__, own.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
    return types.MethodType(own, method.__self__)


class _Objective:
    """A module's objective, compiled or not, with the shape buckets it has compiled for.

    `compiled`: False runs `method` eagerly (an int is read as a bool, as Liger reads it);
    True compiles it with Inductor, a backend name
    or callable with that `torch.compile` backend (`"aot_eager"`, say) — fullgraph, static
    shapes: one graph per shape bucket, at most `max_buckets` of them (Dynamo's recompile
    limit for it, raised to that). A call that would compile bucket `max_buckets + 1` is
    refused with a ValueError before anything compiles."""

    def __init__(self, who: str, method: Callable[..., Any], compiled: Any, max_buckets: int) -> None:
        _require(
            isinstance(max_buckets, int) and not isinstance(max_buckets, bool) and max_buckets >= 1,
            f"{who}: max_buckets must be an int >= 1, got {max_buckets!r}",
        )
        _require(
            isinstance(compiled, (bool, int, str)) or callable(compiled),
            f"{who}: compiled must be a bool or a torch.compile backend (a name or a callable), got {compiled!r}",
        )
        if isinstance(compiled, int):  # a bool, or an int read as one (Liger's `if compiled`)
            compiled = bool(compiled)
        self.who, self.max_buckets, self.compiled = who, max_buckets, compiled is not False
        self.buckets: set[str] = set()
        self.fn = method
        if self.compiled:
            backend = "inductor" if compiled is True else compiled
            self.fn = compile_loss(
                _own_code(method), fullgraph=True, dynamic=False, backend=backend, recompile_limit=max_buckets
            )

    def __call__(self, *args: Any) -> Any:
        if self.compiled:
            admit_bucket(self.buckets, _bucket(args), self.max_buckets, self.who, "max_buckets")
        return self.fn(*args)


def _projection_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype an LM head's projection of `hidden` runs in, as in Liger: inside
    `torch.autocast` the autocast dtype, outside it the hidden states' own (bf16 hidden
    states and an fp32 head: the head cast to bf16). Read on the host, passed to the
    objective."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """`hidden @ weightᵀ + bias` in `dtype` (each factor cast to it: its gradient comes back
    in its own dtype), then fp32."""
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.to(dtype), weight.to(dtype), bias).float()


def _token_logprobs(
    hidden, weight, bias, ids, temperature: float, chunk_size, dtype: torch.dtype, softcap: float | None = None
) -> Tensor:
    """`log softmax(cap(hidden @ Wᵀ + b) / τ)[ids]`, fp32, shaped like `ids`, from `LinearLogits`
    (the projection in `dtype`; `cap` the softcap `c · tanh(z / c)`, or none)."""
    logits = LinearLogits(hidden.reshape(-1, hidden.shape[-1]), weight, bias, dtype=dtype, softcap=softcap)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, ids.reshape(-1), chunk_size=chunk_size).view(ids.shape)


def _check_grpo_options(
    loss_type: str,
    max_completion_length: int | None,
    importance_sampling_level: str,
    epsilon_high: float,
    delta: float | None,
) -> None:
    """FusedLinearGRPOLoss's options Liger names and this library computes (else refused by name)."""
    who = "FusedLinearGRPOLoss"
    _require(
        loss_type in LIGER_GRPO_LOSS_TYPES,
        f"{who}: Unknown loss type {loss_type!r}: Liger's are {LIGER_GRPO_LOSS_TYPES}",
    )
    if loss_type not in GRPO_LOSS_TYPES:
        _refuse(
            who,
            "loss_type",
            f"loss_type={loss_type!r} is not computed here (no objective of the library computes it): "
            f"loss_type must be one of {GRPO_LOSS_TYPES}",
        )
    _require(
        loss_type != "dr_grpo" or (max_completion_length or 0) > 0,
        f"{who}: loss_type='dr_grpo' needs max_completion_length > 0, got {max_completion_length!r}",
    )
    _require(
        importance_sampling_level in ("token", "sequence"),
        f"{who}: Unknown importance sampling level {importance_sampling_level!r}: 'token' or 'sequence'",
    )
    cispo = loss_type == "cispo"
    if cispo and not epsilon_high >= 1:
        _refuse(
            who,
            "epsilon_high",
            f"loss_type='cispo' bounds the ratio at epsilon_high, and the library's CISPO bounds it at 1 + "
            f"ratio_clip_max with ratio_clip_max >= 0: epsilon_high must be >= 1, got {epsilon_high!r}",
        )
    if delta is not None and not cispo and not (delta > 1 and delta >= 1 + epsilon_high):
        _refuse(
            who,
            "delta",
            f"delta (two-sided clipping) is the library's dual clip (ratio_clip_c > 1), equal to Liger's from 1 + "
            f"epsilon_high up: delta must be > 1 and >= 1 + epsilon_high = {1 + epsilon_high!r}, got {delta!r}",
        )


def _grpo_loss_fn(loss_type: str, epsilon_low: float, epsilon_high: float, delta: float | None) -> ClippedPGLossFn:
    """The library's objective for Liger's GRPO options: PPO's clip (with the dual clip at
    `delta`) or CISPO, token- or sequence-level normalised as the loss type says."""
    cispo = loss_type == "cispo"
    return ClippedPGLossFn(
        ClippedPGLossConfig(
            # CISPO: no lower bound (a ratio is never below 0), the upper one at epsilon_high
            ratio_clip_min=1.0 if cispo else epsilon_low,
            ratio_clip_max=epsilon_high - 1.0 if cispo else epsilon_high,
            ratio_clip_c=None if cispo else delta,
            use_cispo=cispo,
            use_importance_sampling_correction=True,  # vllm_is_ratio's weights; exactly 1 without it
            reference_policy_kl_penalty=0.0,  # the KL term is TRL's: see _grpo
            token_level_loss=loss_type != "grpo",
            metrics_level="minimal",
        )
    )


class FusedLinearGRPOLoss(nn.Module):
    """Liger's `LigerFusedLinearGRPOLoss`: TRL's GRPO objective from the policy's hidden
    states and LM head, with `ClippedPGLossFn`'s semantics.

    `forward(_input [B, T, H], lin_weight [V, H], selected_token_ids [B, T], attention_mask
    [B, T] (the loss mask), advantages [B], bias=None, ref_per_token_logps=None,
    old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
    vllm_is_ratio=None, num_items_in_batch=None)` → `(loss, [kl_mean (β ≠ 0; 0 without
    use_ref_model), clip_ratio])`, as Liger returns them. `_input[:, t]` is the hidden state
    that predicts `selected_token_ids[:, t]`. Without `old_per_token_logps` the ratio is 1
    (the detached log-probs, on-policy).

    `loss_type` sets the normaliser (TRL's): `grpo` the mean over sequences of each
    sequence's token mean; `bnpo` the batch's valid tokens; `dr_grpo` `B ·
    max_completion_length`; `dapo` and `cispo` `num_items_in_batch / world size` (default:
    the valid tokens summed over the default process group). `cispo` is the library's CISPO
    (`use_cispo`): the detached ratio, bounded above at `epsilon_high`, times the log-prob;
    the others PPO's clipped surrogate. `importance_sampling_level="sequence"` is GSPO: each
    token's ratio is its sequence's, the exponential of the mean log-ratio over its kept
    tokens — the library's clipped objective over each sequence's mean log-probs, which for
    `grpo` equals `ClippedPGLossFn`'s GSPO (`sequence_level_importance_ratios`) and for the
    token normalisers reduces over tokens as TRL does (not with `cispo`, as in Liger).
    `delta` (two-sided clipping) is the library's dual clip (`ratio_clip_c=delta`), which
    equals it for `delta >= 1 + epsilon_high`; `cispo` ignores it, as Liger and TRL do.
    `vllm_is_ratio` (`[B, T]`, `[B, 1]` or `[B]`) weights each token's policy term, as TRL's
    vLLM importance sampling does: the library's importance-sampling correction with those
    weights (`use_importance_sampling_correction`, the generation log-probs `old -
    log(vllm_is_ratio)`).

    With `use_ref_model` and β ≠ 0, the reference log-probs are `ref_per_token_logps`, else
    computed (no gradient) from `ref_input [B, T, H']`, `ref_weight [V, H']` and `ref_bias`
    at the policy's temperature; given both, `ref_per_token_logps` is used, with Liger's
    warning. The KL term is TRL's: k3 (`exp(ref - lp) - (ref - lp) - 1`), unclamped, reduced
    like the policy term; with `use_bias_correction_kl` weighted by the importance ratio (the
    sequence's under GSPO), whose gradient is the score-function term of `ClippedPGLossFn`'s
    reference KL (which also clamps). The `sapo_*` and `vespo_*` options are read only by the
    loss types refused here, and ignored as Liger ignores them for the others.
    `chunk_size` is in token rows (Liger's counts sequences; default: the library's, about
    16 MiB of fp32 logits per chunk). Every argument of Liger's is taken, in Liger's order;
    `REFUSED_OPTIONS["FusedLinearGRPOLoss"]` lists the values refused.

    Beyond Liger's signature, `softcap` (default None) is the model's final-logit
    softcapping (Gemma's `final_logit_softcapping`, from
    `compiled_loss.integrations.hf.head_transform`): the policy's (and a reference head's)
    logits are `softcap · tanh(z / softcap)` of the projection `z`, applied inside each chunk
    with its gradient, before the temperature divides them, as the model's forward and TRL
    do. A logit scale folds into `_input` and `bias` on the caller's side (the TRL trainer
    does so).
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool | str | Callable[..., Any] = True,
        use_ref_model: bool = True,
        chunk_size: int | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        softcap: float | None = None,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        super().__init__()
        _check_grpo_options(loss_type, max_completion_length, importance_sampling_level, epsilon_high, delta)
        _require(temperature > 0, f"FusedLinearGRPOLoss: temperature must be > 0, got {temperature!r}")
        _require(
            softcap is None
            or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and 0 < softcap < math.inf),
            f"FusedLinearGRPOLoss: softcap must be a finite number > 0 or None, got {softcap!r}",
        )
        self.softcap = None if softcap is None else float(softcap)
        self.beta, self.loss_type, self.max_completion_length = beta, loss_type, max_completion_length
        self.use_ref_model, self.temperature, self.chunk_size = use_ref_model, temperature, chunk_size
        self.epsilon_low, self.epsilon_high, self.bucket = epsilon_low, epsilon_high, bucket
        self.importance_sampling_level, self.delta = importance_sampling_level, delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.loss_fn = _grpo_loss_fn(loss_type, epsilon_low, epsilon_high, delta)
        self._objective = _Objective("FusedLinearGRPOLoss", self._grpo, compiled, max_buckets)

    def forward(
        self,
        _input: Tensor,
        lin_weight: Tensor,
        selected_token_ids: Tensor,
        attention_mask: Tensor,
        advantages: Tensor,
        bias: Tensor | None = None,
        ref_per_token_logps: Tensor | None = None,
        old_per_token_logps: Tensor | None = None,
        ref_input: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
        vllm_is_ratio: Tensor | None = None,
        num_items_in_batch: Tensor | int | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        who = "FusedLinearGRPOLoss"
        _require(
            self.importance_sampling_level == "token" or self.loss_type != "cispo",
            f"{who}: Sequence-level importance sampling is not supported for loss_type='cispo'. "
            "Use importance_sampling_level='token' instead.",
        )
        if _input.dim() != 3:
            raise ValueError(f"{who}: _input must be [B, T, H], got {tuple(_input.shape)}")
        rows, width = _input.shape[:2]
        for name, value in (("selected_token_ids", selected_token_ids), ("attention_mask", attention_mask)):
            _shape(who, name, value, (rows, width))
        _shape(who, "advantages", advantages, (rows,))
        _shape(who, "old_per_token_logps", old_per_token_logps, (rows, width))
        _shape(who, "ref_per_token_logps", ref_per_token_logps, (rows, width))
        kl_reference = self.use_ref_model and self.beta != 0  # else no KL term reads a reference
        ref_input, ref_weight, ref_bias = self._reference_head(
            kl_reference, ref_per_token_logps is not None, ref_input, ref_weight, ref_bias, (rows, width)
        )
        log_is_ratio = None
        if vllm_is_ratio is not None:
            _require(
                tuple(vllm_is_ratio.shape) in ((rows,), (rows, 1), (rows, width)),
                f"{who}: vllm_is_ratio must have shape ({rows},), ({rows}, 1) or ({rows}, {width}), got "
                f"{tuple(vllm_is_ratio.shape)}",
            )
            log_is_ratio = torch.log(vllm_is_ratio.float().reshape(rows, -1).expand(rows, width))
        mask = attention_mask.float()
        seqs, toks = self._normalisers(mask, num_items_in_batch)
        padded = round_to_bucket(width, self.bucket.width, self.bucket.per_octave)
        old, ref = (None if x is None else x.float() for x in (old_per_token_logps, ref_per_token_logps))
        hidden, ids, mask, old, ref, ref_hidden, log_is_ratio = _pad_width(
            padded, _input, selected_token_ids, mask, old, ref, ref_input, log_is_ratio
        )
        if not kl_reference:
            ref = None
        dtypes = _projection_dtype(_input), None if ref_input is None else _projection_dtype(ref_input)
        return self._objective(
            hidden, lin_weight, bias, ids, mask, advantages.float(), old, ref, ref_hidden, ref_weight, ref_bias,
            log_is_ratio, seqs, toks, *dtypes,
        )  # fmt: skip

    def _reference_head(
        self,
        kl_reference: bool,
        has_ref_logps: bool,
        ref_input: Tensor | None,
        ref_weight: Tensor | None,
        ref_bias: Tensor | None,
        rows_width: tuple[int, int],
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The reference model's hidden states and head where the KL term reads them (the
        reference's log-probs, where given, win as in Liger); None each otherwise."""
        who = "FusedLinearGRPOLoss"
        if self.use_ref_model and has_ref_logps and ref_input is not None:
            warnings.warn(
                f"{who}: Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.", stacklevel=3
            )
        if not kl_reference or has_ref_logps:
            return None, None, None
        _require(
            ref_input is not None and ref_weight is not None,
            f"{who}: use_ref_model=True with beta={self.beta} needs ref_per_token_logps [B, T], or ref_input "
            "[B, T, H'] with ref_weight [V, H']",
        )
        _shape(who, "ref_input", ref_input, (*rows_width, ref_weight.shape[-1]))
        return ref_input, ref_weight, ref_bias

    def _normalisers(self, mask: Tensor, num_items_in_batch: Tensor | int | None) -> tuple[Tensor, Tensor]:
        """`(sequences, tokens)` the loss divides by, as 0-d fp32 tensors (no host sync)."""
        rows = mask.shape[0]
        seqs = mask.new_tensor(float(rows))
        if self.loss_type == "dr_grpo":
            return seqs, mask.new_tensor(float(rows * self.max_completion_length))
        if self.loss_type in ("dapo", "cispo"):
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            if num_items_in_batch is None:
                total = mask.sum()
                if world > 1:
                    torch.distributed.all_reduce(total)
            else:
                total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
            return seqs, (total / world).clamp(min=1.0)
        return seqs, mask.sum().clamp(min=1.0)

    def _grpo(
        self, hidden, weight, bias, ids, mask, advantages, old, ref, ref_hidden, ref_weight, ref_bias, log_is_ratio,
        seqs, toks, dtype, ref_dtype,
    ):  # fmt: skip
        lp = _token_logprobs(hidden, weight, bias, ids, self.temperature, self.chunk_size, dtype, self.softcap) * mask
        old = lp.detach() if old is None else old
        if ref is None and ref_hidden is not None:
            with torch.no_grad():
                head = ref_weight.detach(), None if ref_bias is None else ref_bias.detach()
                ref = _token_logprobs(
                    ref_hidden.detach(), *head, ids, self.temperature, self.chunk_size, ref_dtype, self.softcap
                )
        ref = lp.detach() if ref is None else ref
        if self.importance_sampling_level == "sequence":
            # GSPO: each token's ratio is its sequence's, exp of the mean log-ratio over its kept
            # tokens: the clipped objective over each sequence's mean log-probs.
            count = mask.sum(-1, keepdim=True).clamp(min=1.0)
            ratio_lp = (lp.sum(-1, keepdim=True) / count).expand_as(lp)
            ratio_old = ((old * mask).sum(-1, keepdim=True) / count).expand_as(lp)
        else:
            ratio_lp, ratio_old = lp, old
        # vLLM's importance weights exp(prev - gen): the generation log-probs old - log(weight)
        generation = ratio_old if log_is_ratio is None else ratio_old - log_is_ratio

        def shifted(x: Tensor) -> Tensor:  # entry t+1 is the log-prob of token t (NeMo-RL's alignment)
            return F.pad(x, (1, 0))

        data = {
            "token_mask": shifted(mask),
            "sample_mask": torch.ones_like(advantages),
            "advantages": shifted(advantages[:, None].expand_as(mask)),
            "prev_logprobs": shifted(ratio_old),
            "generation_logprobs": shifted(generation),
        }
        loss, _ = self.loss_fn(next_token_logprobs=ratio_lp, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
        count = mask.sum().clamp(min=1.0)
        ratio = torch.exp(ratio_lp.detach() - ratio_old)
        adv = advantages[:, None]
        if self.loss_type == "cispo":
            upper, lower = ratio > self.epsilon_high, torch.zeros_like(ratio, dtype=torch.bool)
        else:
            upper, lower = ratio > 1 + self.epsilon_high, ratio < 1 - self.epsilon_low
        clipped = (lower & (adv < 0)) | (upper & (adv > 0))
        metrics = [(clipped.float() * mask).sum() / count]
        if self.beta != 0:
            # TRL's k3 term, unclamped; with use_bias_correction_kl weighted by the importance ratio.
            # Without use_ref_model the reference is the detached policy (Liger's): 0, gradient 0.
            weight = torch.exp(ratio_lp - ratio_old) if self.use_bias_correction_kl else None
            kl = calculate_kl(lp, ref, "k3", None, None, weight) * mask
            if self.loss_type == "grpo":
                loss = loss + self.beta * (kl.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / seqs
            else:
                loss = loss + self.beta * kl.sum() / toks
            metrics.insert(0, kl.detach().sum() / count)
        return loss, metrics


class FusedLinearCrossEntropyLoss(nn.Module):
    """Liger's `LigerFusedLinearCrossEntropyLoss`: `forward(lin_weight [V, H], _input [N, H],
    target [N], bias=None)` → the cross-entropy of `target` under `_input @ lin_weightᵀ +
    bias`, positions where `target == ignore_index` left out: `reduction="mean"` (over the
    other positions: `NLLLossFn`), `"sum"` or `"none"` (`[N]`, 0 where ignored).
    `ce_weight`, `lse_square_scale`, `label_smoothing`, `softcap`, `return_z_loss`,
    `accum_dtype`, `use_token_scaling`, `return_token_accuracy` and `return_predicted_tokens`
    keep their neutral defaults (others are refused). Every argument of Liger's is taken, in
    Liger's order (`compiled`, `chunk_size` and the bucket options follow them)."""

    def __init__(
        self,
        ce_weight: Tensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        accum_dtype: torch.dtype | None = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        compiled: bool | str | Callable[..., Any] = True,
        chunk_size: int | None = None,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        super().__init__()
        who = "FusedLinearCrossEntropyLoss"
        _require(
            reduction in ("mean", "sum", "none"), f"{who}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
        given = dict(ce_weight=ce_weight, lse_square_scale=lse_square_scale, label_smoothing=label_smoothing)
        given |= dict(softcap=softcap, return_z_loss=return_z_loss, accum_dtype=accum_dtype)
        given |= dict(use_token_scaling=use_token_scaling, return_token_accuracy=return_token_accuracy)
        given |= dict(return_predicted_tokens=return_predicted_tokens)
        for name, neutral in _CE_NEUTRAL.items():
            if not (given[name] is neutral or given[name] == neutral):
                _refuse(who, name, f"{name} is not supported, got {given[name]!r}")
        self.ignore_index, self.reduction, self.chunk_size, self.bucket = ignore_index, reduction, chunk_size, bucket
        self.loss_fn = NLLLossFn()
        self._objective = _Objective("FusedLinearCrossEntropyLoss", self._cross_entropy, compiled, max_buckets)

    def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        who = "FusedLinearCrossEntropyLoss"
        if _input.dim() != 2:
            raise ValueError(f"{who}: _input must be [N, H], got {tuple(_input.shape)}")
        _shape(who, "target", target, (_input.shape[0],))
        rows = _input.shape[0]
        keep = target != self.ignore_index
        ids = torch.where(keep, target, 0)
        padded = round_to_bucket(rows, self.bucket.width, self.bucket.per_octave)
        hidden, ids, mask = _pad_width(padded, _input[None], ids[None], keep[None].float())
        divisor = mask.sum().clamp(min=1.0) if self.reduction == "mean" else mask.new_ones(())
        losses = self._objective(hidden, lin_weight, bias, ids, mask, divisor, _projection_dtype(_input))
        if self.reduction == "none":
            return losses[0, :rows]
        return losses.sum() if self.reduction == "sum" else losses

    def _cross_entropy(self, hidden, weight, bias, ids, mask, divisor, dtype):
        lp = _token_logprobs(hidden, weight, bias, ids, 1.0, self.chunk_size, dtype)
        if self.reduction == "none":
            return -lp * mask
        data = {"token_mask": F.pad(mask, (1, 0)), "sample_mask": mask.new_ones(1)}
        loss, _ = self.loss_fn(lp, data, global_valid_seqs=None, global_valid_toks=divisor)
        return loss


class FusedLinearDPOLoss(nn.Module):
    """Liger's `LigerFusedLinearDPOLoss` (`loss_type` sigmoid or bco_pair): `forward(lin_weight [V, H],
    _input [2B, T, H], target [2B, T], bias=None, ref_input=None, ref_weight=None,
    ref_bias=None)`, the first `B` rows chosen and the last `B` rejected, `target ==
    ignore_index` outside the responses. Returns `(loss, (chosen_logps [B], rejected_logps
    [B], chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards [B],
    rejected_rewards [B]))` as Liger does, with the rewards `c_w = β·(c - c_ref)` and `r_w =
    β·(r - r_ref)`: `loss = mean(ℓ) + alpha · nll_loss`, where `ℓ = -log σ(c_w - r_w)` for
    `sigmoid` (DPO's Bradley–Terry term, `DPOLossFn`'s) and `ℓ = -log σ(c_w) - log σ(-r_w)`
    for `bco_pair` (`MPOLossFn`'s BCO term at a reward shift of 0); the NLL is that of the
    chosen rows, with `compute_nll_loss`: their summed
    token NLL over their kept tokens; NaN, as in Liger, when no chosen token is kept, adding
    nothing to the gradients), each row's log-prob summed over its response (averaged with
    `average_log_prob`), the reference's from `ref_input` / `ref_weight` (0 without
    `use_ref_model`). Without `compute_nll_loss`, `nll_loss` is 0 and the loss the preference
    term, also when no chosen token is kept, where Liger's are NaN (its unused NLL of 0
    divided by that count of 0). The logit means come from the column sums of the head,
    never from the logits. `label_smoothing` and `discopop_tau`, read only by Liger's other
    loss types, keep their defaults; `REFUSED_OPTIONS["FusedLinearDPOLoss"]` lists the values
    refused. Every argument of Liger's is taken, in Liger's order."""

    def __init__(
        self,
        ignore_index: int = -100,
        beta: float = 0.1,
        alpha: float = 1.0,
        compute_nll_loss: bool = False,
        compiled: bool | str | Callable[..., Any] = True,
        use_ref_model: bool = True,
        average_log_prob: bool = False,
        chunk_size: int | None = None,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        discopop_tau: float = 0.05,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        super().__init__()
        who = "FusedLinearDPOLoss"
        _require(
            loss_type in LIGER_DPO_LOSS_TYPES,
            f"{who}: Unsupported loss_type: {loss_type!r}. Liger's are {LIGER_DPO_LOSS_TYPES}",
        )
        if loss_type not in DPO_LOSS_TYPES:
            _refuse(
                who,
                "loss_type",
                f"loss_type={loss_type!r} is not computed here (no objective of the library computes it): "
                f"loss_type must be one of {DPO_LOSS_TYPES}",
            )
        _neutral(who, "label_smoothing", label_smoothing, 0.0, "Liger's loss_type='robust' and 'exo_pair'")
        _neutral(who, "discopop_tau", discopop_tau, 0.05, "Liger's loss_type='discopop'")
        self.loss_type = loss_type
        self.ignore_index, self.beta, self.alpha, self.compute_nll_loss = ignore_index, beta, alpha, compute_nll_loss
        self.use_ref_model, self.average_log_prob, self.chunk_size = use_ref_model, average_log_prob, chunk_size
        self.bucket = bucket
        self._objective = _Objective("FusedLinearDPOLoss", self._dpo, compiled, max_buckets)

    def forward(
        self,
        lin_weight: Tensor,
        _input: Tensor,
        target: Tensor,
        bias: Tensor | None = None,
        ref_input: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        who = "FusedLinearDPOLoss"
        if _input.dim() != 3 or _input.shape[0] % 2:
            raise ValueError(
                f"{who}: _input must be [2B, T, H] (chosen rows, then rejected), got {tuple(_input.shape)}"
            )
        _shape(who, "target", target, tuple(_input.shape[:2]))
        _require(
            not self.use_ref_model or (ref_input is not None and ref_weight is not None),
            f"{who}: use_ref_model=True needs ref_input [2B, T, H'] and ref_weight [V, H']",
        )
        if self.use_ref_model:
            _shape(who, "ref_input", ref_input, tuple(_input.shape[:2]) + (ref_weight.shape[1],))
        keep = target != self.ignore_index
        ids = torch.where(keep, target, 0)
        padded = round_to_bucket(_input.shape[1], self.bucket.width, self.bucket.per_octave)
        hidden, ids, mask, ref_hidden = _pad_width(
            padded, _input, ids, keep.float(), ref_input if self.use_ref_model else None
        )
        # Liger's logit means run over every position of the unpadded rows (ignored ones too).
        count = _input.shape[0] // 2 * _input.shape[1] * lin_weight.shape[0]
        positions = torch.tensor(float(count), device=_input.device)
        dtypes = _projection_dtype(_input), None if ref_hidden is None else _projection_dtype(ref_hidden)
        return self._objective(
            hidden, lin_weight, bias, ids, mask, ref_hidden, ref_weight, ref_bias, positions, *dtypes
        )

    def _sums(self, hidden, weight, bias, ids, mask, dtype):
        """Per row: the summed log-prob of its kept targets."""
        return (_token_logprobs(hidden, weight, bias, ids, 1.0, self.chunk_size, dtype) * mask).sum(-1)

    def _dpo(self, hidden, weight, bias, ids, mask, ref_hidden, ref_weight, ref_bias, positions, dtype, ref_dtype):
        pairs = hidden.shape[0] // 2
        sums = self._sums(hidden, weight, bias, ids, mask, dtype)
        ref = torch.zeros_like(sums)
        if ref_hidden is not None:
            with torch.no_grad():
                ref = self._sums(ref_hidden.detach(), ref_weight.detach(), ref_bias, ids, mask, ref_dtype)
        logps = sums
        if self.average_log_prob:
            logps, ref = sums / mask.sum(-1), ref / mask.sum(-1)
        chosen, rejected = logps[:pairs], logps[pairs:]
        chosen_rewards = self.beta * (chosen - ref[:pairs])
        rejected_rewards = self.beta * (rejected - ref[pairs:])
        if self.loss_type == "sigmoid":
            loss = -F.logsigmoid(chosen_rewards - rejected_rewards).sum() / pairs
        else:  # bco_pair
            loss = -(F.logsigmoid(chosen_rewards) + F.logsigmoid(-rejected_rewards)).sum() / pairs
        nll = sums.new_zeros(())
        if self.compute_nll_loss:
            # Liger's NLL of the chosen rows; with no kept chosen target it is 0 / 0: NaN, with
            # a zero gradient (torch's nll_loss skips ignored targets in its backward).
            count = mask[:pairs].sum()
            none_kept = torch.where(count > 0, 0.0, math.nan)
            nll = -sums[:pairs].sum() / torch.where(count > 0, count, 1.0) + none_kept
            loss = loss + self.alpha * nll
        # The logits' sum over a row's positions and the vocabulary: (Σ_t h_t) · Σ_v W_v + T · Σ_v b_v.
        row_sums = hidden.detach().float().sum(1) @ weight.detach().float().sum(0)
        bias_sum = 0.0 if bias is None else bias.detach().float().sum() * (positions / weight.shape[0] / pairs)
        halves = (slice(0, pairs), slice(pairs, None))
        means = [(row_sums[half].sum() + pairs * bias_sum) / positions for half in halves]
        return loss, (chosen, rejected, *means, nll, chosen_rewards, rejected_rewards)


class FusedLinearJSDLoss(nn.Module):
    """Liger's `LigerFusedLinearJSDLoss`: `forward(student_input [N, H], student_weight [V, H],
    teacher_input [N, H'], teacher_weight [V, H'], true_labels [N], student_bias=None,
    teacher_bias=None)` → `weight_hard_loss · CE(true_labels) + weight_soft_loss ·
    JSD_β(student ‖ teacher)`, both summed over the positions whose label is not
    `ignore_index` and divided by their count (the CE only when weighted or returned). The
    generalised JSD at temperature `τ`: β = 0 is the forward KL(teacher ‖ student), β = 1
    the reverse KL(student ‖ teacher). Computed in row chunks (`chunk_size` rows, at most 16
    chunks); each chunk's student and teacher logits exist only inside its chunk and are
    recomputed in the backward. With
    `return_soft_hard_loss`, `(loss, soft_loss, hard_loss)` as Liger returns them (each
    divided by the count). Every argument of Liger's is taken, in Liger's order."""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool | str | Callable[..., Any] = True,
        chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
        bucket: BucketGrid = DEFAULT_BUCKET,
        max_buckets: int = 64,
    ) -> None:
        super().__init__()
        who = "FusedLinearJSDLoss"
        _require(0.0 <= beta <= 1.0, f"{who}: beta must be in [0, 1], got {beta!r}")
        _require(temperature > 0, f"{who}: temperature must be > 0, got {temperature!r}")
        _require(chunk_size >= 1, f"{who}: chunk_size must be >= 1, got {chunk_size!r}")
        self.weight_hard_loss, self.weight_soft_loss, self.beta = weight_hard_loss, weight_soft_loss, beta
        self.ignore_index, self.temperature, self.chunk_size = ignore_index, temperature, chunk_size
        self.bucket, self.return_soft_hard_loss = bucket, return_soft_hard_loss
        self._objective = _Objective("FusedLinearJSDLoss", self._distillation, compiled, max_buckets)

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_input: Tensor,
        teacher_weight: Tensor,
        true_labels: Tensor,
        student_bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        who = "FusedLinearJSDLoss"
        if student_input.dim() != 2 or teacher_input.dim() != 2 or teacher_input.shape[0] != student_input.shape[0]:
            raise ValueError(
                f"{who}: student_input must be [N, H] and teacher_input [N, H'], got "
                f"{tuple(student_input.shape)} and {tuple(teacher_input.shape)}"
            )
        _require(
            teacher_weight.shape[0] == student_weight.shape[0],
            f"{who}: student_weight and teacher_weight must have the same vocabulary (rows), got "
            f"{tuple(student_weight.shape)} and {tuple(teacher_weight.shape)}",
        )
        _shape(who, "true_labels", true_labels, (student_input.shape[0],))
        rows = student_input.shape[0]
        keep = true_labels != self.ignore_index
        padded = round_to_bucket(rows, self.bucket.width, self.bucket.per_octave)
        ids = torch.where(keep, true_labels, 0)
        student, teacher, ids, mask = _pad_width(
            padded, student_input[None], teacher_input[None], ids[None], keep[None].float()
        )
        count = mask.sum().clamp(min=1.0)
        student, teacher, ids, mask = student[0], teacher[0], ids[0], mask[0]
        dtypes = _projection_dtype(student_input), _projection_dtype(teacher_input)
        return self._objective(
            student, student_weight, student_bias, teacher, teacher_weight, teacher_bias, ids, mask, count, *dtypes
        )

    def _distillation(self, student, weight, bias, teacher, t_weight, t_bias, ids, mask, count, dtype, t_dtype):
        rows = student.shape[0]
        step = max(self.chunk_size, -(-rows // 16))
        total = student.new_zeros(2, dtype=torch.float32)
        for start in range(0, rows, step):
            part = slice(start, min(start + step, rows))
            total = total + torch.utils.checkpoint.checkpoint(
                self._chunk,
                student[part],
                weight,
                bias,
                teacher[part].detach(),
                t_weight.detach(),
                None if t_bias is None else t_bias.detach(),
                ids[part],
                mask[part],
                dtype,
                t_dtype,
                use_reentrant=False,
            )
        hard, soft = total / count
        loss = self.weight_hard_loss * hard + self.weight_soft_loss * soft
        return (loss, soft, hard) if self.return_soft_hard_loss else loss

    def _chunk(self, student, weight, bias, teacher, t_weight, t_bias, ids, mask, dtype, t_dtype):
        """`[Σ CE, Σ JSD_β]` over this chunk's kept rows."""
        logits = _linear(student, weight, bias, dtype)
        if self.weight_hard_loss != 0 or self.return_soft_hard_loss:
            hard = F.nll_loss(logits.log_softmax(-1), ids, reduction="none")
        else:  # neither weighted nor returned: not computed
            hard = logits.new_zeros(logits.shape[:1])
        s = (logits / self.temperature).log_softmax(-1)
        t = (_linear(teacher, t_weight, t_bias, t_dtype) / self.temperature).log_softmax(-1)
        if self.beta == 0:
            soft = (t.exp() * (t - s)).sum(-1)
        elif self.beta == 1:
            soft = (s.exp() * (s - t)).sum(-1)
        else:
            m = torch.logsumexp(torch.stack([s + math.log(1 - self.beta), t + math.log(self.beta)]), 0)
            soft = self.beta * (t.exp() * (t - m)).sum(-1) + (1 - self.beta) * (s.exp() * (s - m)).sum(-1)
        return torch.stack([(hard * mask).sum(), (soft * mask).sum()])
