"""Star Attention's registry entry (the math: starqa.phase1.star; docs/methods.md §2).

Two ways to place a block's positions (`--positions`): `sparse`, the paper's (the anchor at
0..a−1, the block at its own offset), and `contiguous` (the block right after its anchor,
at a..a+len−1, wherever it lies in the context): every relative distance then stays within
one assembled block, so a context of any length keeps the positions the model was trained on
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
    settings = ("anchor", "positions")
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
        return MethodConfig(self.name, block_size,
                            block_size if anchor_size is None else anchor_size,
                            {} if positions == "sparse" else {"positions": positions})

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.star import encode_star

        return encode_star(model, ids, blocks, indices, config.anchor_size,
                           contiguous=_contiguous(config))

    def position_free(self, config: MethodConfig) -> bool:
        """Contiguous positions: a block's KV does not depend on where it lies."""
        return _contiguous(config)

    def rotatable(self, config: MethodConfig) -> bool:
        """At sparse positions a block that moved keeps its KV, keys re-rotated
        (starqa.reingest.rotate); at contiguous ones it needs nothing (`position_free`)."""
        return not _contiguous(config)

    def shared_from(self, config: MethodConfig) -> int:
        """The anchor's positions hold its keys alone; the blocks share the rest."""
        return config.anchor_size

    def query_position(self, ids, config, blocks, prepared=None) -> int:
        """After the context (sparse), or after the longest assembled block (contiguous)."""
        return self.query_bounds(config, len(ids), blocks)[0]

    def query_bounds(self, config, n_tokens, blocks) -> tuple[int, int]:
        if not _contiguous(config):
            return n_tokens, n_tokens
        at = assembled_end(blocks, config.anchor_size)
        return at, at

    def block_inputs(self, ids, config, blocks, index, prepared=None) -> dict:
        """The anchor's tokens (at 0..a-1) and the block's own (at its offset, or right
        after the anchor)."""
        start, end = blocks[index]
        inputs = {"anchor": digest(ids[:min(config.anchor_size, start)]),
                  "block": digest(ids[start:end])}
        return {**inputs, "positions": "contiguous"} if _contiguous(config) else inputs

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """`edited` itself; and every later block when the edit reaches into the anchor
        (block i reads the context's first min(a, start_i) tokens, so with the default
        anchor = block that is block 0, everyone's anchor)."""
        if blocks[edited][0] < config.anchor_size:
            return list(range(edited, len(blocks)))
        return [edited]


def assembled_end(blocks: Blocks, anchor_size: int) -> int:
    """One past the last position of the longest assembled block [anchor ‖ block] under
    contiguous positions: where the question starts."""
    return max((min(anchor_size, start) + end - start for start, end in blocks), default=0)


def _contiguous(config: MethodConfig) -> bool:
    return config.params.get("positions") == "contiguous"
