"""Post-training's model-facing steps: a DPO micro-batch's loss, GRPO's loss over a rollout
group, and their validations (held-out pairs: preference accuracy and margin; held-out prompts:
mean reward and pass@1 of one seeded reply each), then the two objects the training loop asks
(``run.post``): ``PreferenceTraining`` and ``GRPOTraining``, and what opens them with a run.

The formulas are ``preference.py``'s and ``grpo.py``'s; the reference is ``reference.py``'s;
the replies come from ``rollouts.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lmcli.config.commands import SampleConfig
from lmcli.data.preferences import PairBatch, PreferenceRows, PromptRow, collate_pairs, pair_set
from lmcli.data.windows import IGNORE
from lmcli.device import autocast
from lmcli.model.kv_cache import kv_bytes
from lmcli.model.transformer import Transformer
from lmcli.tasks import Preference, Reinforcement, make_task
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.grpo import PolicyOut, policy_loss, spread_fraction
from lmcli.train.preference import PreferenceOut, preference_loss
from lmcli.train.reference import Reference, evaluating, frozen_copy, sequence_logprobs
from lmcli.train.rewards import Rewards
from lmcli.train.rollouts import Group, make_group, rollout_seed, sample_groups


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference loss reads besides log-probs: its name, beta, SimPO's gamma."""

    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5


def pair_loss(
    model: nn.Module,
    batch: PairBatch,
    reference: Reference,
    settings: PreferenceSettings,
    split: str = "train",
) -> PreferenceOut:
    """The preference loss of a batch of pairs (rows 2i chosen, 2i + 1 rejected); without a
    reference (``lmcli eval --preferences`` alone) DPO's rewards are the policy's own log-probs."""
    _, _, sums = sequence_logprobs(model, batch)  # (2B,)
    counts = (batch.y != IGNORE).sum(dim=1).to(sums.dtype)  # (2B,) reply tokens per row
    if reference.needed:
        ref = reference.pair_logprobs(batch, split)
    else:  # reference-free: SimPO reads none; the others compare the policy's own log-probs
        ref = None if settings.loss == "simpo" else torch.zeros_like(sums)
    return preference_loss(
        sums[0::2],
        sums[1::2],
        None if ref is None else ref[0::2],
        None if ref is None else ref[1::2],
        loss=settings.loss,
        beta=settings.beta,
        gamma=settings.gamma,
        chosen_tokens=counts[0::2],
        rejected_tokens=counts[1::2],
    )


@torch.no_grad()
def evaluate_pairs(
    model: nn.Module,
    batches: Iterable[PairBatch],
    reference: Reference,
    settings: PreferenceSettings,
    split: str = "val",
) -> dict[str, float]:
    """Mean loss, rewards, margin and preference accuracy over the pairs of ``batches``."""
    totals: dict[str, float] = {}
    n = 0
    with evaluating(model):
        for batch in batches:
            out = pair_loss(model, batch, reference, settings, split)
            size = out.margin.numel()
            for key, value in out.logged().items():
                totals[key] = totals.get(key, 0.0) + value * size
            n += size
    return {key: value / max(n, 1) for key, value in totals.items()} | {"pairs": n}


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


def score_preferences(
    model: nn.Module,
    tokenizer: Tokenizer,
    spec: str,
    reference: nn.Module | None = None,
    batch_size: int = 16,
) -> dict[str, float]:
    """``lmcli eval MODEL --preferences FILE [--reference REF]``: preference accuracy (the share of
    pairs whose chosen reply the model prefers) and mean margin in nats: of the model's own
    log-probs, or with ``reference`` of its log-ratios to the reference's (DPO's implicit reward)."""
    device = next(model.parameters()).device
    block = model.config.block_size
    sequences = pair_set(PreferenceRows(spec).pairs(tokenizer, block + 1))
    n = len(sequences) // 2
    batches = (
        collate_pairs(sequences, range(i, min(i + batch_size, n)), tokenizer.pad_id, block).to(device)
        for i in range(0, n, batch_size)
    )
    ref = Reference("copy", reference) if reference is not None else Reference("none")
    scores = evaluate_pairs(model, batches, ref, PreferenceSettings("dpo", beta=1.0))
    return {"accuracy": scores["accuracy"], "margin": scores["margin"], "pairs": scores["pairs"]}


# ----------------------------------------------------------------------------- in the training loop


