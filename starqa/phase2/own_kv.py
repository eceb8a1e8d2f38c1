"""The own-KV buffers: the keys and values of the question and of the answer so far, which
only the query host keeps, appended by every forward.

Per layer one buffer pair [1, Hkv, capacity, D], allocated by the first question and reused
by every later one (a question only rewinds `length`), grown by a longer one. A forward
writes its tokens after `length`; `advance` then keeps those the model picked (drafted
tokens it did not pick are written over by the next forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OwnKV:
    """The query host's own keys and values, written in place, layer by layer.

    `generation` counts the times a buffer was replaced (grown or dropped): what points at
    the buffers (`starqa.phase2.compiled_step`'s words) is stale when it changed."""

    def __init__(self, capacity: int = 64):
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v)
        self.capacity = capacity
        self.length = 0  # tokens of the question and answer in the buffers
        self.generation = 0

    def begin(self, capacity: int) -> None:
        """A new question of about `capacity` tokens (question + answer): forget the last
        one's KV; buffers too small for it are dropped, to be made at its size."""
        self.length = 0
        if capacity > self.capacity:
            self.buffers, self.capacity = [], capacity
            self.generation += 1

    def advance(self, kept: int) -> None:
        """The forward that just ran added its first `kept` tokens to the question's KV."""
        self.length += kept

    def held(self) -> int:
        """How many keys the buffers hold room for (0 before the first are made)."""
        return self.buffers[0][0].shape[2] if self.buffers else 0

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's KV [1, Hkv, M, D] after the question's so far; returns the
        filled views [1, Hkv, length + M, D]."""
        end = self.length + key.shape[2]
        self.grow(layer, end, key.shape, key.dtype, key.device)
        own_k, own_v = self.buffers[layer]
        own_k[:, :, self.length:end] = key
        own_v[:, :, self.length:end] = value
        return own_k[:, :, :end], own_v[:, :, :end]

    def grow(self, layer: int, end: int, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> None:
        """Make the buffers of `layer` (layers come in order) [1, Hkv, capacity, D] hold
        `end` keys, keeping what this question wrote so far; shape: a key's [1, Hkv, *, D]."""
        if len(self.buffers) > layer and self.buffers[layer][0].shape[2] >= end:
            return
        shape = (1, shape[1], max(end, self.capacity), shape[3])
        grown = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
        self.generation += 1
        if len(self.buffers) > layer:  # keep what this question wrote so far
            for new, old in zip(grown, self.buffers[layer]):
                new[:, :, :self.length] = old[:, :, :self.length]
            self.buffers[layer] = grown
        else:
            self.buffers.append(grown)
