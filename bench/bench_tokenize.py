"""Tokenization throughput and memory.

1. ``lmcli tokenize`` on ``BIG_MB`` MB (1 GB) of JSONL documents, with both cores and with one,
   against nanoGPT's ``data/openwebtext/prepare.py`` recipe as that script does it, written here
   from its description: ``datasets.load_dataset`` of the documents, ``Dataset.map`` of
   ``tiktoken``'s ``encode_ordinary`` plus the end-of-text token over ``num_proc`` processes,
   then the ids written into one ``np.memmap`` in 1,024 contiguous batches. tiktoken is given
   the same byte-level BPE vocabulary lmcli uses (its GPT-2 file cannot be downloaded here):
   both sides encode the same documents into the same vocabulary (token counts differ a little:
   tiktoken merges by the rank of the merged token, ``tokenizers`` by the rank of the pair).
   Peak memory is each side's main process plus its largest worker times the workers; lmcli is
   also run on the first ``MID_MB`` MB, which shows that its memory does not grow with the corpus.
2. lmcli's token cache (``tokenize_corpus``: what ``lmcli train CORPUS`` runs) on ``SMALL_MB``
   MB of text against ``tokenizers``' ``encode_batch`` over the whole text held in memory.

The corpus is generated in a temporary folder (documentation lines, reshuffled and varied, in
documents of 20-100 lines) and deleted afterwards. Every measurement runs in a fresh
subprocess, pinned to the cores it is given (``os.sched_setaffinity``), that reports its own
peak RSS (VmHWM) and its largest child's. On two idle cores the suite takes about 20 minutes.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, log, run_suite
from bench.texts import shuffled_lines

BIG_MB = int(os.environ.get("LMCLI_BENCH_TOKENIZE_MB", "1000"))  # a smaller figure for a quick look
MID_MB, SMALL_MB = BIG_MB // 10, 25
VOCAB = 8000
GOAL_SPEED, GOAL_SCALING, GOAL_MEMORY, GOAL_FLAT = 1.0, 1.6, 1.0, 0.9


def write_documents(path: Path, megabytes: int, seed: int = 0) -> None:
    """Write ``megabytes`` MB (10^6 bytes) of JSONL documents ({"text": ...}) to ``path``."""
    target = megabytes * 10**6
    lines, rng = shuffled_lines(seed), random.Random(seed)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            block = "".join(
                json.dumps({"text": "".join(next(lines) for _ in range(rng.randint(20, 100)))}) + "\n"
                for _ in range(200)
            )
            f.write(block)
            size += len(block.encode("utf-8"))


def write_text(path: Path, megabytes: int, seed: int = 0) -> None:
    """Write ``megabytes`` MB of plain text to ``path``."""
    target, lines, size = megabytes * 10**6, shuffled_lines(seed), 0
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


def tiktoken_encoding(tokenizer_path: str):  # noqa: ANN201 - a tiktoken.Encoding
    """tiktoken with the byte-level BPE vocabulary of ``tokenizer.json`` (GPT-2's split pattern)."""
    import tiktoken

    from lmcli.text.tokenizer import SPECIAL_TOKENS, Tokenizer, _byte_alphabet

    tok = Tokenizer.load(tokenizer_path)
    byte_of = {c: b for b, c in enumerate(_byte_alphabet())}
    ranks = {
        bytes(byte_of[c] for c in text): i
        for text, i in tok.hf.get_vocab(with_added_tokens=False).items()
        if text not in SPECIAL_TOKENS
    }
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(
        "bench-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
    ), tok.eos_id


def child_lmcli_tokenize(corpus: str, tokenizer: str, out: str, cores: int) -> dict[str, float]:
    """``lmcli tokenize CORPUS --tokenizer TOKENIZER --out OUT`` on ``cores`` cores."""
    from lmcli.config.commands import TokenizeConfig
    from lmcli.config.train import DataConfig
    from lmcli.data.token_cache import tokenize_to

    cfg = TokenizeConfig(
        out=out, data=DataConfig(corpus=(corpus,), tokenizer=tokenizer, cache_dir=out + "-cache")
    )
    t0 = time.perf_counter()
    folder = tokenize_to(cfg, progress=False)
    return {"seconds": time.perf_counter() - t0, "tokens": folder.n_tokens, "workers": cores}


def child_nanogpt(corpus: str, tokenizer: str, out: str, cores: int) -> dict[str, float]:
    """nanoGPT's openwebtext/prepare.py recipe: datasets.map of tiktoken over ``cores`` processes,
    then one memmap written in 1,024 batches."""
    import datasets
    import numpy as np

    datasets.disable_progress_bars()
    enc, eot = tiktoken_encoding(tokenizer)

    def process(example: dict) -> dict:
        ids = enc.encode_ordinary(example["text"])
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    t0 = time.perf_counter()
    split = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=out + "-hf")
    tokenized = split.map(process, remove_columns=["text"], num_proc=cores)
    total = int(np.sum(tokenized["len"], dtype=np.uint64))
    arr = np.memmap(out + ".bin", dtype=np.uint16, mode="w+", shape=(total,))
    index, batches = 0, 1024
    for i in range(batches):
        batch = tokenized.shard(num_shards=batches, index=i, contiguous=True).with_format("numpy")
        ids = np.concatenate(batch["ids"])
        arr[index : index + len(ids)] = ids
        index += len(ids)
    arr.flush()
    return {"seconds": time.perf_counter() - t0, "tokens": total, "workers": cores}


