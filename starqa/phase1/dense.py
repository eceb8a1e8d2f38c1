"""Exact causal Phase 1, chunked by block (docs/methods.md §1): each block attends to every
earlier block's KV, as one full causal forward would."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.phase1.blockwise import Recorder, forward


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
