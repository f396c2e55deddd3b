"""Tokenization throughput and memory: lmcli's streaming token cache (``lmcli.data.tokenize_corpus``
with a byte-level BPE ``lmcli.tokenizer.Tokenizer``) against ``tokenizers`` ``encode_batch`` over
the whole text held in memory.

A corpus of ``BIG_MB`` MB is generated in a temporary folder (documentation lines, reshuffled
and varied) and deleted afterwards; its first ``SMALL_MB`` MB form a second corpus. Every
measurement runs in a fresh subprocess that reports its own peak RSS (VmHWM), so one
measurement's memory never counts for another. The peer holds all of the small corpus; holding
``encode_batch``'s output for the big one would need ~10 GB; there the peer encodes 10,000
lines at a time and keeps only a count. lmcli runs on both, which shows that its memory does
not grow with the corpus. Token counts differ slightly: the peer encodes
line by line, lmcli ~64 KiB pieces, so white space at line starts is split differently.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, log, run_suite
from bench.texts import shuffled_lines

BIG_MB, SMALL_MB = 200, 25
VOCAB = 8000
GOAL_SPEED, GOAL_MEMORY, GOAL_FLAT = 1.0, 1.0, 0.9


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    """Write ``megabytes`` MB (10^6 bytes) of varied text to ``path``."""
    target = megabytes * 10**6
    lines = shuffled_lines(seed)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            block = "".join(next(lines) for _ in range(20_000))
            f.write(block)
            size += len(block.encode("utf-8"))


def prefix_copy(src: Path, dst: Path, megabytes: int) -> None:
    """The first ``megabytes`` MB of ``src``, cut after a line break."""
    with open(src, "rb") as f:
        data = f.read(megabytes * 10**6)
    dst.write_bytes(data[: data.rfind(b"\n") + 1])


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM; ``ru_maxrss`` would include the parent's,
    which Linux carries across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_lmcli(corpus: str, tokenizer: str, cache: str) -> dict[str, float]:
    """lmcli: tokenize the corpus file into a fresh token cache, streaming."""
    from lmcli.data.corpus import FileCorpus
    from lmcli.data.token_cache import tokenize_corpus
    from lmcli.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer)
    t0 = time.perf_counter()
    out = tokenize_corpus(FileCorpus([corpus]), tok, Path(cache), progress=False)
    return {"seconds": time.perf_counter() - t0, "tokens": out.n_tokens}


def child_peer(corpus: str, tokenizer: str, cache: str) -> dict[str, float]:
    """The peer: read the whole text, ``encode_batch`` all of its lines, keep the ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        lines = f.readlines()
    ids = [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)]
    return {"seconds": time.perf_counter() - t0, "tokens": sum(len(x) for x in ids)}


def child_peer_stream(corpus: str, tokenizer: str, cache: str) -> dict[str, float]:
    """The peer on a corpus too big to hold: ``encode_batch`` of 10,000 lines at a time, counting ids."""
    from itertools import islice

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    tokens = 0
    with open(corpus, encoding="utf-8") as f:
        while lines := list(islice(f, 10_000)):
            tokens += sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


CHILDREN = {"lmcli": child_lmcli, "peer": child_peer, "peer-stream": child_peer_stream}


def measure(kind: str, corpus: Path, tokenizer: Path, cache: Path) -> dict[str, float]:
    """Run one measurement in a fresh interpreter; its time, tokens, and peak RSS (MB)."""
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_tokenize",
        "--child",
        kind,
        str(corpus),
        str(tokenizer),
        str(cache),
    ]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["mb"] = corpus.stat().st_size / 1e6
    log(
        f"{kind} on {result['mb']:.0f} MB: {result['mb'] / result['seconds']:.2f} MB/s, "
        f"{result['tokens']} tokens, peak RSS {result['rss_mb']:.0f} MB"
    )
    return result


def run() -> list[Row]:
    from lmcli.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="lmcli-bench-tok-") as tmp:
        tmp_dir = Path(tmp)
        big, small = tmp_dir / f"corpus-{BIG_MB}mb.txt", tmp_dir / f"corpus-{SMALL_MB}mb.txt"
        t0 = time.perf_counter()
        write_corpus(big, BIG_MB)
        prefix_copy(big, small, SMALL_MB)
        log(f"generated {big.stat().st_size / 1e6:.0f} MB of text in {time.perf_counter() - t0:.0f} s")
        with open(big, encoding="utf-8") as f:
            sample = f.read(4 * 10**6)
        tok_path = tmp_dir / "tokenizer.json"
        Tokenizer.train("bpe", iter([sample]), vocab_size=VOCAB).save(tok_path)
        cache = tmp_dir / "cache"
        ours_small = measure("lmcli", small, tok_path, cache)
        peer_small = measure("peer", small, tok_path, cache)
        ours_big = measure("lmcli", big, tok_path, cache)
        peer_big = measure("peer-stream", big, tok_path, cache)
    speed = {k: r["mb"] / r["seconds"] for k, r in (("lmcli", ours_small), ("peer", peer_small))}
    return [
        Row(
            f"tokenize MB/s, {BIG_MB} MB, BPE {VOCAB}",
            "MB/s",
            ours_big["mb"] / ours_big["seconds"],
            peer_big["mb"] / peer_big["seconds"],
            "encode_batch, 10k-line batches",
            GOAL_SPEED,
            extra={"lmcli": ours_big, "peer": peer_big},
        ),
        Row(
            f"tokenize MB/s, {SMALL_MB} MB, BPE {VOCAB}",
            "MB/s",
            speed["lmcli"],
            speed["peer"],
            "tokenizers encode_batch",
            GOAL_SPEED,
            extra={"lmcli": ours_small, "peer": peer_small},
        ),
        Row(
            f"tokenize peak RSS, {SMALL_MB} MB (lower better)",
            "MB",
            ours_small["rss_mb"],
            peer_small["rss_mb"],
            "tokenizers encode_batch",
            GOAL_MEMORY,
            lower_is_better=True,
        ),
        Row(
            f"lmcli peak RSS, {BIG_MB} MB vs {SMALL_MB} MB corpus",
            "MB",
            ours_big["rss_mb"],
            ours_small["rss_mb"],
            f"lmcli on {SMALL_MB} MB",
            GOAL_FLAT,
            lower_is_better=True,
            note=f"{BIG_MB} MB at {ours_big['mb'] / ours_big['seconds']:.2f} MB/s; memory flat if ratio ~ 1",
            extra={"lmcli_big": ours_big},
        ),
    ]


def child_main(kind: str, corpus: str, tokenizer: str, cache: str) -> None:
    result = CHILDREN[kind](corpus, tokenizer, cache)
    result["rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(*sys.argv[2:6])
    else:
        run_suite("tokenize", run)


if __name__ == "__main__":
    main()
