"""Star Attention's Phase 1 (docs/methods.md §2): each block encoded after the context's
first tokens, its anchor, at the tokens' original positions (or right after the anchor:
contiguous positions); the anchor's KV discarded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.phase1.blockwise import Recorder, forward


@torch.inference_mode()
def encode_star(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]], indices: Sequence[int],
                anchor_size: int, contiguous: bool = False
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Star Attention Phase 1 for blocks `indices`; yields (index, k, v) per block.

    Block 0 is encoded alone; block i > 0 as [c[:a] ‖ c_i] with the anchor at positions
    0..a-1 and the block at its own positions, or, `contiguous`, right after the anchor
    (a..a+len-1: every position within one assembled block); the anchor's KV is discarded.
    """
    device = next(model.parameters()).device
    for i in indices:
        start, end = blocks[i]
        anchor = min(anchor_size, start)  # never reaches into the block itself
        tokens = torch.cat([ids[:anchor], ids[start:end]]).to(device)
        at = anchor if contiguous else start
        positions = torch.cat([torch.arange(anchor), torch.arange(at, at + end - start)]).to(device)
        hook = Recorder(keep=end - start)
        forward(model, tokens, positions, hook)
        yield (i, *hook.stacked())
