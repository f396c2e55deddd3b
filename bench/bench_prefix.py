"""`lmcli serve`'s prefix cache: the same requests to a server with the cache (the default) and
to one without (``--cache-memory 0``), through the official ``openai`` client.

The model is a random 6x384 char model (vocab 65, context 2048) that writes no special tokens
(``_text_only``), each server in its own process.

- A ten-turn chat: a user message of ~40 characters and a streamed reply of 110 tokens
  (``min_tokens`` 110) per turn, so the prompt of turn 10 holds ~1,500 tokens. The row compares
  turn 10's time to first token (the best of ``REPEATS`` conversations, each with its own
  system prompt, so one conversation never reuses another's blocks; goal: 5x lower with the
  cache), and checks that every reply is the same on both servers and that the cached server
  reported ``prompt_tokens_details.cached_tokens``.
- 64 concurrent chat requests sharing a ~500-token system prompt (each its own user message and
  seed, 16 tokens each): completion tokens per second with and without the cache (the best of
  ``REPEATS`` rounds); the replies must be the same.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import openai
import torch

from bench.bench_serve import serving
from bench.common import Row, log, run_suite
from bench.models import SMALL, lmcli_model
from bench.texts import char_tokenizer
from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import SPECIAL_TOKENS, Tokenizer

TURNS, REPEATS, REPLY, ASK = 10, 2, 110, 40
CONCURRENT, SHARED_NEW = 64, 16
WORDS = "the cat sat on a mat while a dog ran over the hill and a bird sang in an old tree".split()


def _text(n: int, seed: int) -> str:
    """About ``n`` characters of words drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n:
        words.append(WORDS[int(torch.randint(len(WORDS), (1,), generator=g))])
    return " ".join(words)


def _conversation(url: str, repeat: int) -> tuple[list[str], float, int]:
    """Ten streamed turns: the replies, turn 10's time to first token, its cached tokens."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": f"conversation {repeat}: be brief."}]
    replies, ttft, cached = [], 0.0, 0
    for turn in range(TURNS):
        messages.append({"role": "user", "content": _text(ASK, 100 * repeat + turn)})
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model="bench",
            messages=messages,
            max_tokens=REPLY,
            temperature=0.8,
            seed=turn,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": REPLY},
        )
        text, first = "", None
        for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - t0
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        ttft = first if first is not None else float("nan")
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    return replies, ttft, cached


async def _shared(url: str, repeat: int) -> tuple[list[str], float, int]:
    """64 requests at once sharing a system prompt (its own in each round): their replies,
    seconds, completion tokens."""
    system = _text(500, 1000 + repeat)
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:

        async def one(i: int) -> tuple[str, int]:
            r = await client.chat.completions.create(
                model="bench",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": _text(20, 100 * repeat + i)},
                ],
                max_tokens=SHARED_NEW,
                temperature=0.8,
                seed=i,
                extra_body={"min_tokens": SHARED_NEW},
            )
            return r.choices[0].message.content, r.usage.completion_tokens

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(i) for i in range(CONCURRENT)))
        return [t for t, _ in out], time.perf_counter() - t0, sum(n for _, n in out)


def _measure(url: str) -> dict:
    """Both workloads against one server (after a warm-up request)."""
    openai.OpenAI(base_url=url + "/v1", api_key="unused").completions.create(
        model="bench", prompt="warm up", max_tokens=4
    )
    conversations = [_conversation(url, r) for r in range(REPEATS)]
    shared = [asyncio.run(_shared(url, r)) for r in range(REPEATS)]
    return {
        "replies": [c[0] for c in conversations],
        "ttft": min(c[1] for c in conversations),
        "cached": [c[2] for c in conversations],
        "shared_replies": [r for r, _, _ in shared],
        "shared_tps": max(tokens / seconds for _, seconds, tokens in shared),
    }


def _text_only(model: Transformer, tok: Tokenizer) -> Transformer:
    """The random model made to write text only, as a trained one does: its special tokens'
    output rows zeroed and the others scaled up (random logits are nearly uniform, and a special
    token in a reply is lost when the client sends the reply back as text, with the cache's
    reuse of it)."""
    special = [i for i in range(tok.vocab_size) if tok.hf.id_to_token(i) in SPECIAL_TOKENS]
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
        model.lm_head.weight[special] = 0.0
    return model


def run() -> list[Row]:
    tok = char_tokenizer(65)
    model = _text_only(lmcli_model(tok.vocab_size, 2048, tie_embeddings=False, **SMALL).eval(), tok)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "bench-prefix"
        save_checkpoint(run_dir / "best", model, TrainConfig(), tok, meta={"step": 0})
        flags = ["--max-batch", str(CONCURRENT), "--max-queue", str(CONCURRENT), "--grace", "5"]
        got = {}
        for name, memory in (("cache", "256MiB"), ("none", "0")):
            log(f"{name}: {REPEATS} conversations of {TURNS} turns, then {CONCURRENT} requests at once")
            with serving(run_dir, *flags, "--cache-memory", memory) as url:
                got[name] = _measure(url)
    cache, none = got["cache"], got["none"]
    same_chat = cache["replies"] == none["replies"]
    same_shared = cache["shared_replies"] == none["shared_replies"]
    reported = all(c > 0 for c in cache["cached"]) and all(c == 0 for c in none["cached"])
    ms = 1000.0
    return [
        Row(
            f"serve TTFT of turn {TURNS}, ~1,500-token chat",
            "ms",
            cache["ttft"] * ms,
            none["ttft"] * ms,
            "no prefix cache",
            goal=5.0,
            lower_is_better=True,
            valid=same_chat and reported,
            note=(
                f"replies identical: {same_chat}; turn {TURNS} cached tokens {cache['cached']} "
                f"(without the cache: {none['cached']})"
            ),
            extra={"cached_tokens": cache["cached"]},
        ),
        Row(
            f"serve {CONCURRENT} requests, ~500-token shared system prompt",
            "tokens/s",
            cache["shared_tps"],
            none["shared_tps"],
            "no prefix cache",
            goal=2.0,
            valid=same_shared,
            note=f"replies identical: {same_shared}",
        ),
    ]


if __name__ == "__main__":
    run_suite("prefix", run)
