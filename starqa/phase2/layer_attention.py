"""The attention call: one layer of Phase 2's attention on one worker, the shard's part and
(query host) the own part, merged by log-sum-exp, then across workers.

Worker h computes (A_h, lse_h) over its own shard with no mask (the shard lies wholly
before the query), exact (`ShardView.parts`) or top-k (`TopKShard.parts`). The query host
also attends, causally, to the question's and the answer's own keys (`OwnKV`); on the CPU
that goes in the shard's kernel call. The parts are merged exactly (`attention.merge`), and
one all-gather per layer (`runtime.dist`) carries each worker's [out ‖ lse] to every other,
so every worker continues with the same, exact attention output. A world of one is the
same code with no collective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from starqa.attention import attend, fold_gqa, fold_result, fused_available, merge, \
    partial_chunks, partial_rows
from starqa.phase2.own_kv import OwnKV
from starqa.phase2.shard_view import ShardView
from starqa.runtime import dist

if TYPE_CHECKING:  # annotations only: top-k is loaded where it is asked for
    from starqa.topk.shard import TopKShard

Parts = tuple[list[torch.Tensor], list[torch.Tensor]]  # outs [P, Hkv, R(, D)], lses alike


class LayerAttention:
    """A layer's attention over this worker's shard (exact `view`, or top-k `retriever`,
    `starqa.topk.shard.TopKShard`) and, where `query_host`, the own KV (`own`), merged
    across the workers of `info`."""

    def __init__(self, info: dist.DistInfo, view: ShardView, own: OwnKV, query_host: bool,
                 retriever: TopKShard | None = None, context_bias: float = 0.0):
        self.info, self.view, self.own = info, view, own
        self.query_host = query_host
        self.retriever = retriever
        # added to every shard key's score (`methods.context_bias`), not the own keys':
        # the view's parts carry it (laid out with it), the retriever's are given it
        self.context_bias = context_bias

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float, question: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [1, Hq, M, D]; key, value [1, Hkv, M, D]: this forward's tokens (written
        after the own KV on the query host). question: the forward is the question's (the
        first of an answer; top-k may attend it exactly, `TopK.prefill`). Returns the
        folded rows q [1, Hkv, R = G*M, D] (`fold_gqa`, in the shard's dtype) and their
        attention over every worker's keys: out [Hkv, R, D] and lse [Hkv, R], fp32."""
        kv_heads = key.shape[1]
        dtype = self.view.dtype(layer) if self.view.shard is not None else key.dtype
        # Work in the folded layout [*, Hkv, R = G*M, D]: query heads of a KV head as rows.
        q = fold_gqa(query, kv_heads, dtype)
        outs, lses = self._parts(layer, query, q, (key, value), scale, question)
        if not outs:  # no blocks and not the query host: contribute nothing
            outs, lses = [q.new_zeros(1, *q.shape[1:])], [q.new_full(q.shape[:3], -math.inf)]
        if len(outs) == 1 and outs[0].shape[0] == 1:  # one part: already the attention
            out, lse = outs[0][0], lses[0][0]
        else:  # parts [P, Hkv, R(, D)]
            out, lse = merge(torch.cat(outs), torch.cat(lses))
        if self.info.world_size > 1:
            # One collective: [out ‖ lse] as [Hkv, R, D + 1], gathered to [W, Hkv, R, D + 1].
            gathered = dist.all_gather(self.info, torch.cat([out.float(), lse.unsqueeze(-1)],
                                                            dim=-1))
            out, lse = merge(gathered[..., :-1], gathered[..., -1])
        return q, out, lse

    def _parts(self, layer: int, query: torch.Tensor, q: torch.Tensor,
               forward: tuple[torch.Tensor, torch.Tensor], scale: float, question: bool
               ) -> Parts:
        """This worker's parts: the shard's, then (query host) the own KV's, unless the
        shard's kernel call took it in (the CPU; top-k on the CPU, one kernel call too)."""
        m = query.shape[2]
        own_in_shard = self.query_host and (
            self.view.cpu or self.retriever is not None and query.device.type == "cpu")
        own = self.own.append(layer, *forward) if own_in_shard else None
        if self.view.cpu:
            outs, lses = self.view.parts(layer, query, q, scale, own)
        elif self.retriever is not None:
            outs, lses = self.retriever.parts(layer, q, scale, m, own, question,
                                              self.context_bias)
        elif self.view.shard is not None:
            outs, lses = self.view.parts(layer, query, q, scale)
        else:
            outs, lses = [], []
        if self.query_host and not own_in_shard:
            own_outs, own_lses = self._own_parts(layer, query, q, forward, scale)
            outs, lses = outs + own_outs, lses + own_lses
        return outs, lses

    def _own_parts(self, layer: int, query: torch.Tensor, q: torch.Tensor,
                   forward: tuple[torch.Tensor, torch.Tensor], scale: float) -> Parts:
        """(Query host, the shard's call without them) the own keys' part: the question's
        KV so far and this forward's, which sees them causally."""
        keys, values = self.own.append(layer, *forward)
        m, kv_heads = query.shape[2], keys.shape[1]
        if query.device.type == "cpu":  # no blocks here: exact's kernel, this forward's
            # keys causally; a row's result never depends on the forward's other rows,
            # so drafted tokens cannot change the answer
            out, lse = partial_rows(q[0], keys[0], values[0], scale, m)
            return [out[None]], [lse[None]]
        if m == 1 and fused_available(query):  # one new token sees every key: no mask
            return partial_chunks(q, keys, values, scale, keys.shape[2])
        out, lse = fold_result(*attend(query, keys, values, scale, causal=True), kv_heads)
        return [out], [lse]
