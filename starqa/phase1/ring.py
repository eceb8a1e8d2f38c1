"""Ring Attention Phase 1 (docs/methods.md §5): exact distributed prefill, the baseline the
Star paper measures against.

Each worker holds one contiguous chunk of the context (its blocks, back to back) and runs
one forward over it at the chunk's own positions. In every layer the chunks' (K, V) travel
around the ring in W - 1 steps; a worker attends its queries to its own chunk causally and
fully to every chunk from an earlier worker (later ones are skipped), merging the partial
results by LSE. The result is dense causal attention exactly, paid for with per-layer
communication of the whole cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from starqa.runtime import dist
from starqa.attention import attend, merge
from starqa.phase1.blockwise import stack_layers


class _RingHook:
    """AttentionHook for one worker's chunk; keeps the chunk's KV per layer."""

    def __init__(self, info: dist.DistInfo, lengths: Sequence[int], past=None):
        self.info = info
        self.lengths = list(lengths)  # every worker's chunk length, by rank
        self.past = past  # per layer (k, v) [1, Hkv, P, D] before every chunk, or None
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(self, layer, query, key, value, scale):
        # query [1, Hq, T, D]; key, value [1, Hkv, T, D] of this worker's chunk
        self.kept.append((key, value))
        out, lse = attend(query, key, value, scale, causal=True)
        outs, lses = [out], [lse]
        if self.past is not None:  # stored blocks before every chunk: seen whole
            past_k, past_v = self.past[layer]
            out, lse = attend(query, past_k, past_v, scale)
            outs.append(out), lses.append(lse)
        rank, world = self.info.rank, self.info.world_size
        longest = max(self.lengths)
        # K and V travel together, padded to the longest chunk: [2, 1, Hkv, longest, D].
        travelling = torch.nn.functional.pad(torch.stack([key, value]),
                                             (0, 0, 0, longest - key.shape[2]))
        for step in range(1, world):
            travelling = dist.ring_shift(self.info, travelling)
            source = (rank - step) % world
            if source < rank:  # an earlier chunk: every query sees all of it
                n = self.lengths[source]
                out, lse = attend(query, travelling[0, :, :, :n], travelling[1, :, :, :n], scale)
                outs.append(out), lses.append(lse)
        return merge(outs, lses)[0]


@torch.inference_mode()
def encode_ring(model, ids: torch.Tensor, blocks: Sequence[tuple[int, int]],
                indices: Sequence[int], info: dist.DistInfo, past=None,
                shares: Sequence[Sequence[int]] | None = None
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """This worker's blocks `indices` (contiguous), encoded exactly; yields (index, k, v) per
    block with k, v [L, Hkv, T, D]. Every worker of the group must call it together.
    shares: every worker's blocks, by rank (default: the blocks split contiguously);
    past: per layer (k, v) [1, Hkv, P, D] of the blocks before every share (an incremental
    ingest's stored prefix), attended in full by every query."""
    device = next(model.parameters()).device
    if shares is None:
        shares = [dist.split_contiguous(len(blocks), info.world_size, r)
                  for r in range(info.world_size)]
    lengths = [sum(blocks[i][1] - blocks[i][0] for i in share) for share in shares]
    if past is not None:
        past = [(k.to(device), v.to(device)) for k, v in past]
    start, end = blocks[indices[0]][0], blocks[indices[-1]][1]
    hook = _RingHook(info, lengths, past)
    model.model(input_ids=ids[start:end].to(device)[None],
                position_ids=torch.arange(start, end, device=device)[None], starqa=hook,
                use_cache=False)
    k, v = stack_layers(hook.kept)  # [L, Hkv, chunk, D] each
    for i in indices:
        a, b = blocks[i][0] - start, blocks[i][1] - start
        yield i, k[:, :, a:b], v[:, :, a:b]

