"""Star Attention's registry entry (the math: starqa.phase1.star; docs/methods.md §2)."""

from __future__ import annotations

from starqa.methods.base import Blocks, Encoded, Method
from starqa.core.blocks import digest
from starqa.methods.config import MethodConfig


class Star(Method):
    """Block 0 alone; block i > 0 after the anchor c[:a] (positions 0..a-1); no communication."""

    name = "star"
    help = "each block after an anchor, no communication (Star Attention)"
    settings = ("anchor",)
    reuse = "block"  # block i's KV reads the anchor and block i only
    rotatable = True  # a block that moved keeps its KV, keys re-rotated (starqa.reingest.rotate)

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        """anchor = block unless given (the paper's default)."""
        return MethodConfig(self.name, block_size,
                            block_size if anchor_size is None else anchor_size)

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.star import encode_star

        return encode_star(model, ids, blocks, indices, config.anchor_size)

    def block_inputs(self, ids, config, blocks, index, prepared=None) -> dict:
        """The anchor's tokens (at 0..a-1) and the block's own (at its offset)."""
        start, end = blocks[index]
        return {"anchor": digest(ids[:min(config.anchor_size, start)]),
                "block": digest(ids[start:end])}

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """`edited` itself; and every later block when the edit reaches into the anchor
        (block i reads the context's first min(a, start_i) tokens, so with the default
        anchor = block that is block 0, everyone's anchor)."""
        if blocks[edited][0] < config.anchor_size:
            return list(range(edited, len(blocks)))
        return [edited]
