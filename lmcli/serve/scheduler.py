"""Continuous batching: one thread decodes every active request together, one step at a time.

The decoding itself is the row engine's (``generate.engine``), the one ``lmcli sample`` and
``lmcli chat`` use: each row (one choice of one request) follows every rule of its request's
``SampleConfig`` (temperature, top-k/p, min-p, repetition penalty, min/max new tokens, stop
strings, ``<eos>``) and draws from its own ``torch.Generator`` seeded ``seed + j`` (choice
``j``), exactly as ``lmcli sample`` seeds sample ``j``: batching never changes which random
numbers a request sees. The scheduler keeps what a server adds:

- admission: a request is admitted when rows are free (``max_batch``): each of its prompts is
  prefilled alone (``Engine.prefill``; with a prefix cache, from its longest cached prefix, and
  requests admitted together that share a prefix compute it once) and its rows enter the batch,
  into rows left free by finished requests when its prompt fits (``Engine.fill``), else appended
  (``Engine.relayout``);
- the batch's layout: a row that ends, is cancelled (client gone) or times out becomes a hole
  at once: it is never sampled again, its cost is one padded row per step until the batch is
  compacted (when holes outnumber rows in use, or the window is full);
- limits: the queue (``max_queue``), each request's deadline, cancellation;
- delivery: each request's ``deliver`` callback gets a list of events per step, called from
  this thread (the web server hands them to its event loop).
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

from lmcli.config.commands import SampleConfig
from lmcli.device import autocast
from lmcli.generate.engine import Emitted, Engine, Row, RowProcessor
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer
from lmcli.serve.batch_cache import empty_cache
from lmcli.text.tokenizer import Tokenizer


class QueueFull(Exception):
    """Every row is busy and the queue holds ``max_queue`` requests already."""


@dataclass
class Job:
    """What a request asks for: prompts (token ids), settings, and what to return."""

    prompts: list[list[int]]
    cfg: SampleConfig  # every rule of lmcli sample, and num_samples (n)
    top_logprobs: int | None = None  # None: no log-probs; k: each token's and the k most likely
    timeout: float = 300.0  # seconds from submission
    processors: Callable[[], tuple[RowProcessor, ...]] = tuple  # each row's own (e.g. a grammar)

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
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


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
        self.cached_tokens = 0

    def cancel(self) -> None:
        self._scheduler.cancel(self)


class Choice(Row):
    """One choice of one request: an engine row that knows its request and its index."""

    def __init__(self, handle: Handle, prompt: int, j: int) -> None:
        job = handle.job
        super().__init__(
            job.cfg, job.prompts[prompt], j, top_logprobs=job.top_logprobs or 0, processors=job.processors()
        )
        self.handle, self.index = handle, prompt * job.cfg.num_samples + j


def malloc_trim() -> Callable[[], None]:
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
        prefixes: PrefixCache | None = None,
    ) -> None:
        """``threads``: torch's CPU threads for this thread's work (default: all cores but one,
        which the web server's event loop needs; more threads than free cores slow every step).
        ``prefix_lm``: prompts (translation sources) attend to themselves both ways, as in
        training (the model's task says: ``tasks.Task.prefix_lm``). ``prefixes``: the prefix cache
        (none: every prompt is prefilled whole)."""
        self.model, self.tokenizer = model, tokenizer
        self.threads = threads or max(1, torch.get_num_threads() - 1)
        self.max_batch, self.max_queue = max_batch, max_queue
        # isolate: a failure in one row's rules fails its request, not the others in the batch
        self.engine = Engine(
            model, tokenizer, prefix_lm=prefix_lm, cache=empty_cache(model), isolate=True, prefixes=prefixes
        )
        self.prefixes = self.engine.prefixes
        self.queue: collections.deque[Handle] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self._thread: threading.Thread | None = None
        self._trim = malloc_trim()

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
            cache = self.engine.cache
            return {
                "active_rows": self._alive(),
                "batch_rows": len(self.engine.rows),
                "queued": len(self.queue),
                "steps": self.engine.steps,
                "kv_cache_bytes": cache.nbytes() if cache is not None else 0,  # a BatchCache
                **(self.prefixes.stats() if self.prefixes is not None else {}),
            }

    def clear_prefixes(self) -> None:
        """Empty the prefix cache and give its memory back to the system."""
        if self.prefixes is not None:
            self.prefixes.clear()
            self._trim()

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
        return sum(r is not None for r in self.engine.rows)

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
        alive = self._alive()
        if not alive:
            self._reset()
            return
        holes = len(self.engine.rows) - alive
        if holes > alive or self.engine.cache.room() == 0:
            self._compact()
        with fastpath.step_threads(self.model, len(self.engine.rows)):
            self.engine.advance(self._deliver)  # delivered before the model's step
        if not self._alive():
            self._reset()

    def _retire(self) -> None:
        """Rows of cancelled or timed-out requests become holes; expired queued requests fail."""
        now = time.monotonic()
        ended: dict[Handle, Failed | None] = {}
        with self.cond:
            for h in list(self.queue):
                if h.deadline < now:
                    self.queue.remove(h)
                    ended[h] = Failed("timeout", f"request timed out after {h.job.timeout:g} s in the queue")
        for i, r in enumerate(self.engine.rows):
            if r is None:
                continue
            h = r.handle
            if h.cancelled:
                ended.setdefault(h, None)
            elif h.deadline < now:
                ended.setdefault(h, Failed("timeout", f"request timed out after {h.job.timeout:g} s"))
            else:
                continue
            self.engine.drop(i)
        for h, failure in ended.items():
            h.ended = True
            if failure is not None:
                self._send(h, [failure])

    def _admit(self) -> None:
        """Prefill the requests at the head of the queue that fit, and put their rows in."""
        joining: list[Handle] = []
        free = self.max_batch - self._alive()
        with self.cond:
            while self.queue and self.queue[0].job.rows <= free:
                h = self.queue.popleft()
                free -= h.job.rows
                joining.append(h)
        if not joining:
            return
        engine = self.engine
        prefilled = []  # (cache, logits, rows) of every prompt, each prefilled alone
        for h in joining:
            try:
                mine = []
                for p, ids in enumerate(h.job.prompts):
                    cache, logits, cached = self._prefill(ids)
                    h.cached_tokens += cached
                    mine.append((cache, logits, [Choice(h, p, j) for j in range(h.job.cfg.num_samples)]))
                prefilled += mine
            except Exception as exc:  # this request's prompt fails, not the batch
                h.ended = True
                self._send(h, [Failed("internal", f"internal error: {type(exc).__name__}: {exc}")])
        if not prefilled:
            return
        holes = [i for i, r in enumerate(engine.rows) if r is None]
        needed = sum(len(rows) for _, _, rows in prefilled)
        assert engine.cache is not None
        if needed <= len(holes) and all(c.length <= engine.cache.length for c, _, _ in prefilled):
            for cache, logits, rows in prefilled:  # into the holes, in place
                for row in rows:
                    engine.fill(holes.pop(0), row, cache, logits)
            return
        engine.relayout([i for i, r in enumerate(engine.rows) if r is not None], prefilled)

    def _prefill(self, ids: list[int]) -> tuple[KVCache, torch.Tensor, int]:
        """``Engine.prefill`` of one prompt; out of memory with a prefix cache that holds
        blocks, the cache is emptied (memory pressure evicts it) and the prompt tried again."""
        try:
            return self.engine.prefill([ids])
        except (torch.OutOfMemoryError, MemoryError):
            if self.prefixes is None or not self.prefixes.bytes:
                raise
        self.clear_prefixes()
        return self.engine.prefill([ids])

    def _deliver(self, emitted: list[Emitted]) -> None:
        """Each request's events of this step: its choices' new text (and log-probs), the end of
        a choice (whose row becomes a hole), and ``Done`` once every choice has ended."""
        out: dict[Handle, list[Event]] = {}
        for e in emitted:
            row: Choice = e.row  # the scheduler's rows are its choices
            h = row.handle
            if h.ended:  # failed at this step already
                continue
            if e.finish_reason == "error":  # its own failure (the engine isolates it): its request ends
                self._end_failed(h, f"internal error: {row.text}")
                out.pop(h, None)
                continue
            h.completion_tokens += 1
            entry = []
            if h.job.top_logprobs is not None and e.finish_reason != "eos":  # <eos> is no text
                entry = [TokenLogprob(e.token, e.logprob, e.top)]
            if e.finish_reason is not None:
                self.engine.drop(e.position)
                h.rows_left -= 1
                reason = "length" if e.finish_reason == "length" else "stop"  # <eos> too, as OpenAI
                out.setdefault(h, []).append(Update(row.index, e.text, entry, reason))
            elif e.text or entry:
                out.setdefault(h, []).append(Update(row.index, e.text, entry))
        for h, events in out.items():
            if h.rows_left == 0:
                h.ended = True
                events.append(Done(sum(len(p) for p in h.job.prompts), h.completion_tokens, h.cached_tokens))
            self._send(h, events)

    def _end_failed(self, h: Handle, message: str) -> None:
        """Request ``h`` failed alone: its rows become holes, it gets its error."""
        for i, r in enumerate(self.engine.rows):
            if r is not None and r.handle is h:
                self.engine.drop(i)
        h.ended = True
        self._send(h, [Failed("internal", message)])

    def _compact(self) -> None:
        """Drop the holes (and shift the rows left as far as they allow)."""
        self.engine.relayout([i for i, r in enumerate(self.engine.rows) if r is not None], [])

    def _reset(self) -> None:
        """No row in use: free the batch's memory."""
        if self.engine.rows or self.engine.cache.batch_size:
            self.engine.reset(empty_cache(self.model))
            self._trim()

    def _fail_all(self, kind: str, message: str) -> None:
        with self.cond:
            handles = list(self.queue)
            self.queue.clear()
        handles += [r.handle for r in self.engine.rows if r is not None and r.handle not in handles]
        for h in dict.fromkeys(handles):
            h.ended = True
            self._send(h, [Failed(kind, message)])
        self.engine.reset(empty_cache(self.model))

    @staticmethod
    def _send(h: Handle, events: list[Event]) -> None:
        if h.cancelled:
            return
        try:
            h.deliver(events)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass
