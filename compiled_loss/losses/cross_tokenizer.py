"""Cross-tokenizer distillation: one student, several teachers with their own vocabularies
and tokenizations (ref §4.8).

The reference is brief (its own implementation averages chunks of aligned text spans);
this module defines the math as follows.

Inputs, per teacher `i` (`prepare_loss_input` takes them from the data):
- `teacher_full_logits_by_idx[i]` `[B, S_t, V_t]`: the teacher's full logits on its own
  tokenization of each row (entry `a` predicts the teacher's token `a + 1`);
- `aligns_by_idx[i]` `[B, S]` (integer): for student position `t`, the teacher position
  `a` whose next token starts at the same text offset as the student's next token (the
  student's prefix through token `t` and the teacher's through token `a` cover the same
  text), or -1 where no teacher prefix ends there. Built on the host
  (`compiled_loss.inputs.align_tokenizations`); static shapes, so the loss never depends
  on how many positions align.
- a projection `P_i` `[V_t, V_s]` (`TokenProjection`, dense or sparse; None: the teacher
  shares the student's vocabulary): row `v` spreads teacher token `v` over the student
  tokens it stands for (e.g. the student tokens its text can start with). Rows are
  normalised to sum 1 when the projection is built.

With `T` the temperature, `p = softmax(z_t / T)` the student's distribution at position
`t`, `q = softmax(u_a / T)` the teacher's at its aligned position and `y` the student's
next token, over the mask `m = token_mask[:, 1:] · sample_mask` (teacher `i`: `m` where
`a >= 0`), every reduction a `masked_mean` with the global `G_t` (fragments add up):
- CE `= masked_mean(-log softmax(z_t)[y], m, G_t)` (no temperature); `accuracy` the same
  of `argmax z_t == y`.
- KD of a teacher: the teacher's distribution on the student's vocabulary is
  `r = q·P / Σ(q·P)` (`r = q` without a projection) and the per-token term is the forward
  KL over the student's vocabulary, `KL(r ‖ p) = Σ_v r_v (log r_v - log p_v)`;
  `kd_i = T² · masked_mean(KL, m_i, G_t)`.
- `gold_loss`: the vocabularies are split by the projection's exact token map — teacher
  token `v` maps exactly to student token `s` when `P[v, s] = 1` (with `xtoken_loss`:
  `P[v, s] >= 0.6`); several teacher tokens on one student token: the lowest teacher id
  wins (`xtoken_loss`: the largest weight, then the lowest id). The term is the KL on the
  common pairs at native probabilities, `Σ_c q_vc (log q_vc - log p_sc)`, plus the L1
  distance of the sorted probabilities of the uncommon tokens (ULD), `Σ_j |q↓_j - p↓_j|`
  over the `min(#uncommon teacher, #uncommon student)` largest; `kd_i = T² · masked_mean(
  kl_common + l1_uncommon, m_i, G_t)`. A teacher without a projection has no uncommon
  tokens: its gold term is its KL.
- `kd_loss_mode`: `sum`, `kd = Σ_i w_i ν_i kd_i` with the static `teacher_weights` or, with
  `sum_weights_metric`, `w = softmax(alpha · score)` over teachers (no gradient), and
  `ν_i = log V_t_i / log min_j V_t_j` with `normalize_teacher_by_vocab` (else 1; it scales
  the scores too); `averaged_logits`, one KD against `softmax(Σ_i w_i u_i / (T Σ_i w_i))`,
  the weighted mean of the teachers' aligned logits, over the positions every teacher
  aligns (the teachers must share the student's vocabulary); `select_teacher`, the KD of
  the teacher with the lowest score-CE (ties: the lowest index), chosen without a host
  read (every teacher's KD is computed; the others get weight 0).
- Teacher scores, each a mean over the teacher's aligned positions of the micro-batch:
  `ce`, minus the teacher's cross-entropy of the student's next tokens through the
  projection, `-mean(-log(r_y + 1e-10))`; `entropy`, minus the entropy of `q`; `max_prob`,
  the mean of `max q`. `select_teacher` picks the lowest cross-entropy.
- `dynamic_loss_scaling`: `loss = sg(|ce| / |kd|)·kd + ce` (scale 1 when `kd = 0`); else
  `loss = kl_loss_weight·kd + ce_loss_scale·ce`.

Metrics: `loss`, `kl_loss` (the aggregated KD), `ce_loss`, `kl_loss_scale`, `accuracy`,
`num_valid_samples` (`Σ sample_mask`), and per teacher (modes `sum`, `select_teacher`)
`kl_loss_t{i}` (its unweighted KD), `weight_t{i}` (its weight: the one-hot choice under
`select_teacher`, the convex weight under `averaged_logits`) and under `gold_loss`
`kl_common_t{i}`, `l1_uncommon_t{i}`; `select_teacher` adds `selected_teacher`. Teacher
scores, weights, the choice and the dynamic scale are taken over the micro-batch, so
`compiled_loss.metrics` combines `kl_loss_scale`, `weight_t{i}` and `selected_teacher` as
means over micro-batches and replicas (the other metrics are fragments and sum).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict

import torch

from compiled_loss.checks import FACTOR_MAX, check_factor, check_fields, check_value, require
from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import (
    as_config,
    masked_mean,
    normalizations,
    require_keys,
    require_shape,
    zero_outside,
)
from compiled_loss.vocab import vocab_reduce

Tensor = torch.Tensor

_RELAXED_EXACT = 0.6  # xtoken_loss: a projection weight that counts as an exact map
_STRICT_EXACT = 1.0 - 1e-6  # a weight of 1 after row normalisation, up to its rounding


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossTokenizerDistillationLossConfig:
    """Configuration of `CrossTokenizerDistillationLossFn` (ref §4.8; the reference's keys)."""

    teacher_weights: tuple[float, ...] = (1.0,)
    """One weight per teacher (its count is the number of teachers), each 0 or in [1e-6, 1e6] (`FACTOR_MAX`)."""
    kd_loss_mode: Literal["sum", "averaged_logits", "select_teacher"] = "sum"
    """How the teachers' KD terms combine: weighted sum, one KD against averaged logits, or the best teacher's."""
    gold_loss: bool = False
    """KL on the projection's exactly mapped tokens plus sorted-probability L1 on the others."""
    xtoken_loss: bool = False
    """Relax the gold loss's exact map to projection weights >= 0.6 (requires gold_loss)."""
    temperature: float = 1.0
    """Softmax temperature of the KD term (scaled back by T²), in [1e-6, 1e6]: the logits are scaled by 1/T and
    the KD term's gradient by T (`FACTOR_MAX`)."""
    kl_loss_weight: float = 1.0
    """Weight of the KD term without dynamic_loss_scaling; 0 or in [1e-6, 1e6]."""
    ce_loss_scale: float = 1.0
    """Weight of the student's next-token CE without dynamic_loss_scaling; 0 or in [1e-6, 1e6]."""
    dynamic_loss_scaling: bool = False
    """Scale the KD term to the CE's magnitude each micro-batch: sg(|ce|/|kd|)·kd + ce."""
    sum_weights_metric: Literal["ce", "entropy", "max_prob"] | None = None
    """'sum' mode: teacher weights softmax(alpha · score) from this score instead of teacher_weights."""
    alpha: float = 1.0
    """Scale of the scores in the dynamic teacher weights (an inverse softmax temperature), in [0, 1e6]."""
    normalize_teacher_by_vocab: bool = False
    """'sum' mode: scale each teacher's KD (and score) by log V_t / log (smallest V_t)."""

    def __post_init__(self) -> None:
        if isinstance(self.teacher_weights, list):  # a Hydra / YAML list
            object.__setattr__(self, "teacher_weights", tuple(self.teacher_weights))
        check_fields(self)
        weights = self.teacher_weights
        require(
            isinstance(weights, tuple) and len(weights) > 0,
            f"teacher_weights must be a non-empty sequence of floats, got {weights!r}",
        )
        for i, w in enumerate(weights):
            check_value(f"teacher_weights[{i}]", w, float)
            require(w >= 0, f"teacher_weights[{i}] must be finite and >= 0, got {w}")
            check_factor(f"teacher_weights[{i}]", w, "it scales its teacher's KD term")
        require(self.temperature > 0, f"temperature must be finite and > 0, got {self.temperature}")
        check_factor(
            "temperature",
            self.temperature,
            "the logits are scaled by 1/temperature and the KD term's gradient by temperature",
        )
        for name in ("kl_loss_weight", "ce_loss_scale", "alpha"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be finite and >= 0, got {value}")
        check_factor("kl_loss_weight", self.kl_loss_weight, "it scales the KD term")
        check_factor("ce_loss_scale", self.ce_loss_scale, "it scales the CE term")
        require(
            self.alpha <= FACTOR_MAX,
            f"alpha must be <= {FACTOR_MAX:g}, got {self.alpha}: softmax(alpha · score) is one-hot for scores 1e-4 "
            "apart already, and a larger alpha can overflow alpha · score in float32 (NaN teacher weights)",
        )

    def validate(self, projections: Sequence[object | None]) -> None:
        """Cross-field checks (ref §4.8), run by the loss's constructor with its projections."""
        mode = self.kd_loss_mode
        require(
            not self.xtoken_loss or self.gold_loss,
            "xtoken_loss=True requires gold_loss=True; xtoken_loss relaxes the gold loss's exact token map",
        )
        if self.sum_weights_metric is not None:
            require(
                mode == "sum",
                f"sum_weights_metric={self.sum_weights_metric!r} is only applied in "
                f"kd_loss_mode='sum', not {mode!r}; unset one of them",
            )
        require(
            not self.normalize_teacher_by_vocab or mode == "sum",
            f"normalize_teacher_by_vocab is only applied in kd_loss_mode='sum', not {mode!r}; unset one of them",
        )
        require(
            mode != "averaged_logits" or sum(self.teacher_weights) > 0,
            "teacher_weights must not sum to zero in kd_loss_mode='averaged_logits' (they form a convex "
            f"combination of teacher logits); got teacher_weights={list(self.teacher_weights)}",
        )
        lengths = {"teacher_weights": len(self.teacher_weights), "projections": len(projections)}
        require(len(set(lengths.values())) == 1, f"per-teacher lists must be equal length, got {lengths}")
        projected = [i for i, p in enumerate(projections) if p is not None]
        require(
            mode != "averaged_logits" or not projected,
            "kd_loss_mode='averaged_logits' averages the teachers' logits, so every teacher must share the "
            f"student's vocabulary (projection None); teachers {projected} have a projection",
        )


@dataclasses.dataclass(frozen=True, eq=False)
class TokenProjection:
    """Teacher tokens → student tokens, `[V_t, V_s]` weights with rows summing to 1.

    Build it with `TokenProjection.of(matrix)` from a dense `[V_t, V_s]` tensor or a sparse
    COO one (host side, once). Dense projections apply as a matmul; sparse ones keep their
    entries (`teacher_ids`, `student_ids`, `weights`, each `[E]`) and apply by `index_add`.
    Build it on the logits' device, or each call copies it there.
    """

    teacher_vocab_size: int
    student_vocab_size: int
    dense: Tensor | None
    teacher_ids: Tensor | None
    student_ids: Tensor | None
    weights: Tensor | None

    @staticmethod
    def of(matrix: Tensor | TokenProjection, name: str = "projection") -> TokenProjection:
        """ValueError naming `name` unless `matrix` is 2-D, finite, non-negative, with every
        row's sum > 0 (a teacher token must map somewhere); rows are normalised to sum 1."""
        if isinstance(matrix, TokenProjection):
            return matrix
        if not isinstance(matrix, Tensor):
            raise TypeError(
                f"{name} must be a [V_t, V_s] tensor (dense or sparse COO) or a TokenProjection, got "
                f"{type(matrix).__name__}"
            )
        if matrix.dim() != 2:
            raise ValueError(f"{name} must be a [V_t, V_s] matrix, got shape {tuple(matrix.shape)}")
        v_t, v_s = matrix.shape
        if matrix.is_sparse:
            coo = matrix.coalesce()
            (t_ids, s_ids), values = coo.indices(), coo.values().float()
        else:
            values = matrix.float()
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):  # host: once, when built
            raise ValueError(f"{name} must hold finite, non-negative weights")
        row_sum = values.new_zeros(v_t).index_add(0, t_ids, values) if matrix.is_sparse else values.sum(-1)
        empty = (row_sum <= 0).nonzero().flatten().tolist()  # host: once, when built
        if empty:
            raise ValueError(f"{name}: every teacher token must map to some student token; rows {empty[:8]} are empty")
        if matrix.is_sparse:
            return TokenProjection(v_t, v_s, None, t_ids, s_ids, values / row_sum[t_ids])
        return TokenProjection(v_t, v_s, values / row_sum[:, None], None, None, None)

    def __call__(self, probs: Tensor) -> Tensor:
        """`[N, V_t]` teacher probabilities → `[N, V_s]` (`probs @ P`)."""
        if self.dense is not None:
            return probs @ self.dense.to(probs.device)
        t_ids, s_ids, w = (x.to(probs.device) for x in self._sparse())
        out = probs.new_zeros(probs.shape[0], self.student_vocab_size)
        return out.index_add(1, s_ids, probs[:, t_ids] * w)

    def _sparse(self) -> tuple[Tensor, Tensor, Tensor]:
        """The sparse form's teacher ids, student ids and weights (set whenever `dense` is None)."""
        assert self.teacher_ids is not None and self.student_ids is not None and self.weights is not None
        return self.teacher_ids, self.student_ids, self.weights

    def exact_map(self, relaxed: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The gold loss's vocabulary split (host side): common teacher ids, their student
        ids (pairs, by teacher id), then the uncommon teacher ids and student ids."""
        if self.dense is not None:
            t_ids, s_ids = self.dense.nonzero(as_tuple=True)  # host: once, when built
            weights = self.dense[t_ids, s_ids]
        else:
            t_ids, s_ids, weights = self._sparse()
        keep = weights >= (_RELAXED_EXACT if relaxed else _STRICT_EXACT)
        candidates = zip(t_ids[keep].tolist(), s_ids[keep].tolist(), weights[keep].tolist())  # host: once
        winner: dict[int, int] = {}
        for t, s, _ in sorted(candidates, key=lambda e: (e[1], -e[2] if relaxed else 0.0, e[0])):
            winner.setdefault(s, t)
        pairs = sorted((t, s) for s, t in winner.items())
        common_t, common_s = {t for t, _ in pairs}, set(winner)

        def ids(values) -> Tensor:
            return torch.tensor(list(values), dtype=torch.long)

        return (
            ids(t for t, _ in pairs),
            ids(s for _, s in pairs),
            ids(v for v in range(self.teacher_vocab_size) if v not in common_t),
            ids(v for v in range(self.student_vocab_size) if v not in common_s),
        )


def _kl(x: Tensor, log_r: Tensor) -> Tensor:
    """`KL(r ‖ softmax(x))` per row of `[N, V]` student logits `x`, teacher log-probs `log_r`
    (the vocab primitive: `Σ r log p = cross - lse`)."""
    stats = vocab_reduce(x, teacher=log_r)
    r = log_r.exp()
    return torch.xlogy(r, r).sum(-1) - stats.cross + stats.lse


def _gold(x: Tensor, log_q: Tensor, split: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """Per row: the KL on the exactly mapped pairs and the L1 of the sorted uncommon probabilities."""
    common_t, common_s, uncommon_t, uncommon_s = (i.to(x.device) for i in split)
    log_p = torch.log_softmax(x.float(), -1)
    kl_common = (log_q[:, common_t].exp() * (log_q[:, common_t] - log_p[:, common_s])).sum(-1)
    k = min(uncommon_t.numel(), uncommon_s.numel())
    if k == 0:
        return kl_common, torch.zeros_like(kl_common)
    q_top = torch.topk(log_q[:, uncommon_t].exp(), k, -1).values
    p_top = torch.topk(log_p[:, uncommon_s].exp(), k, -1).values
    return kl_common, (q_top - p_top).abs().sum(-1)


class CrossTokenizerDistillationLossData(TypedDict):
    """The data `CrossTokenizerDistillationLossFn` reads besides each teacher's logits and
    alignment (`teacher_logits_keys`, `teacher_alignment_keys`): `[B, S]` unless noted."""

    input_ids: Tensor
    token_mask: Tensor
    sample_mask: Tensor  # [B]


@dataclasses.dataclass(frozen=True, eq=False)
class CrossTokenizerDistillationLossFn:
    """Multi-teacher distillation across tokenizers (ref §4.8; the math: module docstring).

    `projections`: one per teacher — a `[V_t, V_s]` tensor (dense or sparse COO), a
    `TokenProjection`, or None for a teacher that shares the student's vocabulary (None:
    every teacher does).
    """

    cfg: CrossTokenizerDistillationLossConfig
    projections: Sequence[TokenProjection | Tensor | None] | None = None
    _projections: tuple[TokenProjection | None, ...] = dataclasses.field(init=False, repr=False)
    _splits: tuple[tuple[Tensor, ...] | None, ...] = dataclasses.field(init=False, repr=False)

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION_CROSS_TOKENIZER

    def __post_init__(self) -> None:
        cfg = as_config(self.cfg, CrossTokenizerDistillationLossConfig, "CrossTokenizerDistillationLossFn")
        given = (None,) * len(cfg.teacher_weights) if self.projections is None else tuple(self.projections)
        cfg.validate(given)
        projections = tuple(
            None if p is None else TokenProjection.of(p, f"projections[{i}]") for i, p in enumerate(given)
        )
        splits = tuple(p.exact_map(cfg.xtoken_loss) if cfg.gold_loss and p is not None else None for p in projections)
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "projections", projections)
        object.__setattr__(self, "_projections", projections)
        object.__setattr__(self, "_splits", splits)

    @property
    def num_teachers(self) -> int:
        return len(self.cfg.teacher_weights)

    @property
    def input_spec(self) -> InputSpec:
        """Its data: `input_ids`, `token_mask` `[B, S]`, `sample_mask` `[B]` and per teacher
        `i` its logits and alignment (the two properties below)."""
        return InputSpec(
            self.input_type,
            teacher_logits_keys=self.teacher_logits_keys,
            teacher_alignment_keys=self.teacher_alignment_keys,
            data=CrossTokenizerDistillationLossData,
        )

    @property
    def teacher_logits_keys(self) -> tuple[str, ...]:
        """Data keys of the teachers' logits `[B, S_t, V_t]`, indexed by TEACHER positions
        (the packing wrappers pad their rows but never cut them at the student's lengths)."""
        return tuple(f"teacher_{i}_logits" for i in range(self.num_teachers))

    @property
    def teacher_alignment_keys(self) -> tuple[str, ...]:
        """Data keys of the student → teacher position alignments `[B, S]`."""
        return tuple(f"teacher_{i}_alignment" for i in range(self.num_teachers))

    def _teacher_keys(self, *names: str) -> tuple[str, ...]:
        return tuple(f"{name}_t{i}" for i in range(self.num_teachers) for name in names)

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        mode = self.cfg.kd_loss_mode
        per_teacher: tuple[str, ...] = ()
        if mode != "averaged_logits":
            per_teacher = self._teacher_keys("kl_loss", *(("kl_common", "l1_uncommon") if self.cfg.gold_loss else ()))
        return normalizations(
            TOKENS=("loss", "kl_loss", "ce_loss", "accuracy", *per_teacher),
            NONE=(
                "kl_loss_scale",
                "num_valid_samples",
                *self._teacher_keys("weight"),
                *(("selected_teacher",) if mode == "select_teacher" else ()),
            ),
        )

    def _check_inputs(
        self,
        logits: Tensor,
        teachers: Mapping[int, Tensor],
        aligns: Mapping[int, Tensor],
        data: CrossTokenizerDistillationLossData,
        who: str,
    ) -> None:
        require_keys(data, ("input_ids", "token_mask", "sample_mask"), who)
        rows, width = data["input_ids"].shape
        require_shape(data["token_mask"], (rows, width), "data['token_mask'] ([B, S])", who)
        require_shape(data["sample_mask"], (rows,), "data['sample_mask'] ([B])", who)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (rows, width):
            raise ValueError(
                f"{who}: logits must be [B, S, V_s] with [B, S] = {(rows, width)} (input_ids), got "
                f"{tuple(logits.shape)}"
            )
        expected = list(range(self.num_teachers))
        for name, given in (("teacher_full_logits_by_idx", teachers), ("aligns_by_idx", aligns)):
            if sorted(given) != expected:
                raise ValueError(f"{who}: {name} must hold teachers {expected}, got {sorted(given)}")
        for i, projection in enumerate(self._projections):
            vocab = logits.shape[-1] if projection is None else projection.teacher_vocab_size
            if projection is not None and projection.student_vocab_size != logits.shape[-1]:
                raise ValueError(
                    f"{who}: projections[{i}] maps onto {projection.student_vocab_size} student tokens, "
                    f"the logits have {logits.shape[-1]}"
                )
            u, a = teachers[i], aligns[i]
            if u.dim() != 3 or u.shape[0] != rows or u.shape[2] != vocab:
                raise ValueError(
                    f"{who}: teacher_full_logits_by_idx[{i}] must be [B, S_t, V_t] with B = {rows}, "
                    f"V_t = {vocab}, got {tuple(u.shape)}"
                )
            require_shape(a, (rows, width), f"aligns_by_idx[{i}] ([B, S])", who)
            if a.dtype.is_floating_point or a.dtype == torch.bool:
                raise ValueError(f"{who}: aligns_by_idx[{i}] must be an integer tensor, got {a.dtype}")
            if not torch.compiler.is_compiling() and a.numel() and bool(((a < -1) | (a >= u.shape[1])).any()):
                raise ValueError(
                    f"{who}: aligns_by_idx[{i}] must hold teacher positions in [-1, {u.shape[1]}) "
                    "(-1: no aligned position)"
                )

    def __call__(
        self,
        logits: Tensor,
        teacher_full_logits_by_idx: Mapping[int, Tensor],
        aligns_by_idx: Mapping[int, Tensor],
        data: CrossTokenizerDistillationLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "CrossTokenizerDistillationLossFn"
        cfg = self.cfg
        self._check_inputs(logits, teacher_full_logits_by_idx, aligns_by_idx, data, who)
        rows, width, vocab = logits.shape
        sm = data["sample_mask"].float()
        mask = (data["token_mask"][:, 1:].float() * sm[:, None]).reshape(-1)  # [N], N = B·(S-1)
        y = data["input_ids"][:, 1:].reshape(-1)
        (x,) = zero_outside(mask, logits[:, :-1].reshape(-1, vocab))
        stats = vocab_reduce(x, y[:, None])
        ce = masked_mean(stats.lse - stats.picked[:, 0], mask, global_normalization_factor=global_valid_toks)
        accuracy = masked_mean((x.argmax(-1) == y).float(), mask, global_normalization_factor=global_valid_toks)
        x_t = x if cfg.temperature == 1.0 else x / cfg.temperature
        teachers = [
            self._aligned(teacher_full_logits_by_idx[i], aligns_by_idx[i], mask) for i in range(self.num_teachers)
        ]
        if cfg.kd_loss_mode == "averaged_logits":
            kd, metrics = self._averaged(x_t, teachers, global_valid_toks)
        else:
            kd, metrics = self._per_teacher(x_t, y, teachers, global_valid_toks)
        if cfg.dynamic_loss_scaling:
            kd_abs, ce_abs = kd.detach().abs(), ce.detach().abs()
            scale = torch.where(kd_abs > 0, ce_abs / kd_abs, torch.ones_like(kd_abs))
            loss = scale * kd + ce
        else:
            scale = torch.ones_like(kd).detach()
            loss = cfg.kl_loss_weight * kd + cfg.ce_loss_scale * ce
        return loss, {
            "loss": loss.detach(),
            "kl_loss": kd.detach(),
            "ce_loss": ce.detach(),
            "kl_loss_scale": scale,
            "accuracy": accuracy,
            "num_valid_samples": sm.sum(),
            **metrics,
        }

    def _aligned(self, u: Tensor, a: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher's logits `[N, V_t]` (fp32) at the positions aligned to each student
        prediction, zero where unaligned or masked, and its mask `[N]`."""
        a = a[:, :-1].long()
        rows = torch.arange(a.shape[0], device=a.device)[:, None]
        aligned = u[rows, a.clamp(min=0)].reshape(-1, u.shape[-1]).float()
        mask_i = mask * (a.reshape(-1) >= 0).float()
        (aligned,) = zero_outside(mask_i, aligned)
        return aligned, mask_i

    def _per_teacher(
        self, x_t: Tensor, y: Tensor, teachers: list[tuple[Tensor, Tensor]], g_toks: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`sum` / `select_teacher`: each teacher's KD, then their weights."""
        cfg, t2 = self.cfg, self.cfg.temperature**2
        scored = cfg.kd_loss_mode == "select_teacher" or cfg.sum_weights_metric is not None
        kds, scores, metrics = [], [], {}
        smallest = min(u.shape[-1] for u, _ in teachers)
        for i, ((u, mask_i), projection, split) in enumerate(zip(teachers, self._projections, self._splits)):
            log_q = torch.log_softmax(u / cfg.temperature, -1)
            if projection is None:
                log_r = log_q
            else:
                r = projection(log_q.exp())
                log_r = torch.log(r / r.sum(-1, keepdim=True))
            if split is None:
                kd_i = t2 * masked_mean(_kl(x_t, log_r), mask_i, global_normalization_factor=g_toks)
                if cfg.gold_loss:
                    metrics[f"kl_common_t{i}"], metrics[f"l1_uncommon_t{i}"] = kd_i.detach() / t2, kd_i.new_zeros(())
            else:
                kl_common, l1 = (
                    masked_mean(v, mask_i, global_normalization_factor=g_toks) for v in _gold(x_t, log_q, split)
                )
                kd_i = t2 * (kl_common + l1)
                metrics[f"kl_common_t{i}"], metrics[f"l1_uncommon_t{i}"] = kl_common.detach(), l1.detach()
            nu = math.log(u.shape[-1]) / math.log(smallest) if cfg.normalize_teacher_by_vocab else 1.0
            kds.append(kd_i * nu)
            metrics[f"kl_loss_t{i}"] = kd_i.detach()
            if scored:
                scores.append(nu * self._score(cfg.sum_weights_metric or "ce", log_q, log_r, y, mask_i))
        if cfg.kd_loss_mode == "select_teacher":
            best = torch.argmax(torch.stack(scores))  # the lowest cross-entropy, the first on ties
            weights = (torch.arange(len(kds), device=y.device) == best).float()
            metrics["selected_teacher"] = best.float()
        elif scored:
            weights = torch.softmax(cfg.alpha * torch.stack(scores), 0)
        else:
            weights = torch.tensor(cfg.teacher_weights, device=y.device)
        terms = [torch.where(weights[i] > 0, weights[i] * kd_i, 0.0) for i, kd_i in enumerate(kds)]
        kd = sum(terms[1:], terms[0])
        metrics.update({f"weight_t{i}": weights[i] for i in range(len(kds))})
        return kd, metrics

    @staticmethod
    def _score(metric: str, log_q: Tensor, log_r: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """A teacher's score over its aligned positions (higher: more trusted), no gradient."""
        if metric == "ce":
            values = torch.log(log_r.gather(-1, y[:, None])[:, 0].exp() + 1e-10)
        elif metric == "entropy":
            values = (log_q.exp() * log_q).sum(-1)
        else:
            values = log_q.amax(-1).exp()
        return masked_mean(values.detach(), mask)

    def _averaged(
        self, x_t: Tensor, teachers: list[tuple[Tensor, Tensor]], g_toks: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`averaged_logits`: one KD against the weighted mean of the aligned teacher logits."""
        cfg = self.cfg
        total = sum(cfg.teacher_weights)
        scaled = [u * (w / total) for (u, _), w in zip(teachers, cfg.teacher_weights)]
        mean = sum(scaled[1:], scaled[0])
        mask = teachers[0][1]
        for _, mask_i in teachers[1:]:
            mask = mask * mask_i
        log_q = torch.log_softmax(mean / cfg.temperature, -1)
        kd = cfg.temperature**2 * masked_mean(_kl(x_t, log_q), mask, global_normalization_factor=g_toks)
        weights = {
            f"weight_t{i}": x_t.new_tensor(w / total, dtype=torch.float32) for i, w in enumerate(cfg.teacher_weights)
        }
        return kd, weights
