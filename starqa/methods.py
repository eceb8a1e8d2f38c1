"""Method settings (frozen, recorded in every manifest) and the block plan they imply."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from starqa.errors import StarqaError

METHODS = ("star", "dense", "ring")
MAX_DEFAULT_BLOCK = 32_768  # the paper's fixed block size for very long contexts


@dataclass(frozen=True)
class MethodConfig:
    name: str
    block_size: int
    anchor_size: int  # star only; 0 for dense

    def as_dict(self) -> dict:
        return asdict(self)


def method_config(name: str, n_tokens: int, block_size: int | None = None,
                  anchor_size: int | None = None) -> MethodConfig:
    """Settings for `name` on a context of `n_tokens`, with the papers' defaults.

    star: block = a quarter of the context (capped at 32K), anchor = block.
    dense, ring: exact; blocks only split the cache into shards (one file per block), and
    ring's workers each hold a contiguous group of them.
    """
    if name not in METHODS:
        raise StarqaError(f"Unknown method {name!r}.", hint=f"choose one of: {', '.join(METHODS)}")
    if block_size is not None and block_size < 1:
        raise StarqaError(f"--block-size must be at least 1 (got {block_size}).")
    if anchor_size is not None and anchor_size < 0:
        raise StarqaError(f"--anchor-size must be 0 or more (got {anchor_size}).")
    block = block_size or min(max(1, math.ceil(n_tokens / 4)), MAX_DEFAULT_BLOCK)
    if name in ("dense", "ring"):
        return MethodConfig(name, block, 0)
    return MethodConfig("star", block, block if anchor_size is None else anchor_size)


def plan_blocks(n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) token ranges of `block_size` (the last may be shorter)."""
    return [(s, min(s + block_size, n_tokens)) for s in range(0, n_tokens, block_size)]