def child_cache(corpus: str, tokenizer: str, out: str, cores: int) -> dict[str, float]:
    """lmcli's token cache (``lmcli train CORPUS``), streaming into a fresh cache folder."""
    from lmcli.data.corpus import FileCorpus
    from lmcli.data.token_cache import tokenize_corpus
    from lmcli.text.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer)
    t0 = time.perf_counter()
    folder = tokenize_corpus(FileCorpus([corpus]), tok, Path(out), progress=False)
    return {"seconds": time.perf_counter() - t0, "tokens": folder.n_tokens}


def child_peer(corpus: str, tokenizer: str, out: str, cores: int) -> dict[str, float]:
    """``tokenizers``: read the whole text, ``encode_batch`` all of its lines, keep the ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        lines = f.readlines()
    ids = [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)]
    return {"seconds": time.perf_counter() - t0, "tokens": sum(len(x) for x in ids)}


CHILDREN = {"lmcli": child_lmcli_tokenize, "nanogpt": child_nanogpt, "cache": child_cache, "peer": child_peer}


def measure(kind: str, corpus: Path, tokenizer: Path, out: Path, cores: int = 2) -> dict[str, float]:
    """Run one measurement in a fresh interpreter on ``cores`` cores: time, tokens, peak RSS (MB)."""
    for leftover in (out, Path(f"{out}-cache"), Path(f"{out}-hf"), Path(f"{out}.bin")):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_tokenize",
        "--child",
        kind,
        str(corpus),
        str(tokenizer),
        str(out),
    ]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([*cmd, str(cores)], check=True, capture_output=True, text=True, cwd=root, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["mb"] = corpus.stat().st_size / 1e6
    result["mb_per_s"] = result["mb"] / result["seconds"]
    log(
        f"{kind} on {result['mb']:.0f} MB, {cores} core(s): {result['mb_per_s']:.2f} MB/s, "
        f"{result['tokens']} tokens, peak RSS {result['rss_mb']:.0f} MB (+ {result['child_rss_mb']:.0f} MB "
        f"per worker)"
    )
    return result


def total_rss(result: dict[str, float]) -> float:
    """Main process plus each worker at the largest worker's peak (an upper bound of the sum)."""
    return result["rss_mb"] + result.get("workers", 1) * result["child_rss_mb"]


