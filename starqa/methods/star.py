"""Star Attention's registry entry (the math: starqa.phase1.star; docs/methods.md §2).

Two ways to place a block's positions (`--positions`): `sparse`, the paper's (the anchor at
0..a−1, the block at its own offset), and `contiguous` (the block after its anchor in one of
`slots` slots of a block's positions, taken in turn, wherever it lies in the context; one
slot, right after the anchor, unless the planner fits more): every position then stays
within the window, so a context of any length keeps the positions the model was trained on
(docs/methods.md §2, "Past the window").
"""

from __future__ import annotations

from starqa.core.errors import StarqaError
from starqa.methods.base import Blocks, Encoded, Method
from starqa.core.blocks import digest
from starqa.methods.config import MethodConfig

POSITIONS = ("sparse", "contiguous")


class Star(Method):
    """Block 0 alone; block i > 0 after the anchor c[:a] (positions 0..a-1); no communication."""

    name = "star"
    help = "each block after an anchor, no communication (Star Attention)"
    settings = ("anchor", "positions", "slots")
    reuse = "block"  # block i's KV reads the anchor and block i only
    fits_any_window = True  # at contiguous positions (the planner's choice past the window)
    shares_prefix = True  # the anchor, encoded once a worker (starqa.phase1.star)

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        """anchor = block unless given (the paper's default). Sparse positions are the
        default and are not recorded (the settings of every context made before
        `--positions` existed, and their cache keys, stay as they were)."""
        positions = params.get("positions") or "sparse"
        if positions not in POSITIONS:
            raise StarqaError(f"Unknown --positions {positions!r} for star.",
                              hint=f"choose one of: {', '.join(POSITIONS)}")
        slots = params.get("slots") or 1
        recorded = {} if positions == "sparse" else {"positions": positions}
        if positions == "contiguous" and slots > 1:
            recorded["slots"] = slots
        return MethodConfig(self.name, block_size,
                            block_size if anchor_size is None else anchor_size, recorded)

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.star import encode_star

        return encode_star(model, ids, blocks, indices, config.anchor_size,
                           at=block_positions(config, blocks) if _contiguous(config) else None)

    def position_free(self, config: MethodConfig) -> bool:
        """Contiguous positions: a block's KV does not depend on where it lies (its slot's
        first position is among its inputs)."""
        return _contiguous(config)

    def rotatable(self, config: MethodConfig) -> bool:
        """At sparse positions a block that moved keeps its KV, keys re-rotated
        (starqa.reingest.rotate); at contiguous ones it needs nothing (`position_free`)."""
        return not _contiguous(config)

    def shared_from(self, config: MethodConfig) -> int:
        """The anchor's positions hold its keys alone; the blocks share the rest."""
        return config.anchor_size

    def query_position(self, ids, config, blocks, prepared=None) -> int:
        """After the context (sparse), or after the last position a block takes
        (contiguous)."""
        return self.query_bounds(config, len(ids), blocks)[0]

    def query_bounds(self, config, n_tokens, blocks) -> tuple[int, int]:
        if not _contiguous(config):
            return n_tokens, n_tokens
        at = max((begin + end - start for begin, (start, end)
                  in zip(block_positions(config, blocks), blocks)), default=0)
        return at, at

    def block_inputs(self, ids, config, blocks, index, prepared=None) -> dict:
        """The anchor's tokens (at 0..a-1) and the block's own (at its offset, or after the
        anchor in its slot: from the slot's first position where there are several)."""
        start, end = blocks[index]
        inputs = {"anchor": digest(ids[:min(config.anchor_size, start)]),
                  "block": digest(ids[start:end])}
        if not _contiguous(config):
            return inputs
        if config.params.get("slots", 1) > 1:
            inputs["at"] = block_position(config, index, start)
        return {**inputs, "positions": "contiguous"}

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """`edited` itself; and every later block when the edit reaches into the anchor
        (block i reads the context's first min(a, start_i) tokens, so with the default
        anchor = block that is block 0, everyone's anchor)."""
        if blocks[edited][0] < config.anchor_size:
            return list(range(edited, len(blocks)))
        return [edited]


def block_positions(config: MethodConfig, blocks: Blocks) -> list[int]:
    """Each block's first position at contiguous positions (`block_position`)."""
    return [block_position(config, i, start) for i, (start, _) in enumerate(blocks)]


def block_position(config: MethodConfig, index: int, start: int) -> int:
    """The first position of block `index` (starting at token `start`) at contiguous
    positions: after its anchor, in slot (index − 1) mod `slots` of `block_size` positions
    each (block 1 in the first, block 2 in the next, round and round): the first `slots`
    blocks after block 0 keep their own positions (with anchor = block) and each later one
    shares a slot's with the blocks before it there, so each position holds about
    n / (a + slots·b) of the context's keys, where one slot would hold n / (a + b). Block
    0 is the anchor's, at 0."""
    if not index:
        return 0
    slots = config.params.get("slots", 1)
    return min(config.anchor_size, start) + (index - 1) % slots * config.block_size


def _contiguous(config: MethodConfig) -> bool:
    return config.params.get("positions") == "contiguous"
