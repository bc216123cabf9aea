"""Pairwise preference losses: the reward-model loss, DPO and MPO (ref §4.3–4.4).

Rows are (chosen, rejected) pairs, interleaved: even rows chosen, odd rows rejected. When
the data names its pairs (`pair_index` `[B]` and `is_chosen` `[B]`, ref §4.3), the rows are
first put in that order by a stable sort on `(pair_index, rejected)` — a static-shape
gather, so it traces; `check_pairs` validates the naming on the host.

MPO (mixed preference optimisation) is DPO's preference and chosen-SFT terms plus a BCO
quality term: the implicit reward `r = β·Σ_t (lp - ref)` of each row (averaged over its
tokens with `quality_average_log_probs`) is a binary classifier score, chosen rows "good",
rejected rows "bad", both shifted by the running mean reward `δ`:
`bco = masked_mean(-log σ(r_c - δ), sm_c, G_s/2) + masked_mean(-log σ(-(r_r - δ)), sm_r, G_s/2)`.
The loss is stateless: the driver owns `δ`, passes it as `data["reward_shift"]` (`[B]`,
every row the current `δ`, so it splits and packs like any row tensor and a new `δ` never
recompiles), reads the summed metrics `bco_reward_sum` / `bco_reward_count` after each
step, and updates `δ` with `update_reward_shift`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NotRequired, TypedDict

import torch
import torch.nn.functional as F

from compiled_loss.checks import check_factor, check_fields, require
from compiled_loss.interfaces import InputSpec, LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import (
    as_config,
    check_logprob_inputs,
    float_masks,
    masked_mean,
    normalizations,
    require_keys,
    require_shape,
    zero_outside,
)
from compiled_loss.losses.nll import NLLLossFn

Tensor = torch.Tensor


def check_even_rows(rows: int, who: str) -> None:
    if rows % 2:
        raise ValueError(f"{who}: rows must be interleaved (chosen, rejected) pairs, got an odd batch of {rows}")


def _pair_naming(data: Mapping[str, object]) -> tuple[Tensor, Tensor] | None:
    """`pair_index` and `is_chosen`, or None when the data names no pairs."""
    index, chosen = data.get("pair_index"), data.get("is_chosen")
    return (index, chosen) if isinstance(index, Tensor) and isinstance(chosen, Tensor) else None


def _pair_keys(naming: tuple[Tensor, Tensor]) -> Tensor:
    """`2·pair_index + (1 - is_chosen)` per row (`is_chosen` integer or bool: True is 1)."""
    index, chosen = naming
    return 2 * index.long() + (1 - chosen.long())


def check_pairs(data: Mapping[str, object], who: str = "preference data") -> None:
    """Host side (one sync): `pair_index` / `is_chosen` name exactly one chosen and one
    rejected row per pair index (ref §4.3). A no-op when the data names no pairs."""
    naming = _pair_naming(data)
    if naming is None:
        return
    key = _pair_keys(naming)
    rows = key.shape[0]
    check_even_rows(rows, who)
    ordered = key.sort(stable=True).values.reshape(-1, 2)
    ok = (ordered[:, 0] % 2 == 0) & (ordered[:, 1] == ordered[:, 0] + 1)
    ok = ok.all() & (ordered[1:, 0] > ordered[:-1, 0]).all()
    if not ok.item():  # host
        raise ValueError(
            f"{who}: pair_index / is_chosen must name exactly one chosen and one rejected row per "
            f"pair index, got pair_index={naming[0].tolist()} "  # host
            f"is_chosen={naming[1].tolist()}"  # host
        )


def pair_order(data: Mapping[str, object]) -> Tensor | None:
    """Row order that interleaves each pair's chosen then rejected row, by pair index
    (None: the rows already are interleaved). Checked in eager mode (`check_pairs`)."""
    naming = _pair_naming(data)
    if naming is None:
        return None
    if not torch.compiler.is_compiling():
        check_pairs(data)
    return torch.argsort(_pair_keys(naming), stable=True)


def _pairs(global_valid_seqs: Tensor | None) -> Tensor | None:
    """The pair count G_s/2 that normalises every per-pair term."""
    return None if global_valid_seqs is None else global_valid_seqs / 2


def _preference_loss(
    rewards: Tensor, sample_mask: Tensor, global_valid_seqs: Tensor | None, beta: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss over interleaved (chosen, rejected) rows (ref §4.3), with its
    accuracy / reward metrics and `num_valid_samples` (pairs).

    A pair enters the loss and the accuracy with its chosen row's sample mask (ref §4.3)
    when its rejected row's is non-zero, and not at all otherwise (the reference would
    compare the chosen reward with the masked row's); each reward mean reads its own rows
    under their own mask, as the reference's do. So a masked row reaches no loss, metric or
    gradient."""
    chosen, rejected = rewards[::2], rewards[1::2]
    sm_chosen, sm_rejected = sample_mask[::2], sample_mask[1::2]
    sm_pair = torch.where(sm_rejected > 0, sm_chosen, 0.0)
    (chosen_own,), (rejected_own,) = zero_outside(sm_chosen, chosen), zero_outside(sm_rejected, rejected)
    chosen, rejected = zero_outside(sm_pair, chosen, rejected)
    g_pairs = _pairs(global_valid_seqs)
    per_pair = -F.logsigmoid(beta * (chosen - rejected)) * sm_pair
    loss = masked_mean(per_pair, sm_pair, global_normalization_factor=g_pairs)
    return loss, {
        "accuracy": masked_mean((chosen > rejected).to(rewards.dtype), sm_pair, global_normalization_factor=g_pairs),
        "rewards_chosen_mean": masked_mean(chosen_own.detach(), sm_chosen, global_normalization_factor=g_pairs),
        "rewards_rejected_mean": masked_mean(rejected_own.detach(), sm_rejected, global_normalization_factor=g_pairs),
        "num_valid_samples": sample_mask.sum() / 2,
    }