def run() -> list[Row]:
    from lmcli.text.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="lmcli-bench-tok-") as tmp:
        tmp_dir = Path(tmp)
        big, mid = tmp_dir / f"docs-{BIG_MB}mb.jsonl", tmp_dir / f"docs-{MID_MB}mb.jsonl"
        text = tmp_dir / f"text-{SMALL_MB}mb.txt"
        t0 = time.perf_counter()
        write_documents(big, BIG_MB)
        prefix_copy(big, mid, MID_MB)
        write_text(text, SMALL_MB)
        log(f"generated {big.stat().st_size / 1e6:.0f} MB of documents in {time.perf_counter() - t0:.0f} s")
        with open(text, encoding="utf-8") as f:
            sample = f.read(4 * 10**6)
        tok_path = tmp_dir / "tokenizer.json"
        Tokenizer.train("bpe", iter([sample]), vocab_size=VOCAB).save(tok_path)
        out = tmp_dir / "out"
        two = measure("lmcli", big, tok_path, out, cores=2)
        one = measure("lmcli", big, tok_path, out, cores=1)
        peer_two = measure("nanogpt", big, tok_path, out, cores=2)
        peer_one = measure("nanogpt", big, tok_path, out, cores=1)
        two_mid = measure("lmcli", mid, tok_path, out, cores=2)
        cache = measure("cache", text, tok_path, out)
        peer = measure("peer", text, tok_path, out)
    peer_scaling = peer_two["mb_per_s"] / peer_one["mb_per_s"]
    return [
        Row(
            f"lmcli tokenize MB/s, {BIG_MB} MB, 2 cores, BPE {VOCAB}",
            "MB/s",
            two["mb_per_s"],
            peer_two["mb_per_s"],
            "nanoGPT prepare.py: tiktoken + datasets.map(num_proc=2)",
            GOAL_SPEED,
            note=f"1 core: lmcli {one['mb_per_s']:.2f} MB/s, nanoGPT-style {peer_one['mb_per_s']:.2f} MB/s; "
            f"tokens {two['tokens']} vs {peer_two['tokens']}",
            extra={"lmcli_2": two, "lmcli_1": one, "nanogpt_2": peer_two, "nanogpt_1": peer_one},
        ),
        Row(
            f"lmcli tokenize scaling, {BIG_MB} MB, 2 cores vs 1",
            "MB/s",
            two["mb_per_s"],
            one["mb_per_s"],
            "lmcli tokenize on 1 core",
            GOAL_SCALING,
            note=f"nanoGPT-style recipe: {peer_scaling:.2f}x from 1 to 2 processes",
        ),
        Row(
            f"tokenize peak RSS, {BIG_MB} MB, 2 cores (lower better)",
            "MB",
            total_rss(two),
            total_rss(peer_two),
            "nanoGPT prepare.py recipe",
            GOAL_MEMORY,
            lower_is_better=True,
            note="main process + workers x the largest worker's peak",
        ),
        Row(
            f"lmcli tokenize peak RSS, {BIG_MB} MB vs {MID_MB} MB",
            "MB",
            total_rss(two),
            total_rss(two_mid),
            f"lmcli on {MID_MB} MB",
            GOAL_FLAT,
            lower_is_better=True,
            note="memory flat in the corpus size if the ratio is ~1",
        ),
        Row(
            f"token cache MB/s, {SMALL_MB} MB, BPE {VOCAB}",
            "MB/s",
            cache["mb_per_s"],
            peer["mb_per_s"],
            "tokenizers encode_batch, all in memory",
            GOAL_SPEED,
            extra={"lmcli": cache, "peer": peer},
        ),
        Row(
            f"token cache peak RSS, {SMALL_MB} MB (lower better)",
            "MB",
            cache["rss_mb"] + cache["child_rss_mb"],
            peer["rss_mb"],
            "tokenizers encode_batch, all in memory",
            GOAL_MEMORY,
            lower_is_better=True,
        ),
    ]


def child_main(kind: str, corpus: str, tokenizer: str, out: str, cores: str) -> None:
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: int(cores)]))
    result = CHILDREN[kind](corpus, tokenizer, out, int(cores))
    result["rss_mb"] = peak_rss_mb()
    result["child_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(*sys.argv[2:7])
    else:
        run_suite("tokenize", run)


if __name__ == "__main__":
    main()
