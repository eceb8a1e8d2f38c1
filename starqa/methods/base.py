"""`Method`: everything the rest of starqa may ask of a Phase 1 method, with the defaults
most methods share. One subclass per method (star.py, exact.py, pulsar.py, apb.py); the
registry (`starqa.methods`) holds one instance of each.

The attention math lives in the modules named in each subclass (starqa.phase1, .ring,
.pulsar, .apb) and is imported inside the methods that run it, so importing the registry
loads no torch. Phase 2 is the same for every method (docs/methods.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from starqa.methods.blocks import split_contiguous
from starqa.methods.config import MethodConfig

Blocks = Sequence[tuple[int, int]]
# (index, k, v) per block, k and v [L, Hkv, T, D] with RoPE applied at the block's positions
Encoded = Iterator[tuple[int, Any, Any]]


class Method:
    """One Phase 1 method. Class attributes describe it; methods compute what depends on it."""

    name: str = ""  # --method's value, recorded in every manifest
    help: str = ""  # one line for --method's help
    # The method-specific settings it owns: keys of method_config's `params`, and "anchor"
    # for --anchor-size. Giving one to a method that does not own it is an error.
    settings: tuple[str, ...] = ()
    exact: bool = False  # its blocks equal dense's (up to rounding)
    sequential: bool = False  # every block on one worker, in order

    # ------------------------------------------------------------------- settings

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        """The settings for blocks of `block_size`, with the papers' defaults for what was
        not given (None). `params` holds only settings this method owns."""
        return MethodConfig(self.name, block_size, 0)

    # ------------------------------------------------------------------- launcher side

    def assignment(self, n_blocks: int, world: int, rank: int) -> list[int]:
        """The blocks worker `rank` of `world` encodes, in the order it encodes them. By
        default a contiguous group: what Phase 2 loads, so shards stay where they were made."""
        return list(split_contiguous(n_blocks, world, rank))

    def max_workers(self, n_blocks: int) -> int:
        """The most Phase 1 workers it can use: one per block, or one when sequential."""
        return 1 if self.sequential else n_blocks

    def prepare(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks) -> dict:
        """What the launcher computes once, before the workers start, for every worker and
        for `query_position`: JSON-able (it travels in the job). Nothing by default."""
        return {}

    def query_position(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks,
                       prepared: dict | None = None) -> int:
        """Where Phase 2's positions start: right after the context by default."""
        return len(ids)

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """The blocks whose stored KV is stale once the tokens of block `edited` change,
        every block keeping its token range (an edit that moves later tokens changes their
        positions, so every later block goes too). By default `edited` and every later
        block: their KV depends on everything before them."""
        return list(range(edited, len(blocks)))

    # ------------------------------------------------------------------- worker side

    def encode(self, model, ids, config: MethodConfig, blocks: Blocks, indices: Sequence[int],
               info, prepared: dict | None = None) -> Encoded:
        """This worker's blocks `indices` (from `assignment`): yields (index, k, v) per block.
        ids: [n] int64 token ids; info: starqa.dist.DistInfo; prepared: `prepare`'s result
        (None: compute it here). Every worker of the group calls it together."""
        raise NotImplementedError

    def encode_local(self, model, ids, config: MethodConfig, blocks: Blocks,
                     prepared: dict | None = None) -> Encoded:
        """Phase 1 for every block in this one process (a world of one, in block order),
        equal to what the distributed workers store (tested). Used where many short
        contexts are encoded with one loaded model (`starqa eval`)."""
        from starqa import dist

        info = dist.local_world(next(model.parameters()).device)
        return self.encode(model, ids, config, blocks, range(len(blocks)), info, prepared)
