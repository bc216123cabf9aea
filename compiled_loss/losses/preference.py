"""Pairwise preference losses: the reward-model loss and DPO (ref §4.3–4.4).

Rows are (chosen, rejected) pairs, interleaved: even rows chosen, odd rows rejected. When
the data names its pairs (`pair_index` `[B]` and `is_chosen` `[B]`, ref §4.3), the rows are
first put in that order by a stable sort on `(pair_index, rejected)` — a static-shape
gather, so it traces; `check_pairs` validates the naming on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from compiled_loss.checks import check_fields, require
from compiled_loss.interfaces import LossInputType, LossType, MetricNormalizer
from compiled_loss.losses.common import (
    as_config,
    check_logprob_inputs,
    float_masks,
    masked_mean,
    normalizations,
    require_keys,
    zero_outside,
)
from compiled_loss.losses.nll import NLLLossFn

Tensor = torch.Tensor

_PAIR_KEYS = ("pair_index", "is_chosen")


def check_even_rows(rows: int, who: str) -> None:
    if rows % 2:
        raise ValueError(
            f"{who}: rows must be interleaved (chosen, rejected) pairs, got an odd batch of {rows}"
        )


def _pair_keys(data: Mapping[str, Tensor]) -> Tensor | None:
    """`2·pair_index + (1 - is_chosen)` per row, or None when the data names no pairs."""
    if not all(key in data for key in _PAIR_KEYS):
        return None
    return 2 * data["pair_index"].long() + (1 - data["is_chosen"].long())


def check_pairs(data: Mapping[str, Tensor], who: str = "preference data") -> None:
    """Host side (one sync): `pair_index` / `is_chosen` name exactly one chosen and one
    rejected row per pair index (ref §4.3). A no-op when the data names no pairs."""
    key = _pair_keys(data)
    if key is None:
        return
    rows = key.shape[0]
    check_even_rows(rows, who)
    ordered = key.sort(stable=True).values.reshape(-1, 2)
    ok = (ordered[:, 0] % 2 == 0) & (ordered[:, 1] == ordered[:, 0] + 1)
    ok = ok.all() & (ordered[1:, 0] > ordered[:-1, 0]).all()
    if not ok.item():  # host
        raise ValueError(
            f"{who}: pair_index / is_chosen must name exactly one chosen and one rejected row per "
            f"pair index, got pair_index={data['pair_index'].tolist()} "  # host
            f"is_chosen={data['is_chosen'].tolist()}"  # host
        )


def pair_order(data: Mapping[str, Tensor]) -> Tensor | None:
    """Row order that interleaves each pair's chosen then rejected row, by pair index
    (None: the rows already are interleaved). Checked in eager mode (`check_pairs`)."""
    key = _pair_keys(data)
    if key is None:
        return None
    if not torch.compiler.is_compiling():
        check_pairs(data)
    return torch.argsort(key, stable=True)


def _preference_loss(
    rewards: Tensor, sample_mask: Tensor, global_valid_seqs: Tensor | None, beta: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss over interleaved (chosen, rejected) rows (ref §4.3), with its
    accuracy / reward metrics and `num_valid_samples` (pairs)."""
    chosen, rejected = rewards[::2], rewards[1::2]
    sm_chosen, sm_rejected = sample_mask[::2], sample_mask[1::2]
    (rejected_own,) = zero_outside(sm_rejected, rejected)  # its own mean reads its own mask
    chosen, rejected = zero_outside(sm_chosen, chosen, rejected)  # a pair counts by its chosen row
    g_pairs = None if global_valid_seqs is None else global_valid_seqs / 2
    per_pair = -F.logsigmoid(beta * (chosen - rejected)) * sm_chosen
    loss = masked_mean(per_pair, sm_chosen, global_normalization_factor=g_pairs)
    return loss, {
        "accuracy": masked_mean(
            (chosen > rejected).to(rewards.dtype), sm_chosen, global_normalization_factor=g_pairs
        ),
        "rewards_chosen_mean": masked_mean(chosen.detach(), sm_chosen, global_normalization_factor=g_pairs),
        "rewards_rejected_mean": masked_mean(
            rejected_own.detach(), sm_rejected, global_normalization_factor=g_pairs
        ),
        "num_valid_samples": sample_mask.sum() / 2,
    }


def _sequence_normalizations(*keys: str) -> dict[str, MetricNormalizer]:
    return normalizations(SEQUENCES=keys, NONE=("num_valid_samples",))


@dataclasses.dataclass(frozen=True)
class PreferenceLossFn:
    """Reward-model preference loss over (chosen, rejected) rows (ref §4.3)."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT
    rows_are_pairs = True

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations("loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean")

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Tensor],
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOLossConfig:
    """Configuration of `DPOLossFn` (ref §4.4; defaults are the reference's)."""

    reference_policy_kl_penalty: float = 0.05
    """β: scale of the implicit reward log π/π_ref; finite and >= 0."""
    preference_loss_weight: float = 1.0
    """Weight of the preference (Bradley–Terry) term; >= 0."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL on chosen responses; >= 0 (0 disables)."""
    preference_average_log_probs: bool = False
    """Average the implicit reward over the response tokens instead of summing."""
    sft_average_log_probs: bool = False
    """Average the chosen-response NLL over its tokens instead of summing."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be finite and >= 0, got {value}")


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
    rows_are_pairs = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", as_config(self.cfg, DPOLossConfig, "DPOLossFn"))

    @property
    def reference_policy_kl_penalty(self) -> float:
        return self.cfg.reference_policy_kl_penalty

    @property
    def metric_normalizations(self) -> dict[str, MetricNormalizer]:
        return _sequence_normalizations("loss", "sft_loss", "preference_loss", "accuracy",
                                        "rewards_chosen_mean", "rewards_rejected_mean")

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Tensor],
        global_valid_seqs: Tensor | None,
        global_valid_toks: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        who = "DPOLossFn"
        cfg = self.cfg
        lp = next_token_logprobs
        check_logprob_inputs(lp, data, ("reference_policy_logprobs",), who)
        check_even_rows(lp.shape[0], who)
        tm, sm = float_masks(data, lp.dtype)
        lp_tm, ref = zero_outside(tm, lp, data["reference_policy_logprobs"][:, :-1])
        reward = ((lp_tm - ref) * tm).sum(-1)
        if cfg.preference_average_log_probs:
            reward = reward / tm.sum(-1).clamp(min=1)
        if cfg.sft_loss_weight > 0:
            if global_valid_toks is None:
                raise ValueError(f"{who}: sft_loss_weight > 0 requires global_valid_toks")
            sft_per_row, _ = NLLLossFn()(
                lp, data, global_valid_seqs, global_valid_toks,
                dpo_loss=True, dpo_average_log_probs=cfg.sft_average_log_probs,
            )
        order = pair_order(data)
        if order is not None:
            reward, sm = reward[order], sm[order]
        pref_loss, pref_metrics = _preference_loss(reward, sm, global_valid_seqs, cfg.reference_policy_kl_penalty)
        if cfg.sft_loss_weight > 0:
            sft_per_row = sft_per_row if order is None else sft_per_row[order]
            g_pairs = None if global_valid_seqs is None else global_valid_seqs / 2
            sft = masked_mean(sft_per_row[::2], sm[::2], global_normalization_factor=g_pairs)
        else:
            sft = lp.new_zeros(())
        loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * pref_loss
        return loss, {
            "loss": loss.detach(),
            "sft_loss": sft.detach(),
            "preference_loss": pref_loss.detach(),
            **pref_metrics,
        }
