"""Phase 1: encode the context blockwise into per-block KV (Star Attention, and dense).

Pure compute on one worker: which blocks it encodes is decided by the caller. Each block's
KV comes out as (k, v) tensors [L, Hkv, T, D] with RoPE applied at the tokens' original
positions, ready to be stored as a shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.blockwise import Recorder, forward
from starqa.methods import MethodConfig


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
def encode_dense(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]]
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Exact causal encoding, chunked by block: block i attends to all earlier blocks' KV.

    Sequential by nature (block i needs every earlier block's KV), so one worker runs it.
    Yields (index, k, v) per block, identical to slicing one full causal forward.
    """
    device = next(model.parameters()).device
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    for i, (start, end) in enumerate(blocks):
        hook = Recorder(keep=end - start, past=past)
        forward(model, ids[start:end].to(device), torch.arange(start, end, device=device), hook)
        if past is None:
            past = [(k, v) for k, v in hook.kept]
        else:
            past = [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                    for (pk, pv), (k, v) in zip(past, hook.kept)]
        yield (i, *hook.stacked())


def encode(model, ids: torch.Tensor, method: MethodConfig, blocks, indices, info):
    """This worker's share of Phase 1 for `method`: yields (index, k, v) per block."""
    if method.name == "dense":
        return encode_dense(model, ids, blocks)
    if method.name == "ring":
        from starqa.ring import encode_ring

        return encode_ring(model, ids, blocks, indices, info)
    if method.name == "pulsar":
        from starqa.pulsar import encode_pulsar

        return encode_pulsar(model, ids, blocks, indices, **method.params)
    if method.name == "apb":
        from starqa.apb import encode_apb

        p = method.params
        return encode_apb(model, ids, blocks, indices, info, anchor=method.anchor_size,
                          passing=p["passing"], window=p["window"],
                          question_ids=p.get("question_ids"))
    return encode_star(model, ids, blocks, indices, method.anchor_size)


def assignment(method: MethodConfig, n_blocks: int, world: int, rank: int) -> list[int]:
    """The blocks worker `rank` of `world` encodes: a contiguous group (what ring needs and
    what Phase 2 loads), or round-robin for apb, whose blocks pass KV forward round by round."""
    from starqa import dist

    if method.name == "apb":
        from starqa.apb import assignment as apb_assignment

        return apb_assignment(n_blocks, world, rank)
    return list(dist.split_contiguous(n_blocks, world, rank))


def encode_local(model, ids: torch.Tensor, method: MethodConfig, blocks):
    """Phase 1 for every block in this one process, as if each block sat on its own host;
    yields (index, k, v) in block order.

    The result equals what the distributed workers store (tested): star, dense and pulsar
    need no communication; ring is exact, so its blocks are dense's; apb's blocks only read
    compressed KV from earlier blocks, so a world of one, running them in order, reproduces
    the workers' result. Used
    where many short contexts are encoded with one loaded model (`starqa eval`).
    """
    from starqa import dist

    if method.name == "ring":
        return encode_dense(model, ids, blocks)
    info = dist.local_world(next(model.parameters()).device)
    return encode(model, ids, method, blocks, range(len(blocks)), info)
