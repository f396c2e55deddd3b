"""The server's prefix cache through the official ``openai`` client: a conversation's turns and
requests sharing a system prompt reuse earlier keys and values, report it in
``usage.prompt_tokens_details.cached_tokens`` and ``/health``, and answer exactly what a
server without the cache answers."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from helpers import assert_one_line_error, make_run, run_cli

from lmcli.config.commands import ServeConfig
from lmcli.config.fields import parse_size
from lmcli.formats.checkpoint import Checkpoint
from lmcli.formats.sources import load_model
from lmcli.serve.server import running

openai = pytest.importorskip("openai")

TURNS = 10


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A random 2-layer char model of context 1024."""
    return load_model(make_run(tmp_path_factory.mktemp("cached") / "run", block_size=1024))


@pytest.fixture(scope="module")
def servers(long_context: Checkpoint) -> Iterator[dict[str, Any]]:
    """The model served twice: with the prefix cache (the default) and without (0 bytes)."""
    base = dict(port=0, max_batch=8, max_queue=16, grace=2)
    with (
        running(long_context, ServeConfig(**base)) as (cached, scheduler),
        running(long_context, ServeConfig(**base, cache_memory=0)) as (plain, _),
    ):
        yield {"cached": cached, "plain": plain, "scheduler": scheduler}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def converse(url: str) -> tuple[list[tuple[str, list[float]]], list[int], list[int]]:
    """A ten-turn conversation, each turn streamed with usage and log-probs: the replies (text,
    log-probs), each turn's cached tokens and prompt tokens."""
    c = client(url)
    messages: list[dict] = [{"role": "system", "content": "the cat sat on the mat. " * 4}]
    replies, cached, prompt = [], [], []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"turn {turn}: the dog sat on the log, a bird sang."})
        stream = c.chat.completions.create(
            model="run",
            messages=messages,
            max_tokens=24,
            temperature=0.8,
            seed=turn,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
        text, usage, logprobs = "", None, []
        for chunk in stream:
            text += "".join(ch.delta.content or "" for ch in chunk.choices)
            logprobs += [t.logprob for ch in chunk.choices if ch.logprobs for t in ch.logprobs.content or []]
            usage = chunk.usage or usage
        replies.append((text, logprobs))
        cached.append(usage.prompt_tokens_details.cached_tokens)
        prompt.append(usage.prompt_tokens)
        messages.append({"role": "assistant", "content": text})
    return replies, cached, prompt


def test_a_conversation_reuses_its_history_and_answers_the_same(servers: dict[str, Any]) -> None:
    replies, cached, prompt = converse(servers["cached"])
    plain, none, plain_prompt = converse(servers["plain"])
    assert [text for text, _ in replies] == [text for text, _ in plain] and prompt == plain_prompt
    for (_, got), (_, want) in zip(replies, plain, strict=True):  # the logits too, not only the draws
        assert len(got) > 0 and got == pytest.approx(want, abs=1e-4)
    assert none == [0] * TURNS
    assert cached[0] == 0
    # each later turn reuses at least the prompt before it, less a block and the end of its turn
    assert all(cached[t] >= prompt[t - 1] - 16 for t in range(1, TURNS))
    assert prompt[-1] > 400
    health = httpx.get(servers["cached"] + "/health").json()
    assert health["prefix_cache_hits"] >= TURNS - 1
    assert health["prefix_cache_cached_tokens"] >= sum(cached)
    assert 0 < health["prefix_cache_bytes"] <= health["prefix_cache_max_bytes"]
    assert "prefix_cache_hits" not in httpx.get(servers["plain"] + "/health").json()
    servers["scheduler"].clear_prefixes()
    health = httpx.get(servers["cached"] + "/health").json()
    assert health["prefix_cache_bytes"] == health["prefix_cache_blocks"] == 0


def test_concurrent_requests_share_a_system_prompt(servers: dict[str, Any]) -> None:
    system = "a bird sang in the tree. the sun rose over the hill. " * 6  # ~320 tokens

    def ask(url: str, i: int) -> tuple[str, int]:
        r = client(url).chat.completions.create(
            model="run",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"the cat {i}"}],
            max_tokens=12,
            temperature=1.0,
            seed=i,
        )
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        cached = list(pool.map(lambda i: ask(servers["cached"], i), range(8)))
        plain = list(pool.map(lambda i: ask(servers["plain"], i), range(8)))
    assert [t for t, _ in cached] == [t for t, _ in plain]
    shared = len(system) // 16 * 16  # the system prompt's whole blocks, at least, after the first
    assert sum(n >= shared for _, n in cached) >= 7


def test_cache_memory_takes_sizes(tmp_path: Path, capsys) -> None:
    assert ServeConfig(cache_memory="512MiB").cache_memory == 512 << 20
    assert parse_size("2GiB") == 2 << 30 and parse_size("300MB") == 300_000_000 and parse_size("0") == 0
    code, _, err = run_cli(["serve", str(tmp_path), "--cache-memory", "lots"], capsys)
    assert_one_line_error(code, err, "invalid size 'lots': use e.g. 512MiB, 2GiB or a number of bytes")
