"""What a trainer adds to the task's rows (`compiled_loss.demo.data`) to make a step's batch.

`grpo_advantages` gives the group-relative advantages (NeMo-RL's baseline, leave-one-out
and std-normalisation options), `preference_pairs` DPO's (best, worst) pair of each
sampled group, `sample_batch` a pre-made batch (the task's pre-made rows with their GRPO
advantages) and `replica_rows` a data-parallel replica's share of a batch.

`rollout` annotates a batch for one loss kind with model outputs — its
`compiled_loss.config.LossKind.fill` names which: the previous policy's log-probs from the
policy being trained, the reference log-probs from the frozen reference, and — where the
batch has none of its own — the generation log-probs from the reference too (standing in
for the engine that sampled pre-made data), so ratios, importance weights and KL terms are
real. Token-indexed log-probs carry NeMo-RL's dummy 0
in column 0; DPO's reference log-probs are pre-rolled left by one (ref §1.2).
`annotate_cross_tokenizer` adds the digit teachers' logits and alignments
(`compiled_loss.demo.cross_tokenizer`) that cross-tokenizer distillation reads.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from compiled_loss.config import LOSS_FAMILIES, Config, DataConfig, Family, LogprobConfig, LossKind
from compiled_loss.demo import cross_tokenizer
from compiled_loss.demo.data import premade_rows
from compiled_loss.demo.model import TinyLM
from compiled_loss.losses import CrossTokenizerDistillationLossFn
from compiled_loss.nemo_rl.loss_input import get_next_token_logprobs_from_logits
from compiled_loss.vocab import mask_out_neg_inf_logprobs

Tensor = torch.Tensor


# ---- advantages, pairs, pre-made batches -----------------------------------------------------


def grpo_advantages(rewards: Tensor, group_size: int, *, leave_one_out: bool = False, normalize: bool = True) -> Tensor:
    """NeMo-RL's GRPO advantages `[n]` for rewards in consecutive groups of `group_size`
    (`calculate_baseline_and_std_per_prompt`, then `normalize_advantages_with_epsilon`):
    reward − the group's mean (`leave_one_out`: the mean of the OTHER responses, RLOO);
    `normalize` divides by the std of the same responses (+1e-6) where it is > 0. A group
    of one response gets advantage 0."""
    if group_size == 1:
        return torch.zeros_like(rewards)
    groups = rewards.double().view(-1, group_size)
    if leave_one_out:
        baseline = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
        square = (groups.square().sum(-1, keepdim=True) - groups.square()) / (group_size - 1)
    else:
        baseline = groups.mean(-1, keepdim=True).expand_as(groups)
        square = groups.square().mean(-1, keepdim=True).expand_as(groups)
    std = (square - baseline.square()).sqrt().nan_to_num(0.0)
    advantages = groups - baseline
    if normalize:
        advantages = torch.where(std > 0, advantages / (std + 1e-6), advantages)
    return advantages.reshape(-1).to(rewards.dtype)


def preference_pairs(batch: dict[str, Tensor], group_size: int) -> dict[str, Tensor]:
    """DPO rows from sampled groups: each group's best and worst response by reward
    (chosen, rejected; the first of equals), interleaved; a pair whose rewards tie gets
    `sample_mask` 0."""
    rewards = batch["rewards"].view(-1, group_size)
    base = torch.arange(len(rewards)) * group_size
    best, worst = base + rewards.argmax(-1), base + rewards.argmin(-1)
    order = torch.stack([best, worst], 1).reshape(-1)
    pairs = {k: v[order] for k, v in batch.items() if k not in ("advantages", "generation_logprobs")}
    tied = (rewards.amax(-1) == rewards.amin(-1)).repeat_interleave(2)
    pairs["sample_mask"] = torch.where(tied, 0.0, pairs["sample_mask"])
    return pairs


def sample_batch(
    cfg: DataConfig, vocab_size: int, rng: random.Random, pairs: bool = False, clean: bool = False
) -> dict[str, Tensor]:
    """One global pre-made batch: `premade_rows` (the same arguments) with the GRPO
    `advantages` `[B, S]` of each prompt's group (its `group_size` responses, or its pair)."""
    batch = premade_rows(cfg, vocab_size, rng, pairs=pairs, clean=clean)
    advantages = grpo_advantages(batch["rewards"], 2 if pairs else cfg.group_size)
    return {**batch, "advantages": advantages[:, None].expand_as(batch["token_mask"]).contiguous()}


