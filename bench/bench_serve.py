"""`lmcli serve` under load: 64 concurrent streaming clients x 4 requests each, on loopback.

The server runs in its own process (``python -m lmcli serve``) on a random 4x128 model (vocab
65, context 256); the clients are one asyncio loop in this process. Every request is a streamed
``/v1/completions`` call (16-character prompt, temperature 0.8, its own seed, ``max_tokens``
``NEW``, usage included). The same requests are then sent one at a time. The row compares the
generated tokens per second of both (goal: batching makes the concurrent run at least 4x faster)
and checks that no request failed and that every stream ended with ``data: [DONE]``. Time to
first token and the gaps between a stream's chunks (inter-token latency: one chunk may carry
several tokens when the client falls behind) are reported as p50/p99.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import torch

from bench.common import Row, log, run_suite
from bench.models import TINY, lmcli_model
from bench.texts import char_tokenizer
from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint

CLIENTS, PER_CLIENT, NEW, MAX_BATCH = 64, 4, 32, 64
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return [
        "".join(letters[i] for i in torch.randint(0, len(letters), (16,), generator=g).tolist())
        for _ in range(n)
    ]


async def _one(client: httpx.AsyncClient, url: str, prompt: str, seed: int) -> dict[str, Any]:
    """One streamed request: its tokens, time to first token, chunk gaps, and whether it completed."""
    body = {
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, last, gaps, tokens, done, finished = None, None, [], 0, False, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    now = time.perf_counter()
                    if c.get("text"):
                        if first is None:
                            first = now
                        elif last is not None:
                            gaps.append(now - last)
                        last = now
                    finished = finished or c.get("finish_reason") is not None
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    return {
        "tokens": tokens,
        "ttft": (first or time.perf_counter()) - t0,
        "gaps": gaps,
        "complete": done and finished,
    }


async def _load(url: str, prompts: list[str], concurrent: bool) -> tuple[list[dict[str, Any]], float]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        t0 = time.perf_counter()
        if concurrent:

            async def client_task(c: int) -> list[dict[str, Any]]:
                return [
                    await _one(client, url, prompts[c * PER_CLIENT + i], c * PER_CLIENT + i)
                    for i in range(PER_CLIENT)
                ]

            clients = len(prompts) // PER_CLIENT
            results = [
                r for rs in await asyncio.gather(*(client_task(c) for c in range(clients))) for r in rs
            ]
        else:
            results = [await _one(client, url, p, i) for i, p in enumerate(prompts)]
        return results, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@contextmanager
def serving(run_dir: Path, *flags: str) -> Iterator[str]:
    """``lmcli serve RUN_DIR FLAGS`` in its own process on a free loopback port (on the CPU):
    its base URL once ``/health`` answers; stopped when the block ends."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lmcli", "serve", str(run_dir), "--port", str(port), "--device", "cpu"]
    server = subprocess.Popen([*cmd, *flags], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def run() -> list[Row]:
    tok = char_tokenizer(65)
    model = lmcli_model(tok.vocab_size, 256, **TINY).eval()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "bench-serve"
        save_checkpoint(run_dir / "best", model, TrainConfig(), tok, meta={"step": 0})
        limits = ["--max-batch", str(MAX_BATCH), "--max-queue", str(CLIENTS * PER_CLIENT), "--grace", "5"]
        with serving(run_dir, *limits) as url:
            prompts = _prompts(CLIENTS * PER_CLIENT)
            log(f"warm-up; then {CLIENTS} clients x {PER_CLIENT} streamed requests of {NEW} tokens")
            asyncio.run(_load(url, prompts[:MAX_BATCH], concurrent=True))
            together, t_together = asyncio.run(_load(url, prompts, concurrent=True))
            log(f"concurrent: {t_together:.1f} s; now the same {len(prompts)} requests one at a time")
            alone, t_alone = asyncio.run(_load(url, prompts, concurrent=False))
    errors = sum("error" in r for r in together + alone)
    incomplete = sum(not r.get("complete", False) for r in together + alone)
    tps = sum(r.get("tokens", 0) for r in together) / t_together
    tps_alone = sum(r.get("tokens", 0) for r in alone) / t_alone
    ttft = [r["ttft"] for r in together if "ttft" in r]
    gaps = [g for r in together for g in r.get("gaps", [])]
    ttft_alone = [r["ttft"] for r in alone if "ttft" in r]
    gaps_alone = [g for r in alone for g in r.get("gaps", [])]
    ms = 1000.0
    extra = {
        "requests": len(together),
        "errors": errors,
        "incomplete_streams": incomplete,
        "ttft_p50_ms": _pct(ttft, 0.5) * ms,
        "ttft_p99_ms": _pct(ttft, 0.99) * ms,
        "itl_p50_ms": _pct(gaps, 0.5) * ms,
        "itl_p99_ms": _pct(gaps, 0.99) * ms,
        "alone_ttft_p50_ms": _pct(ttft_alone, 0.5) * ms,
        "alone_itl_p50_ms": _pct(gaps_alone, 0.5) * ms,
        "seconds_concurrent": t_together,
        "seconds_one_at_a_time": t_alone,
    }
    note = (
        f"{errors} errors, {incomplete} incomplete streams; "
        f"concurrent TTFT p50 {extra['ttft_p50_ms']:.0f} ms, "
        f"p99 {extra['ttft_p99_ms']:.0f} ms; inter-token p50 {extra['itl_p50_ms']:.1f} ms, "
        f"p99 {extra['itl_p99_ms']:.1f} ms (one at a time: TTFT p50 {extra['alone_ttft_p50_ms']:.0f} ms, "
        f"inter-token p50 {extra['alone_itl_p50_ms']:.1f} ms)"
    )
    return [
        Row(
            f"serve tokens/s, {CLIENTS} clients x {PER_CLIENT} streams",
            "tokens/s",
            tps,
            tps_alone,
            "one request at a time",
            goal=4.0,
            valid=errors == 0 and incomplete == 0,
            note=note,
            extra=extra,
        )
    ]


if __name__ == "__main__":
    run_suite("serve", run)
