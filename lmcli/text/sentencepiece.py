"""A SentencePiece-style vocabulary held compactly: GGUF's ``llama`` tokenizer model as
``lmcli.formats.gguf.spm`` reads it, with the part of a ``tokenizers.Tokenizer``'s interface that
lmcli calls (``encode``, ``encode_batch``, ``decode``, ``token_to_id``, ``id_to_token``,
``get_vocab``, ``get_vocab_size``, ``get_added_tokens_decoder``, ``encode_special_tokens``;
``to_str`` and ``save`` through the full ``tokenizers`` object, built when first asked for).

Why: ``tokenizers`` holds a vocabulary as two hash maps of strings (text -> id, id -> text) and
the merges as a third (every split of every token into two tokens: ~2 a token), each at a
power-of-two capacity: 75 MB for Gemma 3's 262,144 tokens, 30% of its 253 MB Q4_K_M file. Here
the texts are one string and their offsets, each token has its rank and a slot in one table of
ids: ~8 MB. The merges are never stored: two neighbouring pieces merge when their joined text is
a token.

Encoding is the ``tokenizers`` object's, step for step (``formats.gguf.spm`` builds it: a BPE with
byte fallback whose merges are every split of every token, ranked by ``spm_merges``):

- the added tokens (control, unknown, user-defined) are found in the text, leftmost and longest
  first; a control or unknown one stays text while ``encode_special_tokens`` is set (lmcli's
  prompts), a user-defined one is always cut out;
- each piece between them gets ``▁`` in front (``add_space_prefix``) and its spaces become ``▁``;
- its characters are its first pieces, a character no token spells is its UTF-8 bytes
  (``<0xNN>``), or the unknown token (consecutive ones fused), or nothing without one;
- two neighbours whose joined text is a token merge, the pair of lowest rank first: the joined
  token's rank (by score, highest first; ties by id), then the left part's length (in bytes: the
  order of its characters' count); a tie at that
  rank goes to the leftmost pair.

Decoding: ``▁`` becomes a space, runs of ``<0xNN>`` tokens their bytes (one U+FFFD a byte where
they are not UTF-8), one leading space dropped with ``add_space_prefix``; special tokens are
left out when asked.
"""

from __future__ import annotations

import functools
import heapq
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPACE = "\u2581"
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # gguf.TokenType
_HEX = "0123456789abcdefABCDEF"


@dataclass
class Encoded:
    """One text's tokens: ids and each token's (start, end) characters in the text."""

    ids: list[int]
    offsets: list[tuple[int, int]]


def _byte_of(token: str) -> int | None:
    """The byte a ``<0xNN>`` token stands for (as ``tokenizers``' ByteFallback reads it), else None."""
    if len(token.encode()) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    digits = token[3:5]
    if digits[0] == "+":
        digits = digits[1:]
    return int(digits, 16) if digits and all(c in _HEX for c in digits) else None