class PostTraining:
    """What ``--task dpo``/``grpo`` add to a run: the reference, and the quantities each step
    logs, averaged between log points (``logged``)."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1

    def logged(self) -> dict[str, float]:
        """The means since the last call (what metrics.jsonl and the progress bar show)."""
        out = {key: total / self._counts[key] for key, total in self._sums.items()}
        self._sums, self._counts = {}, {}
        return out

    def summary(self, record: dict[str, Any]) -> str:
        """A validation's record in words."""
        raise NotImplementedError

    def best(self, best_loss: float) -> str:
        """The best validation, in the closing line."""
        return f"best validation loss {best_loss:.4f}"


class PreferenceTraining(PostTraining):
    """``--task dpo``: the loss of a micro-batch of pairs; validation on held-out pairs."""

    def __init__(self, reference: Reference, settings: PreferenceSettings) -> None:
        super().__init__(reference)
        self.settings = settings

    def micro_loss(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        out = pair_loss(model, batch, self.reference, self.settings)
        self.add({k: v for k, v in out.logged().items() if k != "loss"})
        return out.loss

    def validate(self, model: nn.Module, batches: Iterable[PairBatch]) -> tuple[float, dict[str, float]]:
        """The validation loss (what ``best/`` follows) and the record: accuracy, margin, rewards."""
        scores = evaluate_pairs(model, batches, self.reference, self.settings)
        record = {f"val_{k}": v for k, v in scores.items() if k != "pairs"}
        return scores["loss"], record

    def summary(self, record: dict[str, Any]) -> str:
        return (
            f"val loss {record['val_loss']:.4f}, accuracy {record['val_accuracy']:.3f}, "
            f"margin {record['val_margin']:.4f}"
        )


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


class GRPOTraining(PostTraining):
    """``--task grpo``: a step samples and rewards the replies of its prompts, then takes
    ``steps`` optimizer steps on them; validation rewards one seeded reply to each held-out
    prompt, sampled as in training."""

    def __init__(self, reference: Reference, rewards: Rewards, settings: RolloutSettings) -> None:
        super().__init__(reference)
        self.rewards, self.settings = rewards, settings

    def rollouts(self, run: Any) -> list[Group]:
        """This rank's groups of the step: ``grad_accum`` micro-batches of ``batch_size`` prompts,
        each prompt with its replies, the sampling policy's and the reference's log-probs."""
        cfg, state, s = run.cfg, run.state, self.settings
        size, accum = cfg.optim.batch_size, cfg.optim.grad_accum
        rows = size * accum * s.group
        seed = rollout_seed(cfg.seed, state.step, run.dist.rank, run.dist.world_size, rows)
        groups = []
        for micro in range(accum):
            prompts = run.sampler.batch(state.cursor + run.dist.rank * size, size)
            state.cursor += run.global_batch
            sample = replace(s.sample, seed=seed + micro * size * s.group)
            with autocast(run.device, run.amp):
                group = make_group(
                    run.model, run.data.tokenizer, prompts, self.rewards, s.group, sample, scale=s.scale
                )
                group.batch = group.batch.to(run.device)
                if s.steps > 1:  # later steps compare with the policy that sampled
                    with torch.no_grad(), evaluating(run.model):
                        group.old_logp = sequence_logprobs(run.model, group.batch)[0]
                if self.reference.needed:
                    group.ref_logp = self.reference.token_logprobs(group.batch)
            groups.append(group)
        return groups

    def step(self, run: Any, optimizer_step: Any) -> torch.Tensor:
        """One training step: rollouts, then ``steps`` optimizer steps over all of them (the
        loss a token-level mean over the step's reply tokens); returns the last gradient norm."""
        s = self.settings
        groups = self.rollouts(run)
        n_tokens = int(sum(int(g.reply_tokens.sum()) for g in groups))
        grad_norm = torch.zeros(())
        for _ in range(s.steps):
            for micro, group in enumerate(groups):
                with run.parallel.micro_batch(micro == len(groups) - 1), autocast(run.device, run.amp):
                    out = group_loss(run.trained, group, n_tokens=n_tokens, clip=s.clip, kl_coef=s.kl_coef)
                run.scaler.scale(out.loss).backward()
                run.marks.running += out.loss.detach() / s.steps
                self.add(
                    {
                        "clipped": out.clipped.item(),
                        **({"kl": out.kl.item()} if self.reference.needed else {}),
                    }
                )
            grad_norm = optimizer_step(run)
        self.add(self.describe(groups))
        return grad_norm

    def describe(self, groups: list[Group]) -> dict[str, float]:
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

    def validate(self, run: Any, prompts: list[PromptRow]) -> tuple[float, dict[str, float]]:
        """One reply to each held-out prompt (``evaluate_prompts``): the record (mean reward,
        pass@1), and minus the mean reward as the loss ``best/`` follows (lower is better)."""
        with autocast(run.device, run.amp):
            record = evaluate_prompts(
                run.model, run.data.tokenizer, prompts, self.rewards, self.settings.sample
            )
        return -record["val_reward"], record

    def summary(self, record: dict[str, Any]) -> str:
        return f"val reward {record['val_reward']:.4f}, pass@1 {record['val_pass@1']:.3f}"

    def best(self, best_loss: float) -> str:
        return f"best validation reward {-best_loss:.4f}"  # its loss: minus the reward


# ----------------------------------------------------------------------------- opening a run


def open_post_training(
    cfg: Any, model: Transformer, resumed: Any, data: Any, states: Any
) -> PostTraining | None:
    """What ``--task dpo``/``grpo`` add to a run (None for the other tasks): the reference, the
    settings, the rewards (every row checked by them now). A precomputed reference's table is
    registered in ``states`` (a resume reads it back; ``fill_tables`` computes it otherwise)."""
    post, task = cfg.post, make_task(cfg)
    if isinstance(task, Reinforcement):
        rewards = Rewards(post.reward)
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
        return GRPOTraining(make_reference(cfg, model, resumed, post.kl_coef > 0), rewards, settings)
    if isinstance(task, Preference):
        settings = PreferenceSettings(post.preference_loss, post.beta, post.simpo_gamma)
        if post.precompute_reference:
            reference = Reference("table")
            states.parts["reference"] = reference
        else:
            reference = make_reference(cfg, model, resumed, post.preference_loss != "simpo")
        return PreferenceTraining(reference, settings)
    return None


def make_reference(cfg: Any, model: Transformer, resumed: Any, needed: bool) -> Reference:
    """The model as training starts: with LoRA the base (adapters off); else a frozen copy, of
    the model now or, on resume, of ``--init-from`` read again (also with LoRA when the embedding
    trains too: ``--lora-train-embeddings`` changes the base)."""
    if not needed:
        return Reference("none")
    if cfg.lora.lora_rank and not cfg.lora.lora_train_embeddings:
        return Reference("adapters", model)
    if resumed is None:
        return Reference("copy", frozen_copy(model))
    from lmcli.train.init_from import open_init

    start = open_init(cfg.init_from, lambda msg: None, model.config.block_size).load(False)[0]
    device = next(model.parameters()).device
    return Reference("copy", frozen_copy(start).to(device))


def fill_tables(run: Any, fresh: bool) -> None:
    """``--precompute-reference``: each pair's reference log-probs (training and validation
    pairs), computed once with the model as training starts (``fresh``: a new run; a resumed
    one read them back with its state)."""
    post = run.post
    if post is None or post.reference.kind != "table" or not fresh:
        return
    size, data = run.cfg.optim.batch_size, run.data
    for split, sequences in (("train", data.train), ("val", data.val)):
        n = len(sequences) // 2
        batches = (
            collate_pairs(sequences, range(i, min(i + size, n)), data.tokenizer.pad_id, data.block_size).to(
                run.device
            )
            for i in range(0, n, size)
        )
        with autocast(run.device, run.amp):
            post.reference.fill_table(run.model, split, batches, n)


def extra_memory(cfg: Any, model: Transformer, post: PostTraining) -> int:
    """Bytes post-training needs beyond the model's training step: the reference's frozen copy,
    and GRPO's decoding cache for its batch of replies (a full context per row)."""
    extra = 0
    if post.reference.kind == "copy":
        extra += sum(p.numel() * p.element_size() for p in model.parameters())
    if isinstance(post, GRPOTraining):
        c = model.config
        rows = cfg.optim.batch_size * cfg.post.group_size
        extra += rows * (kv_bytes(c, c.block_size, 4) + 4 * c.padded_vocab_size * 4)
    return extra


def describe(post: PostTraining) -> str:
    """The pre-flight's line about post-training: the loss or rewards, the reference."""
    where = {
        "adapters": "the base (LoRA adapters off, no copy)",
        "copy": "a frozen copy of the starting model",
        "table": "log-probs precomputed once",
        "none": "none",
    }[post.reference.kind]
    if isinstance(post, GRPOTraining):
        s = post.settings
        what = (
            f"GRPO, {s.group} replies per prompt, rewards {', '.join(post.rewards.names)}, KL {s.kl_coef:g}"
        )
    else:
        s = post.settings
        what = f"{s.loss.upper()}, beta {s.beta:g}"
    return f"{what}; reference: {where}"