def _sequence_normalizations(*keys: str) -> dict[str, MetricNormalizer]:
    return normalizations(SEQUENCES=keys, NONE=("num_valid_samples",))


class PreferenceLossData(TypedDict):
    """The data `PreferenceLossFn` reads: `[B]` per row; the pair naming is optional."""

    sample_mask: Tensor
    pair_index: NotRequired[Tensor]
    is_chosen: NotRequired[Tensor]


class DPOLossData(PreferenceLossData):
    """The data `DPOLossFn` reads besides the rows' pairing: `[B, S]` unless noted."""

    token_mask: Tensor
    reference_policy_logprobs: Tensor  # pre-rolled: entry t is the reference log-prob of token t+1


class MPOLossData(DPOLossData):
    """The data `MPOLossFn` reads: DPO's and the driver's running reward mean."""

    reward_shift: Tensor  # [B]


@dataclasses.dataclass(frozen=True)
class PreferenceLossFn:
    """Reward-model preference loss over (chosen, rejected) rows (ref §4.3)."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT
    input_spec = InputSpec(LossInputType.LOGIT, pairs=True, data=PreferenceLossData)

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations("loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean")

    def __call__(
        self,
        logits: Tensor,
        data: PreferenceLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "PreferenceLossFn"
        require_keys(data, ("sample_mask",), who)
        rewards = logits.squeeze(-1) if logits.dim() > 1 else logits
        sm = data["sample_mask"]
        if rewards.dim() != 1 or rewards.shape[0] != sm.shape[0]:
            raise ValueError(
                f"{who}: logits must hold one reward per row ([B] or [B, 1] with B = "
                f"{sm.shape[0]}), got shape {tuple(logits.shape)}"
            )
        check_even_rows(sm.shape[0], who)
        sm = sm.to(rewards.dtype)
        order = pair_order(data)
        if order is not None:
            rewards, sm = rewards[order], sm[order]
        loss, metrics = _preference_loss(rewards, sm, global_valid_seqs)
        return loss, {"loss": loss.detach(), **metrics}


def _require_weights(cfg: object, *names: str) -> None:
    """Each field named is >= 0 and a factor of the loss's gradient (`check_factor`)."""
    for name in names:
        value = getattr(cfg, name)
        require(value >= 0, f"{name} must be finite and >= 0, got {value}")
        check_factor(name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOLossConfig:
    """Configuration of `DPOLossFn` (ref §4.4; defaults are the reference's)."""

    reference_policy_kl_penalty: float = 0.05
    """β: scale of the implicit reward log π/π_ref; 0 or in [1e-6, 1e6] (it scales the gradient, `FACTOR_MAX`)."""
    preference_loss_weight: float = 1.0
    """Weight of the preference (Bradley–Terry) term; 0 or in [1e-6, 1e6]."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL on chosen responses; 0 (disabled) or in [1e-6, 1e6]."""
    preference_average_log_probs: bool = False
    """Average the implicit reward over the response tokens instead of summing."""
    sft_average_log_probs: bool = False
    """Average the chosen-response NLL over its tokens instead of summing."""

    def __post_init__(self) -> None:
        check_fields(self)
        _require_weights(self, "reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight")


def _pair_logratios(lp: Tensor, data: DPOLossData, who: str) -> tuple[Tensor, Tensor, Tensor]:
    """Checked DPO inputs: `token_mask[:, 1:]`, `sample_mask` and the per-token log-ratio
    `lp - ref` `[B, S-1]`, zero outside the token mask (`ref` is pre-rolled, ref §1.2)."""
    check_logprob_inputs(lp, data, ("reference_policy_logprobs",), who)
    check_even_rows(lp.shape[0], who)
    tm, sm = float_masks(data, lp.dtype)
    lp_tm, ref = zero_outside(tm, lp, data["reference_policy_logprobs"][:, :-1])
    return tm, sm, lp_tm - ref


def _sequence_logratios(logratio: Tensor, tm: Tensor, average: bool) -> Tensor:
    """Per row `Σ_t (lp - ref)·tm` (sample mask not applied), or its mean over the tokens."""
    reward = (logratio * tm).sum(-1)
    return reward / tm.sum(-1).clamp(min=1) if average else reward


def _in_pair_order(order: Tensor | None, *rows: Tensor) -> tuple[Tensor, ...]:
    return rows if order is None else tuple(r[order] for r in rows)


def _chosen_sft(
    lp: Tensor,
    data: DPOLossData,
    order: Tensor | None,
    sm: Tensor,
    average: bool,
    global_valid_seqs: Tensor | None,
) -> Tensor:
    """The chosen rows' summed (or averaged) NLL, `masked_mean` over chosen rows with G_s/2
    (`sm` already in pair order)."""
    per_row, _ = NLLLossFn()(lp, data, None, None, dpo_loss=True, dpo_average_log_probs=average)
    (per_row,) = _in_pair_order(order, per_row)
    return masked_mean(per_row[::2], sm[::2], global_normalization_factor=_pairs(global_valid_seqs))


@dataclasses.dataclass(frozen=True)
class DPOLossFn:
    """Direct preference optimisation with an optional chosen-row SFT term (ref §4.4).

    `data["reference_policy_logprobs"]` is PRE-ROLLED by the DPO driver (entry t is the
    reference log-prob of token t+1), so it is sliced `[:, :-1]`.
    """

    cfg: DPOLossConfig
    use_fused_linear_logprobs: bool = False

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, DPOLossConfig, "DPOLossFn"))

    @property
    def input_spec(self) -> InputSpec:
        return InputSpec(
            self.input_type, fused_linear_logprobs=self.use_fused_linear_logprobs, pairs=True, data=DPOLossData
        )

    @property
    def reference_policy_kl_penalty(self) -> float:
        return self.cfg.reference_policy_kl_penalty

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations(
            "loss", "sft_loss", "preference_loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean"
        )

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: DPOLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "DPOLossFn"
        cfg = self.cfg
        lp = next_token_logprobs
        tm, sm, logratio = _pair_logratios(lp, data, who)
        reward = _sequence_logratios(logratio, tm, cfg.preference_average_log_probs)
        if cfg.sft_loss_weight > 0 and global_valid_toks is None:
            raise ValueError(f"{who}: sft_loss_weight > 0 requires global_valid_toks")
        order = pair_order(data)
        reward, sm = _in_pair_order(order, reward, sm)
        pref_loss, pref_metrics = _preference_loss(reward, sm, global_valid_seqs, cfg.reference_policy_kl_penalty)
        if cfg.sft_loss_weight > 0:
            sft = _chosen_sft(lp, data, order, sm, cfg.sft_average_log_probs, global_valid_seqs)
        else:
            sft = lp.new_zeros(())
        loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * pref_loss
        return loss, {
            "loss": loss.detach(),
            "sft_loss": sft.detach(),
            "preference_loss": pref_loss.detach(),
            **pref_metrics,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class MPOLossConfig:
    """Configuration of `MPOLossFn` (the newer reference's keys and defaults, ref §4.4)."""

    reference_policy_kl_penalty: float = 0.05
    """β: scale of the implicit reward log π/π_ref in the preference and BCO terms; 0 or in [1e-6, 1e6] (it
    scales the gradient, `FACTOR_MAX`)."""
    preference_loss_weight: float = 1.0
    """Weight of the preference (Bradley–Terry) term; 0 or in [1e-6, 1e6]."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL on chosen responses; 0 (disabled) or in [1e-6, 1e6]."""
    bco_loss_weight: float = 1.0
    """Weight of the BCO quality term; 0 or in [1e-6, 1e6]."""
    preference_average_log_probs: bool = False
    """Average the preference term's implicit reward over the response tokens instead of summing."""
    sft_average_log_probs: bool = False
    """Average the chosen-response NLL over its tokens instead of summing."""
    quality_average_log_probs: bool = False
    """Average the BCO term's implicit reward over the response tokens instead of summing."""
    reward_shift_momentum: float = 0.99
    """Decay of the driver's EMA of the BCO reward (`update_reward_shift`), in [0, 1)."""
    reward_shift: float = 0.0
    """δ the driver starts its EMA from (the loss reads the current δ from `data["reward_shift"]`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _require_weights(
            self, "reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight", "bco_loss_weight"
        )
        m = self.reward_shift_momentum
        require(0.0 <= m < 1.0, f"reward_shift_momentum must be in [0, 1), got {m}")


def update_reward_shift(reward_shift: float, reward_sum: float, reward_count: float, momentum: float) -> float:
    """The driver's EMA step after an optimizer step: `δ ← momentum·δ + (1 - momentum)·sum/count`,
    with `sum` / `count` the global batch's summed `bco_reward_sum` / `bco_reward_count`
    metrics; `δ` is unchanged when the count is 0."""
    if reward_count <= 0:
        return reward_shift
    return momentum * reward_shift + (1.0 - momentum) * reward_sum / reward_count


def _bco_loss(
    rewards: Tensor, shift: Tensor, sample_mask: Tensor, global_valid_seqs: Tensor | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The BCO quality term over interleaved (chosen, rejected) rows, each row read under its
    own sample mask, and its reward metrics."""
    g_pairs = _pairs(global_valid_seqs)
    sm_c, sm_r = sample_mask[::2], sample_mask[1::2]
    chosen, shift_c = zero_outside(sm_c, rewards[::2], shift[::2])
    rejected, shift_r = zero_outside(sm_r, rewards[1::2], shift[1::2])
    loss = masked_mean(-F.logsigmoid(chosen - shift_c) * sm_c, sm_c, global_normalization_factor=g_pairs)
    loss = loss + masked_mean(-F.logsigmoid(shift_r - rejected) * sm_r, sm_r, global_normalization_factor=g_pairs)
    (own,) = zero_outside(sample_mask, rewards.detach())
    return loss, {
        "bco_rewards_chosen_mean": masked_mean(chosen.detach(), sm_c, global_normalization_factor=g_pairs),
        "bco_rewards_rejected_mean": masked_mean(rejected.detach(), sm_r, global_normalization_factor=g_pairs),
        "bco_reward_sum": (own * sample_mask).sum(),
        "bco_reward_count": sample_mask.sum(),
    }


@dataclasses.dataclass(frozen=True)
class MPOLossFn:
    """Mixed preference optimisation: DPO's preference and chosen-SFT terms plus a BCO
    quality term shifted by the driver's running reward mean (see the module docstring).

    Reads `data["reward_shift"]` `[B]` beside DPO's keys; `reference_policy_logprobs` is
    pre-rolled as for `DPOLossFn`.
    """

    cfg: MPOLossConfig
    use_fused_linear_logprobs: bool = False

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, MPOLossConfig, "MPOLossFn"))

    @property
    def input_spec(self) -> InputSpec:
        return InputSpec(
            self.input_type, fused_linear_logprobs=self.use_fused_linear_logprobs, pairs=True, data=MPOLossData
        )

    @property
    def reference_policy_kl_penalty(self) -> float:
        return self.cfg.reference_policy_kl_penalty

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return normalizations(
            SEQUENCES=(
                "loss",
                "sft_loss",
                "preference_loss",
                "bco_loss",
                "accuracy",
                "rewards_chosen_mean",
                "rewards_rejected_mean",
                "bco_rewards_chosen_mean",
                "bco_rewards_rejected_mean",
            ),
            NONE=("num_valid_samples", "bco_reward_sum", "bco_reward_count"),
        )

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: MPOLossData,
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "MPOLossFn"
        cfg = self.cfg
        lp = next_token_logprobs
        tm, sm, logratio = _pair_logratios(lp, data, who)
        require_keys(data, ("reward_shift",), who)
        require_shape(data["reward_shift"], (lp.shape[0],), "data['reward_shift'] ([B])", who)
        beta = cfg.reference_policy_kl_penalty
        reward = _sequence_logratios(logratio, tm, cfg.preference_average_log_probs)
        quality = beta * _sequence_logratios(logratio, tm, cfg.quality_average_log_probs)
        order = pair_order(data)
        reward, quality, shift, sm = _in_pair_order(order, reward, quality, data["reward_shift"].to(lp.dtype), sm)
        pref_loss, pref_metrics = _preference_loss(reward, sm, global_valid_seqs, beta)
        bco, bco_metrics = _bco_loss(quality, shift, sm, global_valid_seqs)
        if cfg.sft_loss_weight > 0:
            sft = _chosen_sft(lp, data, order, sm, cfg.sft_average_log_probs, global_valid_seqs)
        else:
            sft = lp.new_zeros(())
        loss = cfg.preference_loss_weight * pref_loss + cfg.sft_loss_weight * sft + cfg.bco_loss_weight * bco
        return loss, {
            "loss": loss.detach(),
            "sft_loss": sft.detach(),
            "preference_loss": pref_loss.detach(),
            "bco_loss": bco.detach(),
            **pref_metrics,
            **bco_metrics,
        }
