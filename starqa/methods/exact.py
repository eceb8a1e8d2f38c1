"""The exact methods' registry entries: dense (the reference) and ring (docs/methods.md §1, §5).

Both store dense attention's KV exactly; they differ in how it is computed: dense on one
worker, block after block; ring on every worker at once, passing KV around a ring.
"""

from __future__ import annotations

from starqa.methods.base import Encoded, Method


class Dense(Method):
    """Ordinary causal attention, chunked by block; sequential (block i needs every earlier
    block's KV), so one worker encodes every block. The accuracy ceiling and the oracle."""

    name = "dense"
    help = "exact reference, on one worker"
    exact = True
    sequential = True
    needs_past = True

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.dense import encode_dense

        return encode_dense(model, ids, blocks)

    def share(self, todo, n_blocks, world, rank) -> list[int]:
        return list(todo)

    def encode_todo(self, model, ids, config, blocks, todo, info, prepared=None,
                    past=None) -> Encoded:
        """Blocks todo[0].. after the stored KV of the earlier ones: the same computation,
        block by block, as a full encoding, so the same bits (tested)."""
        from starqa.phase1.dense import encode_dense

        return encode_dense(model, ids, blocks, first=todo[0] if todo else len(blocks),
                            past=past)


class Ring(Method):
    """Ring Attention: each worker one contiguous chunk, every layer's KV around the ring."""

    name = "ring"
    help = "exact, distributed (Ring Attention)"
    exact = True
    needs_past = True

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.ring import encode_ring

        return encode_ring(model, ids, blocks, indices, info)

    def encode_todo(self, model, ids, config, blocks, todo, info, prepared=None,
                    past=None) -> Encoded:
        """Blocks todo[0].. round the ring, every worker's queries also attending to the
        stored KV of the earlier blocks (exact, up to rounding: the merge order differs)."""
        from starqa.phase1.ring import encode_ring

        shares = [self.share(todo, len(blocks), info.world_size, r)
                  for r in range(info.world_size)]
        return encode_ring(model, ids, blocks, shares[info.rank], info, past=past,
                           shares=shares)