class SentencePiece:
    """A SentencePiece-style vocabulary (see the module doc) behind ``tokenizers``' interface.

    ``tokens``, ``ranks`` and ``types`` by id: every token's text (unique texts: a repeated
    text's later ids spell nothing, as in ``tokenizers``), its rank among the merges' joined
    tokens, its GGUF type. ``full(self)`` builds the equivalent ``tokenizers`` object."""

    def __init__(
        self,
        tokens: list[str],
        ranks: list[int],
        types: list[int],
        add_space_prefix: bool,
        full: Callable[[SentencePiece], Any],
    ) -> None:
        encoded = [t.encode("utf-8", "surrogatepass") for t in tokens]
        self.text = b"".join(encoded)  # UTF-8: a third of a str's 4 bytes a character (emoji, CJK)
        self.starts = array("I", [0])
        for t in encoded:
            self.starts.append(self.starts[-1] + len(t))
        del encoded
        self.ranks = array("I", ranks)
        self.types = bytes(min(max(k, 0), 255) for k in types)
        self.add_space_prefix = add_space_prefix
        self.encode_special_tokens = False
        self._full, self._full_tokenizer = full, None
        self.first = bytearray(len(tokens))  # 1: the first id of its text (the one it encodes to)
        self._place(range(len(tokens)))
        kinds = (CONTROL, UNKNOWN, USER_DEFINED)
        self.added = {
            t: i
            for i, (t, k) in enumerate(zip(tokens, types, strict=True))
            if k in kinds and self.first[i] and t
        }
        self.special = {t for t, i in self.added.items() if types[i] != USER_DEFINED}
        unk = next((t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
        self.unk = None if unk is None else self.find(unk)
        self.byte_ids = [self.find(f"<0x{b:02X}>") for b in range(256)]  # byte fallback's tokens
        # the added tokens by their first character, longest first (leftmost-longest matching)
        self.by_first: dict[str, list[str]] = {}
        for t in sorted(self.added, key=len, reverse=True):
            self.by_first.setdefault(t[0], []).append(t)
        self.starters = (
            re.compile("[" + "".join(map(re.escape, self.by_first)) + "]") if self.by_first else None
        )

    def _place(self, ids: range | list[int]) -> None:
        """The table of ids, each of ``ids`` put at its text's hash unless its text is there
        (then it is not its text's first id). Python's string hash differs from process to
        process: a copy in another process builds its own (``__setstate__``)."""
        size = 1 << max(4, (2 * len(self.first) - 1).bit_length())
        self.table = array("i", [-1]) * size  # open addressing: a unique text's first id at hash(text)
        mask = size - 1
        for i in ids:
            t = self.raw(i)
            if self._lookup(t) < 0:
                h = hash(t)
                while self.table[h & mask] >= 0:
                    h += 1
                self.table[h & mask], self.first[i] = i, 1
        self.size = sum(self.first)  # the unique texts: the vocabulary's size as tokenizers counts it

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("table", "_full_tokenizer")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _full_tokenizer=None)
        self._place([i for i in range(len(self.first)) if self.first[i]])

    # ------------------------------------------------------------------ lookups

    def _lookup(self, text: bytes) -> int:
        """The first id of the token whose UTF-8 is ``text``, or -1."""
        table, starts, mask, h = self.table, self.starts, len(self.table) - 1, hash(text)
        while (i := table[h & mask]) >= 0:
            a = starts[i]
            if starts[i + 1] - a == len(text) and self.text.startswith(text, a):
                return i
            h += 1
        return -1

    def find(self, text: str) -> int:
        """The id of ``text`` (its first), or -1."""
        return self._lookup(text.encode("utf-8", "surrogatepass"))

    def raw(self, i: int) -> bytes:
        """Token ``i``'s text, UTF-8."""
        return self.text[self.starts[i] : self.starts[i + 1]]

    def piece(self, i: int) -> str:
        """Token ``i``'s text."""
        return self.raw(i).decode("utf-8", "surrogatepass")

    def token_to_id(self, text: str) -> int | None:
        i = self.find(text)
        return None if i < 0 else i

    def id_to_token(self, i: int) -> str | None:
        return self.piece(i) if 0 <= i < len(self.first) and self.first[i] else None

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {self.piece(i): i for i in range(len(self.first)) if self.first[i]}

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.size

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        from tokenizers import AddedToken

        return {i: AddedToken(t, special=t in self.special, normalized=False) for t, i in self.added.items()}

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the longest token."""
        return max((len(self.piece(i)) for i in range(len(self.first)) if self.first[i]), default=1)

    # ------------------------------------------------------------------ encoding

    def _splits(self, text: str) -> list[tuple[int, int, int | None]]:
        """``text`` as (start, end, added token id or None) pieces, the added tokens found leftmost
        and longest first; a special one stays text while ``encode_special_tokens`` is set."""
        out: list[tuple[int, int, int | None]] = []
        done = pos = 0
        while self.starters is not None and (found := self.starters.search(text, pos)) is not None:
            at = found.start()
            match = next((t for t in self.by_first[text[at]] if text.startswith(t, at)), None)
            if match is None:
                pos = at + 1
                continue
            pos = at + len(match)
            if self.encode_special_tokens and match in self.special:
                continue
            if at > done:
                out.append((done, at, None))
            out.append((at, pos, self.added[match]))
            done = pos
        if done < len(text):
            out.append((done, len(text), None))
        return out

    def _symbols(self, word: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The first pieces of a normalized word: ids and (start, end) characters in it."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        fused: tuple[int, int] | None = None  # a run of unknown characters, one unknown token
        for j, c in enumerate(word):
            i = self._lookup(c.encode("utf-8", "surrogatepass"))
            byte_ids = [] if i >= 0 else [self.byte_ids[b] for b in c.encode("utf-8", "surrogatepass")]
            if i < 0 and byte_ids and min(byte_ids) >= 0:
                i = -2
            if i == -1:
                if self.unk is not None:
                    fused = (fused[0], j + 1) if fused is not None else (j, j + 1)
                continue
            if fused is not None:
                ids.append(self.unk)  # type: ignore[arg-type]
                spans.append(fused)
                fused = None
            if i >= 0:
                ids.append(i)
                spans.append((j, j + 1))
            else:
                ids += byte_ids
                spans += [(j, j + 1)] * len(byte_ids)
        if fused is not None:
            ids.append(self.unk)  # type: ignore[arg-type]
            spans.append(fused)
        return ids, spans

    def _merge(self, ids: list[int], spans: list[tuple[int, int]]) -> None:
        """Merge neighbours in place (see the module doc); merged-away entries become -1."""
        n = len(ids)
        nxt = [*range(1, n), -1]
        prev = [-1, *range(n - 1)]
        texts = [self.raw(i) for i in ids]  # each piece's text as it grows
        heap: list[tuple[int, int, int, int]] = []
        lookup, ranks, push = self._lookup, self.ranks, heapq.heappush

        for a in range(n - 1):
            t = lookup(texts[a] + texts[a + 1])
            if t >= 0:
                heap.append((ranks[t], len(texts[a]), a, t))
        heapq.heapify(heap)
        while heap:
            _, _, a, t = heapq.heappop(heap)
            b = nxt[a]
            if ids[a] < 0 or b < 0:
                continue  # merged away since
            joined = texts[a] + texts[b]
            if lookup(joined) != t:
                continue  # no longer the pair it was
            ids[a], ids[b], texts[a] = t, -1, joined
            spans[a] = (spans[a][0], spans[b][1])
            c = nxt[a] = nxt[b]
            if c >= 0:
                prev[c] = a
                u = lookup(joined + texts[c])
                if u >= 0:
                    push(heap, (ranks[u], len(joined), a, u))
            if (p := prev[a]) >= 0:
                u = lookup(texts[p] + joined)
                if u >= 0:
                    push(heap, (ranks[u], len(texts[p]), p, u))

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoded:
        """``text``'s tokens (``add_special_tokens`` adds nothing: there is no template)."""
        if not isinstance(text, str):
            raise TypeError("TextInputSequence must be str")
        out = Encoded([], [])
        for start, end, added in self._splits(text):
            if added is not None:
                out.ids.append(added)
                out.offsets.append((start, end))
                continue
            piece = text[start:end]
            shift = 1 if self.add_space_prefix and piece else 0
            word = SPACE * shift + piece.replace(" ", SPACE)
            ids, spans = self._symbols(word)
            self._merge(ids, spans)
            for i, (a, b) in zip(ids, spans, strict=True):
                if i >= 0:  # (the prepended ▁ stands where the piece's first character does)
                    out.ids.append(i)
                    out.offsets.append((start + max(a - shift, 0), start + max(b - shift, 1)))
        return out

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[Encoded]:
        return [self.encode(t) for t in texts]

    # ------------------------------------------------------------------ decoding

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()  # a run of <0xNN> tokens

        def flush() -> None:
            if pending:
                try:
                    parts.append(pending.decode("utf-8"))
                except UnicodeDecodeError:
                    parts.append("\ufffd" * len(pending))
                pending.clear()

        for i in ids:
            token = self.id_to_token(i)
            if token is None or (skip_special_tokens and token in self.special):
                continue
            token = token.replace(SPACE, " ")
            byte = _byte_of(token)
            if byte is None:
                flush()
                parts.append(token)
            else:
                pending.append(byte)
        flush()
        text = "".join(parts)
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    # ------------------------------------------------------------------ the full tokenizer

    def full(self) -> Any:
        """The equivalent ``tokenizers.Tokenizer`` (built once, when first asked for: its merges
        and maps take ~10x this object's memory)."""
        if self._full_tokenizer is None:
            self._full_tokenizer = self._full(self)
            self._full_tokenizer.encode_special_tokens = self.encode_special_tokens
        return self._full_tokenizer

    def to_str(self, pretty: bool = False) -> str:
        return self.full().to_str(pretty)

    def save(self, path: str, pretty: bool = True) -> None:
        self.full().save(path, pretty)

    def copy(self) -> SentencePiece:
        """A copy sharing every table (its own ``encode_special_tokens``)."""
        out = object.__new__(SentencePiece)
        out.__dict__.update(self.__dict__)
        out._full_tokenizer = None
        return out

    def tokens(self) -> list[str]:
        """Every token's text, by id."""
        return [self.piece(i) for i in range(len(self.first))]
