"""The block plan: the context's token ranges, and which worker holds which blocks.

Pure Python (no torch), so the launcher and the UI can use it without loading the model.
"""

from __future__ import annotations


def plan_blocks(n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) token ranges of `block_size` (the last may be shorter)."""
    return [(s, min(s + block_size, n_tokens)) for s in range(0, n_tokens, block_size)]


def split_contiguous(n_items: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `n_items` (the first ranks take one extra)."""
    base, extra = divmod(n_items, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def round_robin(n_items: int, world: int, rank: int) -> list[int]:
    """Items of `rank`, round-robin: item i on rank i % world, in round i // world."""
    return list(range(rank, n_items, world))
