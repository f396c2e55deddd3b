"""The row engine's rules, with rows joining and leaving a running batch: each row gives what it
gives alone. A mock model makes every row's next-token logits a function of its own tokens,
so only the engine's rules are under test (the real model's batching is tests/serve's)."""

from __future__ import annotations

import torch
from helpers import tiny_tokenizer
from torch import Tensor

from lmcli.config.commands import SampleConfig
from lmcli.generate.engine import Emitted, Engine, Row

TOK = tiny_tokenizer()
V = TOK.vocab_size


def mock_logits(sequence: list[int]) -> Tensor:
    """The next-token logits (V,) after ``sequence``: a function of its last three tokens."""
    g = torch.Generator().manual_seed(hash(tuple(sequence[-3:])) % (1 << 31))
    logits = 3 * torch.randn(V, generator=g)
    logits[[TOK.pad_id, TOK.bos_id, TOK.unk_id]] = -10.0  # tokens without text: rarely
    logits[TOK.eos_id] += 1.0  # an <eos> now and then
    return logits


class MockEngine(Engine):
    """An engine whose model step is ``mock_logits`` of every row; rows join with ``join``."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(1, 1), TOK)

    def join(self, rows: list[Row]) -> None:
        if not rows:
            return
        new = torch.stack([mock_logits(r.sequence) for r in rows])
        self.logits = new if self.logits is None else torch.cat([self.logits, new])
        self.rows += rows

    def forward(self) -> None:
        self.logits = torch.stack([mock_logits(r.sequence if r is not None else [0]) for r in self.rows])


class Ban:
    """A toy row processor: its row never takes ``token`` (rows with different tokens are
    processed in one call, as a grammar's masks would be)."""

    batches: list[int] = []  # the rows of each call

    def __init__(self, token: int) -> None:
        self.token, self.taken = token, []

    @classmethod
    def apply(cls, logits: Tensor, processors: list[Ban]) -> Tensor:
        cls.batches.append(len(processors))
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask[torch.arange(len(processors)), torch.tensor([p.token for p in processors])] = True
        return logits.masked_fill(mask, float("-inf"))

    def accept(self, token: int) -> None:
        self.taken.append(token)


def run_alone(row: Row) -> list[Emitted]:
    engine = MockEngine()
    engine.join([row])
    out: list[Emitted] = []
    while engine.live:
        out += engine.advance()
    return out


PROMPT = [TOK.bos_id, *TOK.encode("the dog")]


def row(
    prompt: list[int] = PROMPT, sample: int = 0, top_logprobs: int = 0, ban: int | None = None, **settings
) -> Row:
    processors = (Ban(ban),) if ban is not None else ()
    return Row(SampleConfig(**settings), prompt, sample, top_logprobs=top_logprobs, processors=processors)


def test_rows_joining_and_leaving_follow_every_rule_as_alone() -> None:
    free = row(temperature=0.0, max_new_tokens=40)
    assert "".join(e.text for e in run_alone(free)) == free.text and len(free.text) >= 8, free.text
    stop = free.text[4:6]
    first, second = mock_logits(PROMPT).topk(2).indices.tolist()  # the likeliest first tokens
    assert TOK.eos_id not in (first, second)
    plan = [  # (the step at which the row joins, the row's settings)
        (0, dict(temperature=1.0, repetition_penalty=1.5, max_new_tokens=30, seed=1)),
        (0, dict(temperature=0.7, top_k=5, min_new_tokens=15, max_new_tokens=20, seed=2)),  # leaves early
        (3, dict(temperature=0.0, max_new_tokens=40, stop=(stop, "zz"))),
        (
            5,
            dict(temperature=1.0, top_p=0.8, min_p=0.05, max_new_tokens=25, seed=4, sample=1, top_logprobs=3),
        ),
        # equal settings, one group: the two processors of one class go through one call
        (7, dict(temperature=0.0, max_new_tokens=25, ban=first)),
        (7, dict(temperature=0.0, max_new_tokens=25, ban=second)),
        (7, dict(temperature=0.0, max_new_tokens=25)),
    ]
    alone = [run_alone(row(**settings)) for _, settings in plan]
    rows = [row(**settings) for _, settings in plan]
    Ban.batches.clear()
    engine = MockEngine()
    got: dict[int, list[Emitted]] = {id(r): [] for r in rows}
    for step in range(80):
        engine.join([r for (at, _), r in zip(plan, rows, strict=True) if at == step])
        if step == 10:
            engine.drop(1)  # the min-new-tokens row leaves (a client that went away)
        for e in engine.advance():
            assert engine.rows[e.position] is e.row
            got[id(e.row)].append(e)
    assert not engine.live and 2 in Ban.batches
    for i, (r, lone) in enumerate(zip(rows, alone, strict=True)):
        mine = [(e.token, e.logprob, e.text, e.top, e.finish_reason) for e in got[id(r)]]
        if i == 1:  # it left after 10 steps: until then it took what it takes alone
            assert len(mine) == 10 and [m[0] for m in mine] == [e.token for e in lone[:10]]
            continue
        assert mine == [(e.token, e.logprob, e.text, e.top, e.finish_reason) for e in lone]
        assert r.text == "".join(m[2] for m in mine) and len(r.ids) <= r.cfg.max_new_tokens
    penalized, min_tokens, stopped, top, banned_first, banned_second, neither = rows
    plain = row(temperature=1.0, max_new_tokens=30, seed=1)
    run_alone(plain)
    assert plain.ids != penalized.ids  # the penalty changes what the row takes
    assert TOK.eos_id not in [e.token for e in got[id(min_tokens)]]  # none before min_new_tokens
    # a stop string ends the text before it, and no part of it was streamed (checked above)
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]
    for e in got[id(top)]:  # the three likeliest tokens, best first
        assert len(e.top) == 3 and e.top[0][1] >= max(e.logprob, e.top[1][1]) >= e.top[2][1]
    assert (neither.ids[0], banned_first.ids[0], banned_second.ids[0]) == (first, second, first)
    assert first not in banned_first.ids and second not in banned_second.ids
    assert banned_first.processors[0].taken == banned_first.sequence[len(PROMPT) :]


def test_eos_is_never_chosen_before_min_new_tokens() -> None:
    ends = [run_alone(row([TOK.bos_id], temperature=1.0, max_new_tokens=60, seed=s)) for s in range(20)]
    early = [s for s, out in enumerate(ends) if out[-1].finish_reason == "eos" and len(out) < 10]
    assert early  # some rows end at <eos> within 10 tokens ...
    for s in early:  # ... none with min_new_tokens 10
        r = row([TOK.bos_id], temperature=1.0, max_new_tokens=60, min_new_tokens=10, seed=s)
        out = run_alone(r)
        assert len(r.ids) >= 10 and TOK.eos_id not in [e.token for e in out[:10]]
