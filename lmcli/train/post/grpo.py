"""``--task grpo``: reinforcement learning with verifiable rewards, one method object (``GRPO``) and
its config section's options (``PostTrainConfig``: ``--reward``, ``--group-size``, ``--kl-coef``,
``--ratio-clip``, ``--grpo-steps`` and the sampling options of the replies).

A step samples G replies to each of its prompts (``rollouts.py``: the row engine, seeded by the
step), rewards them (``rewards.py``), and takes ``--grpo-steps`` optimizer steps on them; the
loss is ``policy.py``'s clipped objective, a token-level mean over the step's reply tokens,
read one prompt's group at a time. A validation rewards one seeded reply to each held-out
prompt: the mean reward (``best/`` follows it) and pass@1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lmcli.config.commands import SampleConfig
from lmcli.config.train import TrainConfig
from lmcli.data.preferences import PromptData, PromptRow
from lmcli.data.train_data import TrainData
from lmcli.device import autocast
from lmcli.formats.checkpoint import Checkpoint
from lmcli.model.kv_cache import cache_dtype, kv_bytes, value_bytes
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.post.base import PostMethod
from lmcli.train.post.policy import PolicyOut, policy_loss, spread_fraction
from lmcli.train.post.reference import Reference, evaluating, make_reference, sequence_logprobs
from lmcli.train.post.rewards import Rewards
from lmcli.train.post.rollouts import Group, make_groups, rollout_seed, sample_groups
from lmcli.train.preflight import estimated_memory
from lmcli.train.run import Run


@dataclass(frozen=True)
class RolloutSettings:
    """GRPO's options: replies per prompt, the objective's clip and KL weight, optimizer steps
    per batch of replies, the rewards' scaling, and how replies are sampled."""

    group: int = 8
    clip: float = 0.2
    kl_coef: float = 0.0
    steps: int = 1
    scale: bool = True
    sample: SampleConfig = SampleConfig(max_new_tokens=128, temperature=1.0)


def group_loss(model: nn.Module, group: Group, *, n_tokens: int, clip: float, kl_coef: float) -> PolicyOut:
    """GRPO's clipped objective over a rollout group's reply tokens (its share of ``n_tokens``)."""
    logp, rows, _ = sequence_logprobs(model, group.batch)  # (N,), (N,)
    advantages = group.advantages.to(logp.device)[rows]  # (N,) each token its reply's
    old = group.old_logp if group.old_logp is not None else logp.detach()
    return policy_loss(logp, old, advantages, group.ref_logp, clip=clip, kl_coef=kl_coef, n_tokens=n_tokens)


@torch.no_grad()
def evaluate_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[PromptRow],
    rewards: Rewards,
    cfg: SampleConfig,
    rows: int = 64,
) -> dict[str, Any]:
    """One reply to each held-out prompt, sampled as ``cfg`` says (its seed: the same replies
    for the same weights): the mean reward (and each verifier's), and pass@1: the share of
    prompts whose reply passes every check (``Rewards.passed``)."""
    one = replace(cfg, num_samples=1)
    scores: list[list[float]] = []
    for start in range(0, len(prompts), rows):
        part = prompts[start : start + rows]
        replies = sample_groups(
            model, tokenizer, [p.ids for p in part], 1, replace(one, seed=one.seed + start)
        )
        for prompt, row in zip(part, replies, strict=True):
            scores.append(rewards.score(prompt.text, row.text, prompt.row, prompt.where))
    table = torch.tensor(scores, dtype=torch.float64).view(len(prompts), -1)  # (prompts, verifiers)
    record = {
        "val_reward": table.sum(dim=1).mean().item(),
        "val_pass@1": sum(rewards.passed(s) for s in scores) / max(len(scores), 1),
    }
    if len(rewards.names) > 1:
        means = table.mean(dim=0).tolist()
        record.update({f"val_reward_{name}": v for name, v in zip(rewards.names, means, strict=True)})
    return record


class GRPO(PostMethod[Group]):
    """``--task grpo``: a step samples and rewards the replies of its prompts
    (``micro_batches``: ``grad_accum`` batches of ``--batch-size`` prompts, sampled together, each
    prompt's G replies a micro-batch of the loss), then takes ``passes`` optimizer steps on them;
    validation rewards one seeded reply to each held-out prompt, sampled as in training. The
    starting model is validated first (``baseline``): what the run is to improve on."""

    baseline = True
    probes = False  # a step samples first: the pre-flight times no plain step
    shown = (("reward", "reward", ".3f"),)

    def __init__(
        self,
        reference: Reference,
        rewards: Rewards,
        settings: RolloutSettings,
        data: PromptData,
        cfg: TrainConfig,
    ) -> None:
        super().__init__(reference)
        self.rewards, self.settings, self.data, self.cfg = rewards, settings, data, cfg
        self.passes = settings.steps

    @classmethod
    def open(
        cls, cfg: TrainConfig, model: Transformer, resumed: Checkpoint | None, data: TrainData | PromptData
    ) -> GRPO:
        """The method of a run: its rewards (every row checked by them now), the sampling
        settings, the reference (kept only with a KL term)."""
        assert isinstance(data, PromptData)
        post = cfg.post
        rewards = Rewards(post.reward)
        try:
            for prompt in [*data.train, *data.val]:
                rewards.check(prompt.row, prompt.where)
            sample = SampleConfig(
                max_new_tokens=post.max_new_tokens,
                temperature=post.temperature,
                top_k=post.top_k,
                top_p=post.top_p,
                stop=post.stop,
                seed=cfg.seed,
            )
            settings = RolloutSettings(
                post.group_size, post.ratio_clip, post.kl_coef, post.grpo_steps, True, sample
            )
            reference = make_reference(cfg, model, resumed, post.kl_coef > 0)
        except BaseException:
            rewards.close()
            raise
        return cls(reference, rewards, settings, data, cfg)

    def micro_batches(self, run: Run) -> list[Group]:
        """This rank's groups of the step: ``grad_accum`` batches of ``batch_size`` prompts, the
        replies of each batch sampled together, each prompt's group with the sampling policy's
        (``--grpo-steps`` above 1) and the reference's log-probs."""
        state, s = run.state, self.settings
        size, accum = self.cfg.optim.batch_size, self.cfg.optim.grad_accum
        seed = rollout_seed(
            self.cfg.seed, state.step, run.dist.rank, run.dist.world_size, size * accum * s.group
        )
        groups: list[Group] = []
        for micro in range(accum):
            prompts = run.sampler.batch(state.cursor + run.dist.rank * size, size)
            state.cursor += run.global_batch
            sample = replace(s.sample, seed=seed + micro * size * s.group)
            with autocast(run.device, run.amp):
                tok = self.data.tokenizer
                for group in make_groups(
                    run.model, tok, prompts, self.rewards, s.group, sample, scale=s.scale
                ):
                    groups.append(self.prepared(group, run))
        step_tokens = int(sum(int(g.reply_tokens.sum()) for g in groups))
        for group in groups:
            group.step_tokens = step_tokens
        self.add(self.describe_groups(groups))
        return groups

    def prepared(self, group: Group, run: Run) -> Group:
        """``group`` on the device, with the log-probs its loss compares with."""
        group.batch = group.batch.to(run.device)
        if self.passes > 1:  # later steps compare with the policy that sampled
            with torch.no_grad(), evaluating(run.model):
                group.old_logp = sequence_logprobs(run.model, group.batch)[0]
        if self.reference.needed:
            group.ref_logp = self.reference.token_logprobs(group.batch)
        return group

    def loss(self, model: nn.Module, micro: Group) -> torch.Tensor:
        """The group's share of the step's loss: its reply tokens' clipped objective, summed and
        divided by the step's reply tokens (``n_tokens``), so the shares add up to the mean."""
        s = self.settings
        out = group_loss(model, micro, n_tokens=micro.step_tokens, clip=s.clip, kl_coef=s.kl_coef)
        self.add({"clipped": out.clipped.item(), **({"kl": out.kl.item()} if self.reference.needed else {})})
        return out.loss

    def describe_groups(self, groups: list[Group]) -> dict[str, float]:
        """A step's rollouts in numbers: mean reward (and each verifier's), the share of groups
        with any spread, mean reply length in tokens."""
        rewards = torch.cat([g.rewards for g in groups])  # (P, G, K)
        total = rewards.sum(dim=-1)  # (P, G)
        out = {
            "reward": total.mean().item(),
            "groups_with_spread": spread_fraction(total),
            "reply_tokens": torch.cat([g.reply_tokens for g in groups]).float().mean().item(),
        }
        if len(self.rewards.names) > 1:
            means = rewards.mean(dim=(0, 1)).tolist()
            out.update({f"reward_{n}": v for n, v in zip(self.rewards.names, means, strict=True)})
        return out

    def validate(self, run: Run) -> tuple[float, dict[str, float]]:
        """One reply to each of the first ``--eval-batches`` x ``--batch-size`` held-out prompts
        (``evaluate_prompts``): the record (mean reward, pass@1), and minus the mean reward as
        the loss ``best/`` follows (lower is better)."""
        limit = self.cfg.validation.eval_batches * self.cfg.optim.batch_size
        with autocast(run.device, run.amp):
            record = evaluate_prompts(
                run.model, self.data.tokenizer, self.data.val[:limit], self.rewards, self.settings.sample
            )
        return -record["val_reward"], record

    def summary(self, record: dict[str, Any]) -> str:
        return f"val reward {record['val_reward']:.4f}, pass@1 {record['val_pass@1']:.3f}"

    def best(self, best_loss: float) -> str:
        return f"best validation reward {-best_loss:.4f}"  # its loss: minus the reward

    def context(self, run: Run) -> int:
        """A prompt and its longest reply (never past the model's context)."""
        longest = max(len(p.ids) for p in [*self.data.train, *self.data.val])
        return min(longest + self.settings.sample.max_new_tokens, run.model.config.block_size)

    def memory(self, run: Run, shards: int) -> int:
        """The loss's step over one prompt's G replies of ``context`` tokens, the reference's copy,
        and the decoding of a batch's replies: each row's KV cache over ``context`` columns and
        its next-token scores."""
        c, rows = run.model.config, self.cfg.optim.batch_size * self.settings.group
        step = estimated_memory(
            run.model, self.cfg, run.amp, run.device, shards, self.context(run), self.settings.group
        )
        itemsize = value_bytes(cache_dtype(run.model))
        decoding = rows * (kv_bytes(c, self.context(run), itemsize) + 4 * c.padded_vocab_size * 4)
        return step + self.reference.nbytes + decoding

    def describe(self) -> dict[str, str]:
        s = self.settings
        what = (
            f"GRPO, {s.group} replies per prompt, rewards {', '.join(self.rewards.names)}, KL {s.kl_coef:g}"
        )
        return {"post-training": f"{what}; {self.reference_words()}"}

    def close(self) -> None:
        self.rewards.close()
