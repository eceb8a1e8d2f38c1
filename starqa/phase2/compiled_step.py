"""A forward's attention in one call: the words starqa/native/_step.c reads to run every
layer's attention (exact over the shard view's tables, or top-k's) with the model's steps
between them, without returning to Python (`starqa.models.decoder.Decoder.forward`'s
`compiled`).

The words point at the own-KV buffers, so they are made with every layer's buffers at once
and kept while those buffers stay (`OwnKV.generation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from starqa.native import ops as native
from starqa.phase2.own_kv import OwnKV
from starqa.phase2.shard_view import ShardView

if TYPE_CHECKING:  # annotations only: top-k is loaded where it is asked for
    from starqa.topk.shard import TopKShard


class CompiledStep:
    """The compiled step's words for one worker's attention: made once, remade when the own
    buffers are replaced, never offered again where the attention has no compiled kernel.
    retriever: top-k attention over the blocks (`starqa.topk.shard.TopKShard`), or None
    for exact attention over `view`. The context bias is the view's (`ShardView.bias` and
    `unbiased`): exact's tables carry it, top-k's words are given it."""

    def __init__(self, view: ShardView, own: OwnKV, retriever: TopKShard | None = None):
        self.view, self.own, self.retriever = view, own, retriever
        self.never = False  # no compiled kernel for this attention: never offered again
        self._words: torch.Tensor | None = None
        self._generation = -1  # the own buffers' generation the words point at

    def offered(self, m: int, groups: int, question: bool) -> bool:
        """Whether a forward of `m` positions of `groups` query heads per KV head can run in
        one call: exact attention on the CPU, or top-k (not hnsw, not its exact question:
        `TopKShard.compiles`); with --kv-on-disk the step releases each layer's mapped
        pages itself."""
        if self.never:
            return False
        if self.retriever is None:
            return self.view.cpu
        return self.view.shard is None and self.retriever.compiles(m, groups, question)

    def words(self, end: int, dtype: torch.dtype, kv_heads: int, dim: int
              ) -> torch.Tensor | None:
        """The words for a forward whose keys end at `end` in the own buffers (made to hold
        them), in the model's `dtype`; None (from then on) where there is no compiled kernel
        for this attention or the shard's dtype is not the model's."""
        if self.never:
            return None
        if self._words is None or self._generation != self.own.generation or \
                self.own.held() < end:
            self._words = self._make(end, dtype, kv_heads, dim)
            self._generation = self.own.generation
            self.never = self._words is None
        return self._words

    def _make(self, end: int, dtype: torch.dtype, kv_heads: int, dim: int
              ) -> torch.Tensor | None:
        """`words`, with every layer's own buffers made to hold `end` keys."""
        if self.retriever is None:
            kinds = self.view.step_words(dtype)
        else:
            tables = self.retriever.step_words(self.view.bias, self.view.unbiased)
            kinds = None if tables is None else [(native.STEP_TOPK, words) for words in tables]
        if kinds is None:
            return None
        for layer in range(len(kinds)):
            self.own.grow(layer, end, (1, kv_heads, 0, dim), dtype, torch.device("cpu"))
        return native.step_words([(kind, dim**-0.5, *own, own[0].shape[2], *args)
                                  for (kind, args), own in zip(kinds, self.own.buffers)],
                                 attention=True)
