"""Training windows over a stream in shards: every window once an epoch, none across a shard,
none shared by two ranks; windows at documents' starts; each input's document number."""

from __future__ import annotations

import numpy as np
import pytest

from lmcli.data.stream import Piece, TokenStream
from lmcli.data.windows import WindowSampler, aligned_starts, document_ids, eval_starts


def documents(lengths: list[int], eos: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Documents of these lengths (their <eos> included) end to end: ids and the <eos> positions."""
    rng = np.random.default_rng(seed)
    parts = [np.append(rng.integers(5, 60, n - 1), eos) for n in lengths]
    tokens = np.concatenate(parts).astype(np.uint16)
    return tokens, np.cumsum(lengths, dtype=np.int64) - 1


def test_a_stream_of_one_piece_draws_the_windows_one_array_always_drew() -> None:
    """A cache of one shard trains exactly as the one .bin file did: the same seeded order."""
    tokens = np.arange(1001, dtype=np.uint16)
    plain = WindowSampler(tokens, block_size=10, seed=3)
    shard = WindowSampler(TokenStream.of(tokens, np.array([500, 1000])), block_size=10, seed=3)
    rng = np.random.default_rng([3, 0])  # the order lmcli has always drawn
    order, jitter = rng.permutation(100), rng.integers(0, 10, size=100)
    expected = np.minimum(order * 10 + jitter, 1001 - 1 - 10).tolist()
    assert plain.window_starts(0, 100) == shard.window_starts(0, 100) == expected


def test_windows_over_shards_never_cross_a_shard_and_ranks_never_share_one() -> None:
    pieces = [Piece(np.arange(n, dtype=np.uint16)) for n in (95, 300, 41)]
    stream = TokenStream(pieces)
    sampler = WindowSampler(stream, block_size=10, seed=1)
    assert sampler.epoch_size == 9 + 29 + 4
    epoch = sampler.window_starts(0, sampler.epoch_size)
    for start in epoch:
        piece, offset = stream.locate(start)
        assert offset + 10 + 1 <= len(pieces[piece])  # the window and its targets in one shard
    assert len({stream.locate(s)[0] for s in epoch[:10]}) > 1  # shards mixed, not read in turn
    batch, world = 3, 2  # each rank takes its own slice of every global batch
    slices = [
        sampler.window_starts(step * batch * world + r * batch, batch) for step in range(7) for r in range(2)
    ]
    flat = [s for part in slices for s in part]
    assert len(flat) == len(set(flat)) == 42
    b = sampler.batch(0, 4)
    assert (b.y[:, :-1] == b.x[:, 1:]).all() and b.document is None


def test_aligned_windows_start_at_documents_and_cover_every_token() -> None:
    lengths = [7, 3, 25, 4, 40, 9, 9, 2, 30, 12]  # some longer than the window, some shorter
    tokens, eos = documents(lengths)
    starts = aligned_starts(eos, len(tokens), 16)
    doc_starts = [0, *eos.tolist()]  # a window starts at the <eos> before a document (or at 0)
    assert starts[0] == 0
    for prev, start in zip(starts.tolist(), starts[1:].tolist(), strict=False):
        reached = [b for b in doc_starts if prev < b <= prev + 16]  # document starts the window reached
        assert start == (max(reached) if reached else prev + 16)  # else a long document goes on
    covered = np.zeros(len(tokens), dtype=bool)
    for s in starts:
        covered[s : s + 17] = True
    last_full = starts[-1] + 17
    assert covered[:last_full].all() and len(tokens) - last_full < 16  # every token, but a short tail
    assert len(starts) <= 2 * len(tokens) / 16  # documents re-read where a window cut them, no more
    sampler = WindowSampler(TokenStream.of(tokens, eos), block_size=16, seed=0, align=True)
    assert sorted(sampler.window_starts(0, sampler.epoch_size)) == starts.tolist()


def test_document_numbers_restart_at_each_eos() -> None:
    eos = np.array([4, 9, 30])
    assert document_ids(eos, 3, 8).tolist() == [0, 1, 1, 1, 1, 1, 2, 2]  # the <eos> at 4 starts document 1
    assert document_ids(eos, 4, 4).tolist() == [0, 0, 0, 0]
    tokens, ends = documents([5, 6, 20])
    sampler = WindowSampler(TokenStream.of(tokens, ends), block_size=8, seed=0, documents=True)
    batch = sampler.batch(0, 2)
    assert batch.document.shape == (2, 8) and batch.document.dtype.is_floating_point is False


def test_validation_windows_over_shards_are_fixed_and_within_a_shard() -> None:
    stream = TokenStream([Piece(np.arange(n, dtype=np.uint16)) for n in (55, 1000, 23)])
    starts = eval_starts(stream, 10, 7)
    assert starts == eval_starts(stream, 10, 7) and len(starts) == 7
    for s in starts:
        piece, offset = stream.locate(s)
        assert offset + 11 <= len(stream.pieces[piece])


def test_a_split_stream_keeps_each_documents_end() -> None:
    tokens, eos = documents([5, 6, 20, 9])
    head, tail = TokenStream.of(tokens, eos).split(15)
    assert np.array_equal(np.concatenate([np.array(head), np.array(tail)]), tokens)
    assert head.pieces[0].eos.tolist() == [4, 10] and tail.pieces[0].eos.tolist() == [30 - 15, 39 - 15]


def test_windows_need_document_ends_to_align() -> None:
    with pytest.raises(Exception, match="do not record where their documents end"):
        WindowSampler(np.arange(100, dtype=np.uint16), block_size=8, seed=0, align=True)
