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

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1 import encode_dense

        return encode_dense(model, ids, blocks)


class Ring(Method):
    """Ring Attention: each worker one contiguous chunk, every layer's KV around the ring."""

    name = "ring"
    help = "exact, distributed (Ring Attention)"
    exact = True

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.ring import encode_ring

        return encode_ring(model, ids, blocks, indices, info)