def replica_rows(batch: dict[str, Tensor], replicas: int, replica: int) -> dict[str, Tensor]:
    """A data-parallel replica's contiguous share of a global batch's rows (whole prompts'
    groups when `data.prompts` divides by `replicas`)."""
    rows = batch["input_ids"].shape[0] // replicas
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}


# ---- model outputs ---------------------------------------------------------------------------


@torch.no_grad()
def _forward(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    rows, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(rows, width)
    return model(input_ids, positions, torch.zeros_like(input_ids), full_vocab=True).float()


def model_logprobs(
    model: torch.nn.Module, input_ids: Tensor, sampling: LogprobConfig | None = None, filtered: bool = True
) -> Tensor:
    """`[B, S]` log-probs of each token given its prefix, 0 in column 0 (ref §1.2), of the
    logits divided by `sampling.temperature` and (`filtered`) under its top-k / top-p
    filter: what the loss computes, so ratios start at 1."""
    logits = _forward(model, input_ids)
    params = None
    if sampling is not None:
        logits = logits / sampling.temperature
        params = sampling.sampling_params() if filtered else None
    lp = get_next_token_logprobs_from_logits(input_ids, logits, sampling_params=params)
    return torch.nn.functional.pad(lp, (1, 0))


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """`ModelOutputs` of one batch for `rollout`: the models' outputs a loss kind's `fill`
    reads, each taken when read."""

    batch: dict[str, Tensor]
    kind: LossKind
    policy: torch.nn.Module
    reference: torch.nn.Module
    teacher: torch.nn.Module | None
    topk: int
    sampling: LogprobConfig | None

    def policy_logprobs(self) -> Tensor:
        prev = model_logprobs(self.policy, self.batch["input_ids"], self.sampling)
        return mask_out_neg_inf_logprobs(prev, self.batch["token_mask"]) if self.sampling else prev

    def reference_logprobs(self) -> Tensor:
        return model_logprobs(self.reference, self.batch["input_ids"], self.sampling, filtered=False)

    def teacher_logits(self) -> Tensor:
        if self.teacher is None:
            raise ValueError(f"rollout(family={self.kind.family!r}) needs a teacher model")
        return _forward(self.teacher, self.batch["input_ids"])

    def policy_outputs(self) -> Tensor:
        return _forward(self.policy, self.batch["input_ids"])


def rollout(
    batch: dict[str, Tensor],
    family: LossKind | Family,
    *,
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    teacher: torch.nn.Module | None = None,
    topk: int = 16,
    sampling: LogprobConfig | None = None,
) -> dict[str, Tensor]:
    """Annotate a batch with the model outputs a loss kind's loss reads (no gradients): the
    data keys its `LossKind.fill` fills (`family`: the kind, or its family's name).

    With `sampling` (the run's `logprob` config) the log-probs are taken as the loss takes
    them: temperature-scaled, the policy's under the top-k / top-p filter (filtered tokens
    and positions outside the token mask 0), the reference's unfiltered (the reference KL
    reads the unfiltered current log-probs, ref §5.1). A batch that carries its own
    `generation_logprobs` (sampled on-policy) keeps them."""
    kind = family if isinstance(family, LossKind) else LOSS_FAMILIES.get(family)
    if kind is None:
        raise ValueError(f"unknown loss family {family!r}")
    return kind.fill(batch, _Outputs(batch, kind, policy, reference, teacher, topk, sampling))


@torch.no_grad()
def annotate_cross_tokenizer(
    batch: dict[str, Tensor], loss_fn: CrossTokenizerDistillationLossFn, teachers: list[TinyLM], cfg: Config
) -> dict[str, Tensor]:
    """`batch` with every teacher's logits on its digit tokenization and the alignment,
    under the loss's data keys."""
    ids, alignment = cross_tokenizer.tokenize(batch["input_ids"], batch["input_lengths"], cfg)
    out = dict(batch)
    for logits_key, alignment_key, teacher in zip(
        loss_fn.teacher_logits_keys, loss_fn.teacher_alignment_keys, teachers
    ):
        device = next(teacher.parameters()).device
        positions = torch.arange(ids.shape[1], device=device).expand(ids.shape)
        tokens = ids.to(device)
        logits = teacher(tokens, positions, torch.zeros_like(tokens), full_vocab=True).float()
        out[logits_key] = logits.to(batch["input_ids"].device)
        out[alignment_key] = alignment.to(batch["input_ids"].device)
    return out
