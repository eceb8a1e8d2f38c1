"""The block plan: the context's token ranges, and which worker holds which blocks.

Two plans. `plan_blocks` cuts at fixed token counts (token contexts: `bench`, `eval`).
`plan_file_blocks` follows the files (`ingest`), so that an edit to one file changes only
the blocks that hold it (issue #14): block 0 is the first `block_size` tokens (the star
anchor lives in it, and an edit there changes every block anyway); after it, whole files
are packed up to `block_size`, a file longer than that is cut at fixed offsets from its own
start into blocks of its own, and a block also ends before any file whose path hashes to a
*cut point* (one file in `m`, `m` about the files a block holds), so that a file growing
past its block's room regroups only the files up to the next cut point, never every later
block (greedy packing alone would shift every later boundary).

Where blocks share positions (star and pulsar past the window), `ContextBias` is what
Phase 2 adds to the scores of their keys, and `split_at` cuts a shard's parts where the
bias starts.

Pure Python (no torch), so the launcher and the UI can use it without loading the model.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


def plan_blocks(n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) token ranges of `block_size` (the last may be shorter)."""
    return [(s, min(s + block_size, n_tokens)) for s in range(0, n_tokens, block_size)]


def plan_file_blocks(n_tokens: int, block_size: int, files: Sequence[tuple[str, int, int]]
                     ) -> list[tuple[int, int]]:
    """[start, end) token ranges that follow the files. files: (path, token_start, token_end)
    in context order; the tokens between two files (the separator) go with the first one.
    Every block holds at most `block_size` tokens; blocks cover 0..n_tokens exactly."""
    if n_tokens <= block_size or not files:
        return plan_blocks(n_tokens, block_size)
    head = block_size  # block 0: the anchor's block, at a fixed size
    starts = [head, *(max(s, head) for _, s, _ in files[1:])]  # contiguous from block 0 on
    ends = [*starts[1:], n_tokens]
    every = _cut_every(block_size, [e - s for _, s, e in files])
    blocks: list[tuple[int, int]] = [(0, head)]
    open_start = None  # start of the block being filled with whole files

    def close(at: int) -> None:
        nonlocal open_start
        if open_start is not None and at > open_start:
            blocks.append((open_start, at))
        open_start = None

    for (path, _, _), start, end in zip(files, starts, ends):
        if end <= start:  # wholly inside block 0
            continue
        if end - start > block_size:  # a large file: blocks of its own at fixed offsets
            close(start)
            blocks += [(s, min(s + block_size, end)) for s in range(start, end, block_size)]
            continue
        if open_start is not None and (end - open_start > block_size or _cut_point(path, every)):
            close(start)
        if open_start is None:
            open_start = start
    close(n_tokens)
    return blocks


def _cut_every(block_size: int, sizes: Sequence[int]) -> int:
    """m: about the files a block holds, as a power of two (so that it stays put while
    files change a little)."""
    mean = max(1.0, sum(sizes) / max(len(sizes), 1))
    m = 1
    while m * 2 * mean <= block_size:
        m *= 2
    return m


def _cut_point(path: str, every: int) -> bool:
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") % every == 0


def digest(ids: Sequence[int]) -> str:
    """sha256 hex of token ids (int64, little-endian): what a block address hashes."""
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()


def split_contiguous(n_items: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `n_items` (the first ranks take one extra)."""
    base, extra = divmod(n_items, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def round_robin(n_items: int, world: int, rank: int) -> list[int]:
    """Items of `rank`, round-robin: item i on rank i % world, in round i // world."""
    return list(range(rank, n_items, world))


def split_at(parts: Sequence[tuple], at: int) -> tuple[list[tuple], list[tuple]]:
    """Consecutive parts of keys, each a tuple of arrays [H, T_i, ...] sliced alike (a
    block's keys and values, and their int8 scales: torch tensors, `Int8Rows` or numpy
    arrays), as the parts holding the first `at` keys and the parts holding the rest: the
    part that holds both is cut in two views there, and no part is empty."""
    before, after, start = [], [], 0
    for part in parts:
        n = part[0].shape[1]
        cut = min(max(at - start, 0), n)
        if cut:
            before.append(part if cut == n else tuple(x[:, :cut] for x in part))
        if cut < n:
            after.append(part if cut == 0 else tuple(x[:, cut:] for x in part))
        start += n
    return before, after


def context_bias(n_tokens: int, query_position: int, shared_from: int = 0) -> float:
    """The log-scale Phase 2 adds to the score of every context key at a shared position
    where the blocks share positions (contiguous positions, docs/methods.md §2), else 0:
    log((p − s) / (n − s)) for n keys before the question at position p, the blocks sharing
    positions s..p−1 (s: what lies before them once, the anchor, whose keys keep their
    weight: `ContextBias`).

    There the question meets (n − s)/(p − s) keys at each distance where training put one;
    left alone, the context's attention mass swamps the question's own keys (SmolLM2 at 6K
    in blocks of 512 answers nothing). Scaling the shared keys' mass by (p − s)/(n − s)
    gives each shared position one key's worth again (APE's scaling factor, Yang et al.,
    ICLR 2025, here set by the overlap, not tuned); their weights among themselves are
    unchanged."""
    if not 0 < query_position < n_tokens:
        return 0.0
    shared_from = min(max(shared_from, 0), query_position - 1)
    return math.log((query_position - shared_from) / (n_tokens - shared_from))


@dataclass(frozen=True)
class ContextBias:
    """Phase 2's score bias on a context's keys (`context_bias`): `value` on every key from
    the context's token `shared_from` on, none on the keys before it (star's anchor,
    pulsar's sink: positions the context holds once, as training did, among them the first
    token, the attention sink). 0 where the blocks do not share positions."""

    value: float = 0.0
    shared_from: int = 0

    @classmethod
    def of(cls, n_tokens: int, query_position: int, shared_from: int = 0) -> ContextBias:
        """The bias of n keys before the question at `query_position`, the blocks sharing
        positions from `shared_from` on."""
        value = context_bias(n_tokens, query_position, shared_from)
        return cls(value, min(max(shared_from, 0), query_position - 1) if value else 0)

    def unbiased(self, start: int) -> int:
        """How many of the keys from the context's token `start` on carry no bias: those
        before `shared_from`."""
        return max(self.shared_from - start, 0) if self.value else 0
