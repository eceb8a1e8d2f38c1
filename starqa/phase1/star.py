"""Star Attention's Phase 1 (docs/methods.md §2): each block encoded after the context's
first tokens, its anchor, at the tokens' original positions (or right after the anchor:
contiguous positions); the anchor's KV discarded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.phase1.blockwise import Recorder, forward


@torch.inference_mode()
def encode_star(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]], indices: Sequence[int],
                anchor_size: int, at: Sequence[int] | None = None
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Star Attention Phase 1 for blocks `indices`; yields (index, k, v) per block.

    Block 0 is encoded alone; block i > 0 as [c[:a] ‖ c_i] with the anchor at positions
    0..a-1 and the block at its own positions, or from `at[i]` on (`starqa.methods.star`
    places blocks within the window past it); the anchor's KV is discarded.

    The anchor is the context's first tokens at positions 0..a-1, and attention is causal,
    so its KV is the same before every block: it is computed once per call (or taken from
    block 0's when block 0 comes first) and each block attends to it as past KV. A block
    then costs its own tokens' forward, not the anchor's too.
    """
    device = next(model.parameters()).device
    first = None  # per layer (k, v) [1, Hkv, t, D] of the context's first t tokens
    for i in indices:
        start, end = blocks[i]
        anchor = min(anchor_size, start)  # never reaches into the block itself
        if anchor and (first is None or first[0][0].shape[2] < anchor):
            longest = max(min(anchor_size, blocks[j][0]) for j in indices)
            first = anchor_kv(model, ids[:longest].to(device))
        begin = start if at is None else at[i]
        past = [(k[:, :, :anchor], v[:, :, :anchor]) for k, v in first] if anchor else None
        hook = Recorder(keep=end - start, past=past)
        positions = torch.arange(begin, begin + end - start)
        forward(model, ids[start:end].to(device), positions.to(device), hook)
        if start == 0 and first is None:
            first = hook.kept  # block 0 is the anchor's first tokens
        yield (i, *hook.stacked())


def anchor_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) [1, Hkv, len(ids), D] of the context's first tokens `ids`, encoded
    alone at positions 0..len(ids)-1."""
    hook = Recorder(keep=len(ids))
    forward(model, ids, torch.arange(len(ids), device=ids.device), hook)
    return hook.kept
