"""What tests share: the tiny corpus, one tiny-model builder, one train-config builder, run folders,
the CLI in-process.

Imported as a plain module (``from helpers import ...``) from any test folder: pytest puts tests/ on
sys.path when it loads tests/conftest.py. Models and run folders are built in the test, never
downloaded.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import random
import resource
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lmcli.cli.app import main
from lmcli.config.files import from_dict
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

# The tiny corpus: 2020 characters; a char tokenizer of it has 25 tokens (5 of them special).
TINY_TEXT = (
    "the cat sat on the mat.\nthe dog sat on the log.\n"
    "a bird sang in the tree.\nthe sun rose over the hill.\n"
) * 20

# The shape tiny_model gives unless told otherwise.
TINY_SHAPE = dict(block_size=48, n_layer=2, n_head=2, n_embd=32)

# A one-layer model trained for a few steps: CLI runs that finish in about a second.
# Gemma 3's block (the tests' windowed models add their window, layer pattern and sizes)
GEMMA3_BLOCK = dict(
    position="rope", norm="rmsnorm1p", norm_placement="sandwich", mlp="geglu", bias=False, qk_norm=True
)
FAST_TRAIN_ARGS = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"),
    *("--batch-size", "4", "--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1", "-q"),
]


def tiny_tokenizer(text: str = TINY_TEXT, kind: str = "char", vocab_size: int = 300) -> Tokenizer:
    """A ``kind`` tokenizer trained on ``text`` (``vocab_size`` only matters for bpe)."""
    return Tokenizer.train(kind, iter([text]), vocab_size=vocab_size)


def tiny_model(vocab_size: int | None = None, seed: int | None = 0, **config) -> Transformer:
    """A random Transformer in eval mode: TINY_SHAPE with ``config`` overriding any field.

    ``vocab_size`` defaults to that of ``tiny_tokenizer()``; ``seed`` seeds torch before the
    weights are drawn (None: draw them from torch's global generator as it stands).
    """
    if vocab_size is None:
        vocab_size = tiny_tokenizer().vocab_size
    if seed is not None:
        torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab_size, **{**TINY_SHAPE, **config})).eval()


def train_config(**options: Any) -> TrainConfig:
    """A TrainConfig from flat option names, spelled as flags, TOML keys and ``config.json``
    spell them (``train_config(lr=3e-3, max_steps=40)``): each option goes to its section
    (``cfg.optim.lr``, ``cfg.schedule.max_steps``), so a test never builds the sections itself.
    Checked as any config: a bad value raises the one-line ``LmcliError`` the CLI would print.
    (To change some options of a config: ``lmcli.config.files.replace_options(cfg, max_steps=8)``.)"""
    return from_dict(TrainConfig, options, source="train_config")


def make_run(out: Path, text: str = TINY_TEXT, kind: str = "char", seed: int = 0, **config) -> Path:
    """A run folder (``out/last`` and ``out/best``): a tiny model, context 32 unless told otherwise,
    with a ``kind`` tokenizer of ``text``."""
    tok = tiny_tokenizer(text, kind)
    model = tiny_model(tok.vocab_size, seed, **{"block_size": 32, **config})
    for name in ("last", "best"):
        save_checkpoint(out / name, model, train_config(), tok, meta={"step": 0})
    return out


FLOAT32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: float32's relative rounding step
FLOAT32_MARGIN = 8.0  # how far above the typical rounding error two computations may drift apart


def float32_tolerance(expected: torch.Tensor, cfg: ModelConfig) -> float:
    """The absolute difference two float32 computations of ``cfg``'s forward pass may show
    through rounding alone: ``FLOAT32_MARGIN * sqrt(K) * eps * max|expected|``, with
    ``K = n_layer * max(n_embd, ffn_dim)``.

    A sum of K float32 terms is off by about sqrt(K) * eps * (the size of its terms) when its
    rounding errors have random signs (Higham and Mary, "A new approach to probabilistic
    rounding error analysis", 2019; K * eps in the worst case). A forward pass puts one such
    error per block into the residual stream, each from a sum over at most max(n_embd, ffn_dim)
    terms, and the logits are of the size of ``max|expected|``. The largest difference seen
    (Qwen2 with YaRN against transformers) is about 1.5 * sqrt(K) * eps * max|expected|;
    the margin of 8 leaves room for CPUs that sum in yet another order. On the tiny test models
    this is ~1e-4 on logits of size 7, while a wrong weight, bias, mask or position moves them by
    1e-3 and more (``tests/formats/test_families.py`` keeps a weight 0.1% off failing).
    """
    finite = expected[torch.isfinite(expected)]
    width = max(cfg.n_embd, cfg.ffn_dim)
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return FLOAT32_MARGIN * math.sqrt(cfg.n_layer * width) * FLOAT32_EPS * scale


def assert_float32_close(actual: torch.Tensor, expected: torch.Tensor, cfg: ModelConfig) -> None:
    """``actual`` equals ``expected`` up to ``float32_tolerance``: two float32 computations of
    the same outputs of ``cfg``'s model by different routes (lmcli against transformers or
    llama.cpp's arithmetic, a cached step against the full forward, packed weights against plain
    ones, adapters against merged weights).

    A fixed tolerance does not hold on every CPU: each route adds its numbers in an order of its
    own, and the order depends on the CPU and the BLAS build (AVX2 and AVX-512 kernels split a
    dot product differently); ``atol=1e-5`` failed on an AMD EPYC at 1.2e-5. Comparing in
    float64 instead is no cure here: transformers' RMSNorm and rotary tables compute in float32
    even in a float64 model, and lmcli's CPU decoding paths (packed weights, the one-token step)
    exist in float32 only."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=float32_tolerance(expected, cfg))


def run_cli(argv: list[str], capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """``lmcli ARGV`` in this process, reading ``stdin`` if given: (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def assert_one_line_error(code: int, err: str, message: str) -> None:
    """Exit code 2 and one ``error: ...`` line holding ``message`` (warnings aside), no traceback."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err


def weights(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    """The weights of a run folder's ``which`` checkpoint."""
    return load_file(str(run / which / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def read_metrics(run: Path) -> list[dict]:
    """A run folder's metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- servers in a process


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class CrashAt:
    """A progress reporter that simulates a crash at a given step (after the checkpoint before it),
    or sends this process ``sig`` there."""

    def __init__(self, step: int, sig: int | None = None) -> None:
        self.step, self.sig = step, sig

    def start(self, total, step, max_time=None, shown=()) -> None:
        pass

    def update(self, step: int, record: dict) -> None:
        if step == self.step:
            if self.sig is None:
                raise RuntimeError("simulated crash")
            os.kill(os.getpid(), self.sig)

    def stop(self) -> None:
        pass


class ServedProcess:
    """``lmcli serve RUN ARGS`` in its own process on a free loopback port (``nofile``: its
    open-file limit, as ``ulimit -n``), its stderr in a file; stopped (SIGTERM, then SIGKILL)
    when the block ends."""

    def __init__(self, run: Path, *args: str, nofile: int | None = None, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "lmcli", "serve", str(run), "--port", str(self.port), "--device", "cpu"]

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*cmd, *args], stderr=log, env=env, preexec_fn=limit)

    def __enter__(self) -> ServedProcess:
        import httpx2 as httpx

        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return self
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise AssertionError(f"the server did not start: {self.stderr()[-2000:]}") from None
                time.sleep(0.1)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ----------------------------------------------------------------------------- crafted run folders

MiB = 1 << 20


def rechecksum(file: Path) -> None:
    """Record ``file``'s new sha256 in its checkpoint's meta.json (as whoever edits it can)."""
    meta_path = file.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"][file.name] = hashlib.sha256(file.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))


def craft(run: Path, model: dict | None = None, train: dict | None = None, *, meta: bool = True) -> Path:
    """Change the configs of every checkpoint of ``run`` (and of the run itself); recompute the
    config's checksum in ``meta.json``, or (``meta=False``) delete ``meta.json``."""
    for config in [run / "config.json", *run.glob("*/config.json")]:
        if not config.exists():
            continue
        cfg = json.loads(config.read_text())
        cfg["model"].update(model or {})
        cfg["train"].update(train or {})
        config.write_text(json.dumps(cfg))
        meta_path = config.parent / "meta.json"
        if meta_path.exists() and meta:
            rechecksum(config)
        elif meta_path.exists():
            meta_path.unlink()
    return run


# Runs lmcli commands (or ["load", PATH]: load_checkpoint alone) in one fresh process, each under
# a memory limit, and reports for each the exit code, stderr, seconds, and how far the peak RSS
# (VmHWM, reset between commands) rose above the RSS before the command.
DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, resource, sys, time
    import torch, lmcli.cli.app, lmcli.generate.sampling, lmcli.formats.sources

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    limit = status("VmSize") + 1536 * 2**20  # an allocation of the crafted size fails at once
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if len(sys.argv) > 2:  # a file-size limit: a write past it fails as on a full disk
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
    out = []
    for argv in json.loads(sys.argv[1]):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before, err, start = status("VmRSS"), io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                if argv[0] == "load":  # the loader alone
                    model = lmcli.formats.sources.load_checkpoint(argv[1]).model
                else:
                    lmcli.cli.app.main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code or 0
        seconds = time.perf_counter() - start
        out.append({"code": code, "err": err.getvalue(), "seconds": seconds,
                    "peak": status("VmHWM") - before})
    print(json.dumps(out))
    """
)


def run_measured(commands: list[list[str]], timeout: float = 180, file_size: int | None = None) -> list[dict]:
    """Each lmcli command's exit code, stderr, seconds and peak RSS, all in one fresh process
    (``DRIVER``); ``file_size``: a limit on the size of the files it writes (``ulimit -f``)."""
    limit = [str(file_size)] if file_size is not None else []
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands), *limit],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def saved_step(run: Path) -> int:
    """The step of ``run/last`` now (-1 if none or in the middle of a swap)."""
    try:
        return json.loads((run / "last" / "meta.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def kill_after_checkpoint(process: Any, run: Path, step: int, within_s: float = 60.0) -> None:
    """SIGKILL ``process`` (a multiprocessing Process training into ``run``) at a random moment
    (0-0.1 s) after ``run/last`` reached ``step``, and reap it."""
    deadline = time.time() + within_s
    while saved_step(run) < step:
        assert process.is_alive() and time.time() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.1))
    process.kill()
    process.join(10)


def temps(run: Path) -> list[str]:
    """The temporary folders left in a run folder (a save cut short)."""
    return sorted(p.name for p in run.iterdir() if p.name.endswith(".lmtmp"))


def dequantized_reference(quantized: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``quantized`` holding its dequantized weights as plain modules."""
    from lmcli.model.quant import BlockEmbedding, Int8Embedding, QuantLinear

    ref = copy.deepcopy(quantized)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight.data = child.dequantized()
                if child.bias is not None:
                    linear.bias.data = child.bias.clone()
                setattr(parent, name, linear)
            elif isinstance(child, Int8Embedding):
                table = child.qweight.float() * child.scales[:, None]
                setattr(parent, name, torch.nn.Embedding.from_pretrained(table))
            elif isinstance(child, BlockEmbedding):
                setattr(parent, name, torch.nn.Embedding.from_pretrained(child.table.dequantized()))
    return ref.double()
