"""GRPO's rollouts: G replies to each prompt, sampled by lmcli's row engine, rewarded, and laid
out as a batch to train on.

``sample_groups`` drives ``generate.engine.Engine`` (the batched decoding with a KV cache that
``lmcli sample`` and ``lmcli serve`` use: temperature, top-k/p, min-p, stop strings, max tokens):
the prompts are prefilled together once and each is expanded to its G rows. Reply ``j`` of
prompt ``p`` draws from its own generator seeded ``seed + p * G + j``, and the seed of a step is
a function of the run's seed, the step and the rank (``rollout_seed``): a resumed run samples
the very replies an uninterrupted one would, with no generator state to save.

``Group.batch`` is the prompt and reply of every row, the loss on the reply (its tokens, and
``<eos>`` when the reply ended with it), as ``--task sft`` scores a reply. The replies of a batch
of prompts are sampled together; training reads them one prompt's group at a time
(``make_groups``), so a step's activations are those of G sequences, not of every reply.
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
from lmcli.errors import LmcliError
from lmcli.generate.engine import Engine, Row
from lmcli.model.kv_cache import check_fits
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.post.policy import group_advantages
from lmcli.train.post.reference import evaluating
from lmcli.train.post.rewards import Rewards


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
    longest = max(map(len, prompts))
    cfg = replace(cfg, max_new_tokens=max(1, min(cfg.max_new_tokens, model.config.block_size - longest)))
    what = f"{len(prompts)} prompt(s) x {group} replies"
    check_fits(model, len(prompts) * group, what, columns=longest + cfg.max_new_tokens)
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
    step_tokens: int = 0  # the reply tokens of the whole step (what its loss is divided by)

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
    """Sample, reward and lay out the replies to ``prompts`` as one batch (see ``Group``)."""
    encoded, scores = sample_rewarded(model, tokenizer, prompts, rewards, group, cfg)
    return lay_out(encoded, scores, len(prompts), tokenizer.pad_id, model.config.block_size, scale)


def make_groups(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[PromptRow],
    rewards: Rewards,
    group: int,
    cfg: SampleConfig,
    *,
    scale: bool = True,
) -> list[Group]:
    """The replies to ``prompts``, sampled together, laid out one ``Group`` a prompt (its G
    replies: the advantages are the same as ``make_group``'s, each prompt's alone)."""
    encoded, scores = sample_rewarded(model, tokenizer, prompts, rewards, group, cfg)
    block, pad = model.config.block_size, tokenizer.pad_id
    return [
        lay_out(
            encoded[p * group : (p + 1) * group], scores[p * group : (p + 1) * group], 1, pad, block, scale
        )
        for p in range(len(prompts))
    ]


def sample_rewarded(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[PromptRow],
    rewards: Rewards,
    group: int,
    cfg: SampleConfig,
) -> tuple[list[tuple[Encoded, str]], list[list[float]]]:
    """``group`` replies to each prompt (prompt-major), each as a sequence to train on (prompt
    and reply, the loss on the reply) with its text, and each verifier's reward of it."""
    rows = sample_groups(model, tokenizer, [p.ids for p in prompts], group, cfg)
    work = [(prompts[k // group], row) for k, row in enumerate(rows)]
    scores = [rewards.score(p.text, row.text, p.row, p.where) for p, row in work]
    for i, prompt in enumerate(prompts):
        check_normalizable(scores[i * group : (i + 1) * group], prompt.where)
    encoded = []
    for prompt, row in work:
        reply = row.ids + ([tokenizer.eos_id] if row.finish_reason == "eos" else [])
        n = len(prompt.ids)
        encoded.append((Encoded(prompt.ids + reply, [False] * n + [True] * len(reply), n), row.text))
    return encoded, scores


def check_normalizable(scores: list[list[float]], where: str) -> None:
    """Refuse a group's rewards whose normalization overflows float32 (each reward fits, but their
    sum or spread does not): one line naming the prompt's row, not a loss of nan later."""
    total = torch.tensor(scores, dtype=torch.float32).sum(dim=-1).view(1, -1)  # (1, G)
    if not torch.isfinite(group_advantages(total)).all() or not torch.isfinite(total).all():
        low, high = min(map(sum, scores)), max(map(sum, scores))
        raise LmcliError(
            f"{where}: the rewards of its replies ({low:g} to {high:g}) overflow float32 when compared "
            "within their group: scale the rewards down"
        )


def lay_out(
    encoded: list[tuple[Encoded, str]],
    scores: list[list[float]],
    n_prompts: int,
    pad_id: int,
    block: int,
    scale: bool,
) -> Group:
    """The replies of ``n_prompts`` prompts (prompt-major) as a ``Group``: one padded batch, the
    rewards (P, G, K) and each reply's advantage within its prompt's group."""
    group = len(encoded) // n_prompts
    per_verifier = torch.tensor(scores, dtype=torch.float32).view(n_prompts, group, -1)  # (P, G, K)
    sequences = [e for e, _ in encoded]
    batch = collate(example_set(sequences), list(range(len(sequences))), pad_id, block)
    return Group(
        batch=batch,
        rewards=per_verifier,
        advantages=group_advantages(per_verifier.sum(dim=-1), scale=scale).view(-1),  # (P*G,)
        reply_tokens=torch.tensor([len(e.ids) - e.prefix for e in sequences]),
        texts=[text for _, text in encoded],
    )
