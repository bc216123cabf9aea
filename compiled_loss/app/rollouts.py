"""The batches of a run's steps: on-policy rollouts from the policy being trained.

Every step draws `data.prompts` task prompts (the same on every rank) and samples
`data.group_size` responses to each from the policy with the compiled `Sampler` — with
`run.speculative`, the `SpeculativeSampler` and the co-trained drafter, and then the plain
sampler again on the same rows, only timed —; a data-parallel rank samples its own
contiguous share of those rows. A sharded policy (a parallel run) generates through its
unsharded copy (`generator`), loaded with the policy's weights gathered whole before each
sampling: every rank holds the whole policy while it samples, as an RL trainer's
inference engine does, and the compiled samplers see plain tensors. Then, per loss kind
(`compiled_loss.config.LossKind`):

- one that samples (`LossKind.samples`; policy gradient, distillation, `opd_full`,
  `cross_tokenizer` — its teachers annotate the rows in the loop): the sampled rows, their
  rewards, GRPO advantages over each group and the sampler's log-probs as
  `generation_logprobs`;
- one that trains on pairs (`LossKind.pairs`: DPO, MPO): each group's best and worst
  response as a (chosen, rejected) pair; its statistics add `preference_accuracy`, the
  fraction of fixed held-out pairs (a correct response and a corrupted one, pre-made) whose
  implicit reward `Σ log π/π_ref` prefers the correct response (the loss's own `accuracy`
  is over the step's fresh pairs, sampled from the policy itself);
- one whose data is clean (`LossKind.clean`: NLL) and the warm start (`warm_start`): the
  correct responses to `prompts × group_size` fresh prompts — the policy samples them too,
  for the reward it would earn;
- a value head (`LossKind.samples` false): pre-made rows (it cannot sample).

`rollout` then adds the model outputs the kind's loss reads (`LossKind.fill`). Each batch comes with its
statistics over the global batch: `reward` (mean), `solved` (the fraction answered
exactly), `entropy` (the mean −log-prob of the sampled tokens, an estimate of the
sampling distribution's per-token entropy), `response_length` and `sample_seconds`; with
`run.speculative` also `speculative_tau` (the tokens a row gains per policy forward, over
the global batch) and `speculative_speedup` (this replica's plain decoding time over its
speculative sampling time, same rows).
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from compiled_loss.app.batches import (
    grpo_advantages,
    model_logprobs,
    preference_pairs,
    replica_rows,
    rollout,
    sample_batch,
)
from compiled_loss.app.sampler import Sampler, Samples, sampling_uniforms
from compiled_loss.app.speculative import SpeculativeSampler, speculative_uniforms
from compiled_loss.config import Config, LossKind, loss_kind
from compiled_loss.config.losses import NllLossOption
from compiled_loss.demo.data import Prompts, correct_batch, sampled_batch, score, task_prompts
from compiled_loss.demo.hf import Policy
from compiled_loss.demo.model import TinyLM
from compiled_loss.draft import DraftRuntimeBase
from compiled_loss.train.parallel import ParallelGroups, all_reduce_host, gather_weights

Tensor = torch.Tensor

_HELD_OUT_PAIRS = 32  # DPO's held-out preference pairs
_WARM_START = loss_kind(NllLossOption())  # the warm start trains NLL on correct responses


@dataclasses.dataclass(frozen=True)
class RolloutSources:
    """The models `Rollouts` samples and annotates with: the policy, its frozen reference, what
    generates (the policy itself when None, or its unsharded copy), the teacher and the drafter."""

    policy: Policy
    reference: Policy
    generator: Policy | None = None
    teacher: TinyLM | None = None
    drafter: DraftRuntimeBase | None = None


class Rollouts:
    """`rollouts(step) -> (batch, stats)`: this replica's batch of global step `step` for
    the run's loss kind (`compiled_loss.config.loss_kind(cfg.loss)`), annotated, and the
    step's statistics; `rollouts.warm_start(step)` the same for the supervised warm start
    (see the module docstring). Prompts come from `rng` in step order."""

    def __init__(self, cfg: Config, groups: ParallelGroups, rng: random.Random, models: RolloutSources) -> None:
        self.cfg, self.kind, self.groups, self.rng = cfg, loss_kind(cfg.loss), groups, rng
        self.policy, self.reference, self.teacher = models.policy, models.reference, models.teacher
        self.generator = models.policy if models.generator is None else models.generator
        self.rows = cfg.data.prompts * cfg.data.group_size  # of the global batch
        self.local = self.rows // groups.sizes[2]
        self.sampler = Sampler(cfg, self.generator, self.local) if self.kind.samples else None
        drafter = models.drafter
        speculative = cfg.run.speculative and drafter is not None
        self.speculative = SpeculativeSampler(cfg, self.generator, drafter, self.local) if speculative else None
        held_out = dataclasses.replace(cfg.data, prompts=_HELD_OUT_PAIRS)
        self.held_out = (
            sample_batch(held_out, cfg.model.vocab_size, random.Random(cfg.run.seed + 1), pairs=True)
            if self.kind.pairs
            else None
        )

    @property
    def compiles(self) -> int:
        """The graphs the samplers compiled."""
        return sum(s.compiles for s in (self.sampler, self.speculative) if s is not None)

    def _share(self) -> slice:
        """This replica's rows of the global batch."""
        return slice(self.groups.dp_rank * self.local, (self.groups.dp_rank + 1) * self.local)

    def _sample(self, prompts: Prompts, step: int) -> tuple[Samples, Tensor, dict[str, float]]:
        """This replica's share of `prompts` (global rows) sampled, its rewards and the global statistics."""
        seed, slots, share = self.cfg.run.seed, self.sampler.response_len, self._share()
        local = prompts.rows(share)
        if self.generator is not self.policy:  # the sharded policy's weights, gathered whole (every rank)
            gather_weights(self.policy, self.generator)
        start = time.perf_counter()
        if self.speculative is None:
            samples = self.sampler(local, sampling_uniforms(seed, step, self.rows, slots)[share], step=step)
        else:
            samples = self.speculative(local, speculative_uniforms(seed, step, self.rows, slots)[share], step=step)
        seconds = time.perf_counter() - start
        rewards = score(local, samples.tokens, samples.lengths)
        mask = torch.arange(samples.tokens.shape[1]) < samples.lengths[:, None]
        counts = [samples.tokens_per_round, samples.row_rounds] if self.speculative is not None else []
        sums = torch.tensor(
            [rewards.sum(), (rewards == 1).sum(), -(samples.logprobs * mask).sum(), mask.sum(), samples.lengths.sum()]
            + counts,
            dtype=torch.float64,
        )
        reward, solved, neg_logprob, tokens, length, *counts = all_reduce_host(sums, self.groups.dp).tolist()  # host
        stats = {
            "reward": reward / self.rows,
            "solved": solved / self.rows,
            "entropy": neg_logprob / tokens,
            "response_length": length / self.rows,
            "sample_seconds": seconds,
        }
        if self.speculative is not None:  # against plain decoding of the same prompts, timed here
            start = time.perf_counter()
            self.sampler(local, sampling_uniforms(seed, step, self.rows, slots)[share], step=step)
            stats["speculative_tau"] = counts[0] / max(counts[1], 1)
            stats["speculative_speedup"] = (time.perf_counter() - start) / seconds
        return samples, rewards, stats

    def preference_accuracy(self) -> float:
        """The held-out pairs the policy prefers correctly, relative to the reference."""
        ids, mask = self.held_out["input_ids"], self.held_out["token_mask"]
        ratio = [
            (model_logprobs(m, ids, self.cfg.logprob, filtered=False) * mask).sum(1)
            for m in (self.generator, self.reference)
        ]
        margin = ratio[0] - ratio[1]
        return float((margin[::2] > margin[1::2]).double().mean())

    def _annotate(self, batch: dict[str, Tensor], kind: LossKind) -> dict[str, Tensor]:
        return rollout(
            batch,
            kind,
            policy=self.generator,  # no gradient: the policy's weights as sampled, whole
            reference=self.reference,
            teacher=self.teacher,
            topk=self.cfg.data.teacher_topk,
            sampling=self.cfg.logprob,
        )

    def warm_start(self, step: int) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Correct responses to `prompts × group_size` fresh prompts (NLL), and the reward the
        policy earns on them."""
        prompts = task_prompts(self.cfg.data, self.cfg.model.vocab_size, self.rng, self.rows)
        _, _, stats = self._sample(prompts, step)
        return self._annotate(correct_batch(prompts.rows(self._share())), _WARM_START), stats

    def __call__(self, step: int) -> tuple[dict[str, Tensor], dict[str, float]]:
        data, kind = self.cfg.data, self.kind
        if kind.clean:
            return self.warm_start(step)
        if self.sampler is None:  # a value head: pre-made rows
            batch = sample_batch(data, self.cfg.model.vocab_size, self.rng)
            stats = {"reward": float(batch["rewards"].mean())}
            return self._annotate(replica_rows(batch, self.groups.sizes[2], self.groups.dp_rank), kind), stats
        prompts = task_prompts(data, self.cfg.model.vocab_size, self.rng, data.prompts).repeat(data.group_size)
        samples, rewards, stats = self._sample(prompts, step)
        advantages = grpo_advantages(
            rewards, data.group_size, leave_one_out=data.use_leave_one_out_baseline, normalize=data.normalize_rewards
        )
        batch = sampled_batch(
            prompts.rows(self._share()), samples.tokens, samples.lengths, samples.logprobs, rewards, advantages
        )
        if kind.pairs:
            batch = preference_pairs(batch, data.group_size)
            stats["preference_accuracy"] = self.preference_accuracy()
        return self._annotate(batch, kind), stats
