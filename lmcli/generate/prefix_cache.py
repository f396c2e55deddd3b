"""The prefix cache: keys and values of earlier prompts (and finished replies) kept for the
prompts that begin with the same tokens, so only what follows is prefilled.

The cache is a tree of blocks of ``BLOCK`` token ids: a node holds the keys and values of
every layer for its block, ``(2, n_layer, n_kv_head, BLOCK, head_dim)``, computed after the
blocks of its ancestors (so a node stands for the whole prefix from the root to it). A prompt
is matched block by block, as far as the tree goes (its longest cached prefix of whole
blocks, one token at least left to prefill, whose logits start the reply); ``prefill`` copies
the matched keys and values into a new ``KVCache`` and runs the model's cached forward on the
rest (positions continue from the cached length), then adds the prompt's new blocks. A row
that ended (``Engine``) adds its prompt and reply the same way, so the next turn of a
conversation reuses both.

Exactness: a cached prefix's keys and values are those a full prefill computes for its columns
(attention is causal: a column never sees the columns after it), up to float rounding of
the different matrix shapes; the output of a seeded request is the same with and without the
cache (``tests/generate/test_prefix_cache.py``).

Memory: at most ``max_bytes`` of blocks. A new block that would pass it evicts the least
recently used leaves first (a block is used when a prompt matches it or adds to it; the
ancestors of a block are used with it, so a leaf is evicted before its ancestors); a prompt
longer than what fits keeps its first blocks. ``clear`` frees everything. One thread uses it
at a time (the server's decoding thread, or a chat session); ``stats`` may be read from another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmcli.model.kv_cache import GROW, KVCache
from lmcli.model.transformer import Transformer

BLOCK = 16  # tokens per node: the unit of matching and of eviction


@dataclass(eq=False)
class Node:
    """One block of a cached prefix: its tokens, their keys and values, its children."""

    tokens: tuple[int, ...]
    kv: Tensor | None  # (2, n_layer, n_kv_head, BLOCK, head_dim); None at the root
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() if self.kv is not None else 0


class PrefixCache:
    """Keys and values of token prefixes, bounded by ``max_bytes`` (see the module docstring)."""

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        self.max_bytes, self.block = max_bytes, block
        self.root = Node((), None, None)
        self._lru: OrderedDict[Node, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0  # prefills that reused at least one block
        self.misses = 0  # prefills that reused none
        self.cached_tokens = 0  # tokens reused, in all

    # ------------------------------------------------------------------ matching and adding

    def match(self, ids: list[int]) -> list[Tensor]:
        """The keys and values of the blocks of the longest cached prefix of ``ids`` (whole
        blocks), first block first, each ``(2, n_layer, n_kv_head, BLOCK, head_dim)``; the
        blocks count as used."""
        with self._lock:
            path, node = [], self.root
            for b in range(0, len(ids) - self.block + 1, self.block):
                child = node.children.get(tuple(ids[b : b + self.block]))
                if child is None:
                    break
                path.append(child)
                node = child
            self._touch(path)
            return [n.kv for n in path]  # type: ignore[misc]  # a node in the tree holds its block

    def add(self, ids: list[int], k: Tensor, v: Tensor) -> None:
        """Keep the keys and values ``k, v`` (n_layer, n_kv_head, len(ids), head_dim) of ``ids``
        (every whole block; those cached already are kept as they are; no more once the bound
        or the device's memory is reached)."""
        with self._lock:
            path, node = [], self.root
            for b in range(0, len(ids) - self.block + 1, self.block):
                key = tuple(ids[b : b + self.block])
                child = node.children.get(key)
                if child is None:
                    size = 2 * k[:, :, : self.block].numel() * k.element_size()
                    if not self._make_room(size, keep=path):
                        break
                    try:
                        kv = torch.stack([k[:, :, b : b + self.block], v[:, :, b : b + self.block]])
                    except (torch.OutOfMemoryError, MemoryError):  # memory ran out: cache no more
                        break
                    child = Node(key, kv, node)
                    node.children[key] = child
                    self._lru[child] = None
                    self.bytes += size
                path.append(child)
                node = child
            self._touch(path)

    def add_block(self, ids: list[int], k: Tensor, v: Tensor) -> None:
        """Keep the keys and values ``k, v`` (n_layer, n_kv_head, block, head_dim) of the last
        block of ``ids`` (a whole number of blocks) when the blocks before it are cached: a
        decoding row's newest block, while its sliding-window layers' ring still holds it."""
        with self._lock:
            path, node = [], self.root
            for b in range(0, len(ids) - self.block, self.block):
                child = node.children.get(tuple(ids[b : b + self.block]))
                if child is None:
                    return
                path.append(child)
                node = child
            key = tuple(ids[len(ids) - self.block :])
            child = node.children.get(key)
            if child is None:
                size = 2 * k.numel() * k.element_size()
                if not self._make_room(size, keep=path):
                    return
                child = Node(key, torch.stack([k, v]), node)
                node.children[key] = child
                self._lru[child] = None
                self.bytes += size
            self._touch([*path, child])

    def _touch(self, path: list[Node]) -> None:
        """Mark ``path`` used, deepest first: a node is never older than a descendant."""
        for node in reversed(path):
            self._lru.move_to_end(node)

    def _make_room(self, size: int, keep: list[Node]) -> bool:
        """Evict least recently used leaves (not those of ``keep``) until ``size`` more bytes fit."""
        if size > self.max_bytes:
            return False
        kept = set(keep)
        while self.bytes + size > self.max_bytes:
            leaf = next((n for n in self._lru if not n.children and n not in kept), None)
            if leaf is None:
                return False
            self._evict(leaf)
        return True

    def _evict(self, node: Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.tokens]
        del self._lru[node]
        self.bytes -= node.nbytes
        node.kv = None

    def clear(self) -> None:
        """Forget every block: their memory is freed at once (a prefill that matched them
        holds its own references until it ends)."""
        with self._lock:
            for node in list(self._lru):
                node.kv = None
            self.root = Node((), None, None)
            self._lru.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Hits, misses, tokens reused, bytes and blocks held, and the bound."""
        return {
            "prefix_cache_hits": self.hits,
            "prefix_cache_misses": self.misses,
            "prefix_cache_cached_tokens": self.cached_tokens,
            "prefix_cache_bytes": self.bytes,
            "prefix_cache_blocks": len(self._lru),
            "prefix_cache_max_bytes": self.max_bytes,
        }

    # ------------------------------------------------------------------ prefill

    def prefill(self, model: Transformer, ids: list[int]) -> tuple[KVCache, Tensor, int]:
        """``ids`` through a new one-row cache, starting from its longest cached prefix: the
        cache, the next-token logits (1, V), and how many tokens were reused; the prompt's
        blocks are then cached."""
        blocks = self.match(ids[:-1])  # one token at least is prefilled: its logits start the reply
        cache = KVCache.for_model(model, 1)
        cache.reserve(len(ids) + GROW)  # room for the first steps: a lone row's batch keeps it
        for i, kv in enumerate(blocks):
            cols = slice(i * self.block, (i + 1) * self.block)
            cache.k[:, 0, :, cols] = kv[0]
            cache.v[:, 0, :, cols] = kv[1]
        reused = len(blocks) * self.block
        cache.length = reused
        self.hits, self.misses = self.hits + (reused > 0), self.misses + (reused == 0)
        self.cached_tokens += reused
        device = next(model.parameters()).device
        idx = torch.tensor([ids[reused:]], dtype=torch.long, device=device)  # (1, T)
        logits = model(idx, cache, last_only=True)[:, -1].float()
        self.add(ids, cache.k[:, 0, :, : len(ids)], cache.v[:, 0, :, : len(ids)])
        return cache, logits, reused

    def keep_row(self, cache: KVCache, row: int, sequence: list[int]) -> None:
        """Cache row ``row`` of ``cache`` (a decoding batch whose row holds ``sequence`` but its
        last token, which was chosen and not fed): a finished reply with its prompt. A row whose
        context slid (its columns no longer start at position 0) is not cached, nor one whose
        sliding-window layers' ring no longer holds all its columns (``Engine`` cached its
        blocks as they were completed)."""
        start, end = int(cache.padding.start[row]), cache.length
        n = len(sequence) - 1
        if end - start != n or n < self.block:
            return
        if cache.ring is not None and start < end - cache.ring.size:
            return
        k, v = cache.columns(row, start, end)  # (n_layer, KV, n, D)
        self.add(sequence[:n], k, v)
