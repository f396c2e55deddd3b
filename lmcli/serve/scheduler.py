"""Continuous batching: one thread decodes every active request together, one step at a time.

Each decoding step runs the model once for all rows of one ``BatchCache`` (a row is one choice
of one request). Between steps requests join and leave:

- a request is admitted when rows are free (``max_batch``): each of its prompts is prefilled
  alone (``generate.decoding.prefill``, the model's one cached forward) and its rows enter the
  batch, into rows left free by finished requests when its prompt fits, else appended;
- each row's next token is chosen by ``generate.sampling.sample_next``, rows with the same
  settings in one call, each row drawing from its own ``torch.Generator`` seeded ``seed + j``
  (choice ``j``), exactly as ``lmcli sample`` seeds sample ``j``: batching never changes which
  random numbers a request sees;
- a row that ends (``<eos>``, a stop string, ``max_tokens``), is cancelled (client gone) or times
  out becomes a hole at once: it is never sampled again, its cost is one padded row per step
  until the batch is compacted (when holes outnumber rows in use, or the window is full).

Results go back through each request's ``deliver`` callback, a list of events per step, called
from this thread (the web server hands them to its event loop).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli import fastpath
from lmcli.config import SampleConfig
from lmcli.device import autocast
from lmcli.generate.decoding import prefill, step
from lmcli.generate.sampling import cut_at_stop, sample_next
from lmcli.model import Transformer
from lmcli.serve.batch_cache import BatchCache, empty_cache
from lmcli.tokenizer import Tokenizer


class QueueFull(Exception):
    """Every row is busy and the queue holds ``max_queue`` requests already."""


@dataclass
class Job:
    """What a request asks for: prompts (token ids), settings, and what to return."""

    prompts: list[list[int]]
    cfg: SampleConfig  # max_new_tokens, temperature, top_k/p, min_p, seed, stop, num_samples (n)
    top_logprobs: int | None = None  # None: no log-probs; k: each token's and the k most likely
    timeout: float = 300.0  # seconds from submission

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.cfg.num_samples


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens with their log-probs


@dataclass
class Update:
    """New text of one choice; ``finish_reason`` ("stop" or "length") once it has ended."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Done:
    """The request has ended; token counts for ``usage``."""

    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    """The request could not be completed (``kind``: "timeout", "shutdown" or "internal")."""

    kind: str
    message: str


Event = Update | Done | Failed
Deliver = Callable[[list[Event]], None]


class Handle:
    """A submitted request, as the web side sees it: ``cancel`` it when the client goes."""

    def __init__(self, job: Job, deliver: Deliver, scheduler: Scheduler) -> None:
        self.job, self.deliver, self._scheduler = job, deliver, scheduler
        self.deadline = time.monotonic() + job.timeout
        self.cancelled = False
        self.ended = False
        self.rows_left = job.rows
        self.completion_tokens = 0

    def cancel(self) -> None:
        self._scheduler.cancel(self)


class Row:
    """One choice of one request: its random stream and what it generated so far."""

    def __init__(self, handle: Handle, index: int, generator: torch.Generator | None) -> None:
        self.handle, self.index, self.generator = handle, index, generator
        self.ids: list[int] = []
        self.streamed = ""
        self.next_token = 0  # fed at the next step

    @property
    def key(self) -> tuple[float, int, float, float]:
        cfg = self.handle.job.cfg
        return (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` might begin a stop string (not streamed yet)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)`` (returns freed heap pages to the system), or a no-op."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    return (lambda: trim(0)) if trim is not None else (lambda: None)


class Scheduler:
    """The decoding thread and its batch (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        max_batch: int,
        max_queue: int,
        threads: int | None = None,
        prefix_lm: bool = False,
    ) -> None:
        """``threads``: torch's CPU threads for this thread's work (default: all cores but one,
        which the web server's event loop needs; more threads than free cores slow every step).
        ``prefix_lm``: prompts (translation sources) attend to themselves both ways, as in training."""
        self.model, self.tokenizer, self.prefix_lm = model, tokenizer, prefix_lm
        self.threads = threads or max(1, torch.get_num_threads() - 1)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = next(model.parameters()).device
        self.cache: BatchCache = empty_cache(model)
        self.slots: list[Row | None] = []  # one per cache row; None: a hole
        self.logits: Tensor | None = None  # (rows, V): next-token logits of every row
        self.queue: collections.deque[Handle] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.steps = 0
        self._thread: threading.Thread | None = None
        self._trim = _malloc_trim()

    # ------------------------------------------------------------------ the web side

    def submit(self, job: Job, deliver: Deliver) -> Handle:
        """Queue a request; ``QueueFull`` when ``max_queue`` requests already wait."""
        handle = Handle(job, deliver, self)
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.queue) >= self.max_queue and not self._fits_now(job):
                raise QueueFull(f"{len(self.queue)} requests are waiting already")
            self.queue.append(handle)
            self.cond.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Free the request's rows before the next step (the client is gone)."""
        with self.cond:
            handle.cancelled = True
            if handle in self.queue:
                self.queue.remove(handle)
                handle.ended = True
            self.cond.notify()

    def stats(self) -> dict[str, int]:
        with self.cond:
            return {
                "active_rows": sum(r is not None for r in self.slots),
                "batch_rows": len(self.slots),
                "queued": len(self.queue),
                "steps": self.steps,
                "kv_cache_bytes": self.cache.nbytes(),
            }

    def start(self) -> None:
        """Start the decoding thread, which computes under the caller's autocast (autocast is
        per thread: ``lmcli serve`` starts it inside the command's precision scope)."""
        device = next(self.model.parameters()).device
        amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        self._thread = threading.Thread(target=self._run, args=(amp,), name="lmcli-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with a ``shutdown`` failure."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the decoding thread

    def _fits_now(self, job: Job) -> bool:
        return not self.queue and self._alive() + job.rows <= self.max_batch

    def _alive(self) -> int:
        return sum(r is not None for r in self.slots)

    def _run(self, amp: torch.dtype | None = None) -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # torch's count is per process: restored at the end
        device = next(self.model.parameters()).device
        try:
            with torch.inference_mode(), autocast(device, amp), fastpath.inference(self.model):
                while True:
                    with self.cond:
                        while not self.stopping and not self.queue and not self._alive():
                            self.cond.wait()
                        if self.stopping:
                            break
                    try:
                        self._iteration()
                    except Exception as exc:  # a bug must not take the server down: fail what runs
                        self._fail_all("internal", f"internal error: {type(exc).__name__}: {exc}")
            self._fail_all("shutdown", "the server is shutting down")
        finally:
            torch.set_num_threads(previous)

    def _iteration(self) -> None:
        self._retire()
        self._admit()
        if not self._alive():
            self._reset()
            return
        self._sample()
        if not self._alive():
            self._reset()
            return
        holes = len(self.slots) - self._alive()
        if holes > self._alive() or self.cache.room() == 0:
            self._compact()
        tokens = [r.next_token if r is not None else self.tokenizer.pad_id for r in self.slots]
        with fastpath.step_threads(self.model, len(tokens)):
            self.logits = step(self.model, self.cache, torch.tensor(tokens, device=self.device))
        self.steps += 1

    def _retire(self) -> None:
        """Rows of cancelled or timed-out requests become holes; expired queued requests fail."""
        now = time.monotonic()
        ended: dict[Handle, Failed | None] = {}
        with self.cond:
            for h in list(self.queue):
                if h.deadline < now:
                    self.queue.remove(h)
                    ended[h] = Failed("timeout", f"request timed out after {h.job.timeout:g} s in the queue")
        for i, r in enumerate(self.slots):
            if r is None:
                continue
            h = r.handle
            if h.cancelled:
                ended.setdefault(h, None)
            elif h.deadline < now:
                ended.setdefault(h, Failed("timeout", f"request timed out after {h.job.timeout:g} s"))
            else:
                continue
            self.slots[i] = None
        for h, failure in ended.items():
            h.ended = True
            if failure is not None:
                self._send(h, [failure])

    def _admit(self) -> None:
        """Prefill the requests at the head of the queue that fit, and put their rows in."""
        joining: list[tuple[Handle, list]] = []
        free = self.max_batch - self._alive()
        with self.cond:
            while self.queue and self.queue[0].job.rows <= free:
                h = self.queue.popleft()
                free -= h.job.rows
                joining.append((h, []))
        if not joining:
            return
        pad = self.tokenizer.pad_id
        for h, prefilled in joining:
            for ids in h.job.prompts:
                cache, logits = prefill(self.model, [ids], pad, prefix_lm=self.prefix_lm)
                prefilled.append((cache, logits))
        holes = [i for i, r in enumerate(self.slots) if r is None]
        needed = sum(h.job.rows for h, _ in joining)
        fits = all(c.length <= self.cache.length for _, pre in joining for c, _ in pre)
        if fits and needed <= len(holes):  # into the holes, in place
            for h, pre in joining:
                for p, (cache, logits) in enumerate(pre):
                    for j in range(h.job.cfg.num_samples):
                        i = holes.pop(0)
                        self.cache.fill(i, cache)
                        self.logits[i] = logits[0]
                        self.slots[i] = self._row(h, p, j)
            return
        keep = [i for i, r in enumerate(self.slots) if r is not None]
        parts = [] if not keep or self.logits is None else [self.logits[keep]]
        rows = [self.slots[i] for i in keep]
        join = []
        for h, pre in joining:
            n = h.job.cfg.num_samples
            for p, (cache, logits) in enumerate(pre):
                join.append((cache, n))
                parts.append(logits.expand(n, -1))
                rows += [self._row(h, p, j) for j in range(n)]
        self.cache.relayout(keep, join)
        self.logits = torch.cat(parts)
        self.slots = rows

    def _row(self, h: Handle, prompt: int, j: int) -> Row:
        cfg = h.job.cfg
        gen = None
        if cfg.temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(cfg.seed + j)
        return Row(h, prompt * cfg.num_samples + j, gen)

    def _sample(self) -> None:
        """Choose every live row's next token, group by group, and hand out the new text."""
        assert self.logits is not None
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.slots):
            if r is not None:
                groups.setdefault(r.key, []).append(i)
        out: dict[Handle, list[Event]] = {}
        for (temperature, top_k, top_p, min_p), idx in groups.items():
            logits = self.logits[idx]  # (G, V)
            rows = [self.slots[i] for i in idx]
            gens = [r.generator for r in rows] if temperature > 0 else None
            tokens, logprobs = sample_next(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generators=gens
            )
            k = max((r.handle.job.top_logprobs or 0) for r in rows)
            top = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1) if k else None
            for g, (i, r, tok, lp) in enumerate(
                zip(idx, rows, tokens.tolist(), logprobs.tolist(), strict=True)
            ):
                tops: list[tuple[int, float]] = []
                if top is not None and r.handle.job.top_logprobs:
                    kk = r.handle.job.top_logprobs
                    tops = list(zip(top.indices[g, :kk].tolist(), top.values[g, :kk].tolist(), strict=True))
                update = self._accept(r, tok, lp, tops)
                if update is not None:
                    out.setdefault(r.handle, []).append(update)
                if update is not None and update.finish_reason is not None:
                    self.slots[i] = None
                    r.handle.rows_left -= 1
        for h, events in out.items():
            if h.rows_left == 0:
                h.ended = True
                events.append(Done(sum(len(p) for p in h.job.prompts), h.completion_tokens))
            self._send(h, events)

    def _accept(self, r: Row, tok: int, lp: float, tops: list[tuple[int, float]]) -> Update | None:
        """Record one token of row ``r``; the text it adds (held back while it may start a stop
        string), and the finish reason once the row ends. Mirrors ``lmcli sample``'s rules."""
        cfg = r.handle.job.cfg
        r.handle.completion_tokens += 1
        r.next_token = tok
        want = r.handle.job.top_logprobs is not None
        if tok == self.tokenizer.eos_id:
            return self._finish(r, self.tokenizer.decode(r.ids), "stop", [])
        r.ids.append(tok)
        entry = [TokenLogprob(tok, lp, tops)] if want else []
        text = self.tokenizer.decode(r.ids)
        cut = cut_at_stop(text, cfg.stop)
        if cut is not None:
            return self._finish(r, cut, "stop", entry)
        if len(r.ids) >= cfg.max_new_tokens:
            return self._finish(r, text, "length", entry)
        safe = text[: len(text) - held_back(text, cfg.stop)] if cfg.stop else text
        if safe.endswith("\ufffd") or len(safe) <= len(r.streamed):
            return Update(r.index, "", entry) if entry else None
        piece, r.streamed = safe[len(r.streamed) :], safe
        return Update(r.index, piece, entry)

    def _finish(self, r: Row, text: str, reason: str, entry: list[TokenLogprob]) -> Update:
        piece = text[len(r.streamed) :] if len(text) > len(r.streamed) else ""
        r.streamed = text
        return Update(r.index, piece, entry, reason)

    def _compact(self) -> None:
        """Drop the holes (and shift the rows left as far as they allow)."""
        keep = [i for i, r in enumerate(self.slots) if r is not None]
        self.cache.relayout(keep, [])
        assert self.logits is not None
        self.logits = self.logits[keep]
        self.slots = [self.slots[i] for i in keep]

    def _reset(self) -> None:
        """No row in use: free the batch's memory."""
        if self.slots or self.cache.batch_size:
            self.cache = empty_cache(self.model)
            self.slots, self.logits = [], None
            self._trim()

    def _fail_all(self, kind: str, message: str) -> None:
        with self.cond:
            handles = list(self.queue)
            self.queue.clear()
        handles += [r.handle for r in self.slots if r is not None and r.handle not in handles]
        for h in dict.fromkeys(handles):
            h.ended = True
            self._send(h, [Failed(kind, message)])
        self.cache = empty_cache(self.model)
        self.slots, self.logits = [], None

    @staticmethod
    def _send(h: Handle, events: list[Event]) -> None:
        if h.cancelled:
            return
        try:
            h.deliver(events)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass
