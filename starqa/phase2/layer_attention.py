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
                 retriever: TopKShard | None = None):
        self.info, self.view, self.own = info, view, own
        self.query_host = query_host
        self.retriever = retriever

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float, question: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [1, Hq, M, D]; key, value [1, Hkv, M, D]: this forward's tokens (written
        after the own KV on the query host). question: the forward is the question's (the
        first of an answer; top-k may attend it exactly, `TopK.prefill`). Returns the
        folded rows q [1, Hkv, R = G*M, D] (`fold_gqa`, in the shard's dtype) and their
        attention over every worker's keys: out [Hkv, R, D] and lse [Hkv, R], fp32."""
        q, out, lse = self.local(layer, query, key, value, scale, question)
        return (q, *self.across(out, lse))

    def local(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scale: float, question: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`__call__` on this worker's keys only: q, and out [Hkv, R, D], lse [Hkv, R]."""
        kv_heads = key.shape[1]
        dtype = self.view.dtype(layer) if self.view.shard is not None else key.dtype
        # Work in the folded layout [*, Hkv, R = G*M, D]: query heads of a KV head as rows.
        q = fold_gqa(query, kv_heads, dtype)
        outs, lses = self._parts(layer, query, q, (key, value), scale, question)
        if not outs:  # no blocks and not the query host: contribute nothing
            outs, lses = [q.new_zeros(1, *q.shape[1:])], [q.new_full(q.shape[:3], -math.inf)]
        if len(outs) == 1 and outs[0].shape[0] == 1:  # one part: already the attention
            return q, outs[0][0], lses[0][0]
        return (q, *merge(torch.cat(outs), torch.cat(lses)))  # parts [P, Hkv, R(, D)]

    def across(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's attention out [Hkv, R, D] and lse [Hkv, R] merged with every other
        worker's: one collective, [out ‖ lse] as [Hkv, R, D + 1] gathered to [W, Hkv, R,
        D + 1] (a world of one: as it is). Each row's merge is its own."""
        if self.info.world_size == 1:
            return out, lse
        gathered = dist.all_gather(self.info, torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1))
        return merge(gathered[..., :-1], gathered[..., -1])

    def batched(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float, owns: list[OwnKV], rows: list[int], questions: list[bool]
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Several questions' rows of one forward, `rows[s]` each, in order, each with its
        own KV `owns[s]` (query host) and question flag: their folded rows (one tensor a
        question) and attention out [Hkv, R, D], lse [Hkv, R] over every worker's keys, R
        all the questions' folded rows in order. Each row is computed as `__call__` on its
        question alone computes it; on the CPU the shard is read once for all of them
        (`Pieces.attend_batch`), and the workers merge every row in one collective."""
        bounds = [sum(rows[:s]) for s in range(len(rows) + 1)]
        parts = [(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b])
                 for a, b in zip(bounds, bounds[1:])]
        if not self.view.cpu or self.retriever is not None:
            return self._each(layer, parts, scale, owns, questions)
        pieces = self.view.pieces[layer]
        qs = [fold_gqa(q, key.shape[1], self.view.dtype(layer)) for q, _, _ in parts]
        if not self.query_host:  # the shard's part only, as alone
            out, lse = pieces.attend(torch.cat(qs, dim=2)[0], scale=scale)
            return (qs, *self.across(out, lse))
        mine = [own.append(layer, k, v) for own, (_, k, v) in zip(owns, parts)]
        buffers = [(k[0], v[0]) for k, v in mine]
        if pieces.batched(buffers):
            out, lse = pieces.attend_batch(torch.cat(qs, dim=2)[0],
                                           [(k, v, m) for (k, v), m in zip(buffers, rows)],
                                           [q.shape[2] for q in qs], scale)
        else:  # the call each question's forward alone makes
            done = [pieces.attend(q[0], k, v, scale, m) for q, (k, v), m in zip(qs, buffers, rows)]
            out, lse = (torch.cat(found, dim=1) for found in zip(*done))
        return (qs, *self.across(out, lse))

    def _each(self, layer: int, parts: list[tuple[torch.Tensor, ...]], scale: float,
              owns: list[OwnKV], questions: list[bool]
              ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """`batched` a question at a time (`local` with its own KV), merged across workers
        in one collective."""
        qs, outs, lses = [], [], []
        for own, question, (q, k, v) in zip(owns, questions, parts):
            self.own = own
            folded, out, lse = self.local(layer, q, k, v, scale, question)
            qs.append(folded), outs.append(out), lses.append(lse)
        return (qs, *self.across(torch.cat(outs, dim=1), torch.cat(lses, dim=1)))

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
            # the context bias, the view's (`ShardView.bias`, `unbiased`), given to top-k
            outs, lses = self.retriever.parts(layer, q, scale, m, own, question,
                                              self.view.bias, self.view.unbiased)
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
