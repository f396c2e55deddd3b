"""GRPO's rollouts: G replies to each prompt, sampled by lmcli's row engine, rewarded, and laid
out as a batch to train on.

``sample_groups`` drives ``generate.engine.Engine`` (the batched decoding with a KV cache that
``lmcli sample`` and ``lmcli serve`` use: temperature, top-k/p, min-p, stop strings, max tokens):
the prompts are prefilled together once and each is expanded to its G rows. Reply ``j`` of
prompt ``p`` draws from its own generator seeded ``seed + p * G + j``, and the seed of a step is
a function of the run's seed, the step and the rank (``rollout_seed``): a resumed run samples
the very replies an uninterrupted one would, with no generator state to save.

``Group.batch`` is the prompt and reply of every row, the loss on the reply (its tokens, and
``<eos>`` when the reply ended with it), as ``--task sft`` scores a reply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lmcli.config.commands import SampleConfig
from lmcli.config.fields import SEED_MAX
from lmcli.data.examples import Encoded, collate
from lmcli.data.preferences import PromptRow, example_set
from lmcli.data.windows import Batch
from lmcli.generate.engine import Engine, Row
from lmcli.model.kv_cache import check_fits
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.grpo import group_advantages
from lmcli.train.reference import evaluating
from lmcli.train.rewards import Rewards


def rollout_seed(seed: int, step: int, rank: int, world: int, rows: int) -> int:
    """The sampling seed of a step's rollouts on a rank: rows ``seed .. seed + rows - 1`` of every
    (step, rank) are distinct, and within ``SampleConfig``'s bounds."""
    span = SEED_MAX - rows
    return (seed + (step * world + rank) * rows) % span


@torch.inference_mode()
def sample_groups(
    model: Transformer, tokenizer: Tokenizer, prompts: list[list[int]], group: int, cfg: SampleConfig
) -> list[Row]:
    """``group`` replies to each prompt (prompt-major rows), in one batch of the row engine; the
    longest prompt leaves its replies room within the context (no sliding window)."""
    room = model.config.block_size - max(map(len, prompts))
    cfg = replace(cfg, max_new_tokens=max(1, min(cfg.max_new_tokens, room)))
    check_fits(model, len(prompts) * group, f"{len(prompts)} prompt(s) x {group} replies")
    rows = [
        Row(cfg, prompts[p], p * group + j, stream=False) for p in range(len(prompts)) for j in range(group)
    ]
    engine = Engine(model, tokenizer)
    with evaluating(model):
        engine.start(prompts, rows, cfg.max_new_tokens)
        while engine.live:
            engine.advance()
    return rows


@dataclass
class Group:
    """One micro-batch of rollouts: P prompts x G replies, rewarded, as a batch to train on."""

    batch: Batch  # (P*G, T): prompt and reply, the loss on the reply
    rewards: Tensor  # (P, G, K): each verifier's reward
    advantages: Tensor  # (P*G,): each reply's advantage (its tokens all carry it)
    reply_tokens: Tensor  # (P*G,) tokens the loss reads per row
    texts: list[str]  # the replies' text (cut at a stop string)
    old_logp: Tensor | None = None  # (N,) the sampling policy's, when it takes several steps
    ref_logp: Tensor | None = None  # (N,) the reference's, for the KL term

    @property
    def total(self) -> Tensor:
        """(P, G): each reply's reward, its verifiers' sum."""
        return self.rewards.sum(dim=-1)


def make_group(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[PromptRow],
    rewards: Rewards,
    group: int,
    cfg: SampleConfig,
    *,
    scale: bool = True,
) -> Group:
    """Sample, reward and lay out the replies to ``prompts`` (see ``Group``)."""
    rows = sample_groups(model, tokenizer, [p.ids for p in prompts], group, cfg)
    scores, encoded = [], []
    for k, row in enumerate(rows):
        prompt = prompts[k // group]
        scores.append(rewards.score(prompt.text, row.text, prompt.row, prompt.where))
        reply = row.ids + ([tokenizer.eos_id] if row.finish_reason == "eos" else [])
        n = len(prompt.ids)
        encoded.append(Encoded(prompt.ids + reply, [False] * n + [True] * len(reply), n))
    per_verifier = torch.tensor(scores, dtype=torch.float32).view(len(prompts), group, -1)  # (P, G, K)
    block = model.config.block_size
    batch = collate(example_set(encoded), list(range(len(encoded))), tokenizer.pad_id, block)
    return Group(
        batch=batch,
        rewards=per_verifier,
        advantages=group_advantages(per_verifier.sum(dim=-1), scale=scale).view(-1),  # (P*G,)
        reply_tokens=torch.tensor([len(e.ids) - e.prefix for e in encoded]),
        texts=[row.text for row in rows],
    )
