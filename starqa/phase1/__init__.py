"""Phase 1 of Star Attention and of dense: the context encoded blockwise into per-block KV.

Pure compute on one worker: which blocks it encodes is decided by the caller (the method
registry, starqa.methods, picks the method and its blocks). Each block's KV comes out as
(k, v) tensors [L, Hkv, T, D] with RoPE applied at the tokens' original positions, ready to
be stored as a shard. docs/methods.md §1-2.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.phase1.blockwise import Recorder, forward


@torch.inference_mode()
def encode_star(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]], indices: Sequence[int],
                anchor_size: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Star Attention Phase 1 for blocks `indices`; yields (index, k, v) per block.

    Block 0 is encoded alone; block i > 0 as [c[:a] ‖ c_i] with the anchor at positions
    0..a-1 and the block at its own positions; the anchor's KV is discarded.
    """
    device = next(model.parameters()).device
    for i in indices:
        start, end = blocks[i]
        anchor = min(anchor_size, start)  # never reaches into the block itself
        tokens = torch.cat([ids[:anchor], ids[start:end]]).to(device)
        positions = torch.cat([torch.arange(anchor), torch.arange(start, end)]).to(device)
        hook = Recorder(keep=end - start)
        forward(model, tokens, positions, hook)
        yield (i, *hook.stacked())


@torch.inference_mode()
def encode_dense(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]], first: int = 0,
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Exact causal encoding, chunked by block: block i attends to all earlier blocks' KV.

    Sequential by nature (block i needs every earlier block's KV), so one worker runs it.
    Yields (index, k, v) per block from block `first` on, identical to slicing one full
    causal forward. past: per layer (k, v) [1, Hkv, P, D] of blocks 0..first-1 (stored by
    an earlier ingest: an incremental one continues from them, bit for bit).
    """
    device = next(model.parameters()).device
    if past is not None:
        past = [(k.to(device), v.to(device)) for k, v in past]
    for i in range(first, len(blocks)):
        start, end = blocks[i]
        hook = Recorder(keep=end - start, past=past)
        forward(model, ids[start:end].to(device), torch.arange(start, end, device=device), hook)
        if past is None:
            past = [(k, v) for k, v in hook.kept]
        else:
            past = [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                    for (pk, pv), (k, v) in zip(past, hook.kept)]
        yield (i, *hook.stacked())
