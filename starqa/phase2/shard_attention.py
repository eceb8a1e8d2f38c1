"""Phase 2's attention on one worker, every layer: the shard view, the own-KV buffers and the
layer call composed, with the rows source attribution keeps (`starqa.models.decoder` calls
it, layer by layer or every layer in one compiled call).

The parts, each its own module: `shard_view.ShardView` (this worker's cached blocks, laid
out once for the kernels), `own_kv.OwnKV` (the question's and the answer's own KV, only on
the query host, the worker holding the last block), `layer_attention.LayerAttention` (one
layer: shard part + own part merged by LSE, across workers by one all-gather),
`compiled_step.CompiledStep` (a forward's layers in one call of starqa/native/_step.c) and
`sources.AnswerRows` (the rows that picked the answer's tokens, for `key_mass`).

Several questions answered together (`starqa.phase2.decode.Batch`) each hold a `Slot`: their
own KV, compiled step and answer rows. A forward is one slot's (`use`), or several slots'
rows one after another (`batch`): every layer then attends each slot's rows exactly as a
forward of that slot alone would (the shard read once for all of them, each slot's rows
over its own KV), so a question's answer is the same whether asked alone or beside others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from starqa.models.decoder import StepPlan
from starqa.phase2 import sources
from starqa.phase2.compiled_step import CompiledStep
from starqa.phase2.layer_attention import LayerAttention
from starqa.phase2.own_kv import OwnKV
from starqa.phase2.shard_view import Shard, ShardView
from starqa.runtime import dist

if TYPE_CHECKING:  # annotations only: top-k is loaded where it is asked for
    from starqa.topk.shard import TopKShard


@dataclass
class Slot:
    """One question's state on this worker: its own KV (query host), the compiled step's
    words over it, the rows that picked its answer's tokens, and whether its next forward
    is its question's (the first after `ShardAttention.begin`)."""

    own: OwnKV
    step: CompiledStep
    rows: sources.AnswerRows
    question: bool = False


class ShardAttention:
    """The attention of every layer for Phase 2 on one worker; an AttentionHook
    (starqa.phase1.hooks) too, so a transformers model can drive it in tests.

    shard: per layer this worker's blocks' pieces (`ShardView`), or None for no blocks;
    head: the keys before the first document (never a source); ids: the shard's token ids
    [N_h] (what source attribution matches the answer against); retriever: top-k attention
    over this worker's blocks (starqa.topk.shard.TopKShard) in place of the exact shard
    part (shard is then None: no sources are tracked); context_bias: added to every shard
    key's score but the first `unbiased` (the keys before the shared positions,
    `methods.ContextBias`), exact's and top-k's alike (`ShardView` holds it). While
    `track` is set, it keeps the last query row of every forward (the row that picks the
    next token) and its global LSE, for `key_mass`.
    """

    def __init__(self, info: dist.DistInfo, shard: Shard | None, query_host: bool,
                 head: int = 0, ids: torch.Tensor | None = None,
                 retriever: TopKShard | None = None, context_bias: float = 0.0,
                 unbiased: int = 0):
        self.info = info
        self.query_host = query_host
        self.retriever = retriever
        self.ids = ids
        self.view = ShardView(shard, head, context_bias, unbiased)
        self.slots: list[Slot] = []
        self.current = self._slot()  # the slot a forward of one question is for (`use`)
        self.slots.append(self.current)
        self.layer = LayerAttention(info, self.view, self.own, query_host, retriever)
        # the slots of a batched forward and their rows, in order (`batch`)
        self.batched: list[tuple[Slot, int]] | None = None
        self.track = False

    def _slot(self) -> Slot:
        own = OwnKV()
        layers = len(self.view.shard) if self.view.shard is not None else 0
        return Slot(own, CompiledStep(self.view, own, self.retriever),
                    sources.AnswerRows(layers))

    @property
    def own(self) -> OwnKV:
        """The current slot's own KV."""
        return self.current.own

    @property
    def step(self) -> CompiledStep:
        return self.current.step

    @property
    def rows(self) -> sources.AnswerRows:
        return self.current.rows

    @property
    def question(self) -> bool:
        """The forward under way is the current slot's question's (the first after
        `begin`): top-k may attend it exactly (TopK.prefill)."""
        return self.current.question

    def use(self, slot: int) -> None:
        """Make slot `slot` (made if new; slots are reused) the current one: `begin`,
        `advance` and a forward of one question are its."""
        while len(self.slots) <= slot:
            self.slots.append(self._slot())
        self.current = self.slots[slot]
        self.layer.own = self.current.own
        self.batched = None

    def batch(self, segments: Sequence[tuple[int, int]]) -> None:
        """The next forward holds several slots' rows one after another: (slot, rows) each,
        in order. `advance_slot` then takes each slot's result."""
        batched = []
        for slot, m in segments:
            self.use(slot)
            batched.append((self.current, m))
        self.batched = batched

    @property
    def shard(self) -> Shard | None:
        """Per layer the pieces (k, v) [1, Hkv, T_i, D] this worker attends over."""
        return self.view.shard

    @property
    def n_keys(self) -> int:
        """The shard's keys."""
        return self.view.n_keys

    @property
    def length(self) -> int:
        """Tokens of the question and answer in the own buffers."""
        return self.own.length

    def _tracking(self) -> bool:
        """Whether this forward's rows are kept for `key_mass`."""
        return self.track and self.view.n_keys > 0

    def begin(self, capacity: int) -> None:
        """A new question of about `capacity` tokens (question + answer): forget the last
        one's KV and rows. Buffers of that size are allocated once and reused by later
        questions; they grow if a question needs more."""
        self.current.question = True
        self.own.begin(capacity)
        self.rows.clear()

    def advance(self, kept: int, picked: slice | None = None, question: bool = False) -> None:
        """The forward that just ran added its first `kept` tokens to the question's KV (the
        rest, drafted tokens the model did not pick, are written over by the next); its rows
        `picked` (default: the last) each picked a token of the answer, in order. question:
        the next forward is the question's still (its prefill goes on)."""
        self.current.question = question
        if self.query_host:
            self.own.advance(kept)
        self.rows.advance(picked or slice(-1, None), keep=self._tracking())

    def advance_slot(self, slot: int, kept: int, picked: slice | None = None,
                     question: bool = False) -> None:
        """`advance` for slot `slot` (after a batched forward, or one of its own)."""
        self.use(slot)
        self.advance(kept, picked, question)

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """query [1, Hq, M, D]; key, value [1, Hkv, M, D]: this forward's tokens. Returns the
        attention over every worker's keys and the own ones, [1, Hq, M, D] fp32."""
        scale = query.shape[-1]**-0.5 if scale is None else scale
        if self.batched is None:
            return self._one(layer, query, key, value, scale)
        # a batched forward: each slot's rows as a forward of that slot alone would compute
        # them (its own KV, its question flag, its kept rows)
        slots = [slot for slot, _ in self.batched]
        counts = [m for _, m in self.batched]
        _, q_heads, _, dim = query.shape
        kv_heads = key.shape[1]
        qs, out, lse = self.layer.batched(layer, query, key, value, scale,
                                          [slot.own for slot in slots], counts,
                                          [slot.question for slot in slots])
        outs, at = [], 0
        for slot, m, q in zip(slots, counts, qs):
            rows = q.shape[2]
            mine, mine_lse = out[:, at:at + rows], lse[:, at:at + rows]
            at += rows
            if self._tracking():
                slot.rows.keep_layer(layer, q.view(kv_heads, -1, m, dim),
                                     mine_lse.reshape(kv_heads, -1, m), scale)
            outs.append(mine.reshape(1, q_heads, m, dim))
        return torch.cat(outs, dim=2)

    def _one(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             scale: float) -> torch.Tensor:
        """`attention` of the current slot's rows."""
        _, q_heads, m, dim = query.shape
        kv_heads = key.shape[1]
        q, out, lse = self.layer(layer, query, key, value, scale, self.question)
        if self._tracking():
            # Kept, not computed, here (views, no kernels): this forward's query rows and
            # their global LSE, rows (g, m) with m fastest; `advance` keeps those that
            # picked a token, and key_mass() uses them once the answer is done.
            self.rows.keep_layer(layer, q.view(kv_heads, -1, m, dim), lse.view(kv_heads, -1, m),
                                 scale)
        return out.view(1, q_heads, m, dim)

    def compiled(self, m: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int
                 ) -> StepPlan | None:
        """This forward's attention as starqa/native/_step.c's words (`decoder.Decoder.forward`'s
        `compiled`: every layer in one call), or None where it goes layer by layer: a world
        of more than one (a collective between the layers), not the query host, a batched
        forward, not on the CPU, the shard's dtype not the model's, top-k's exact question,
        or no compiled kernel for the attention (`CompiledStep`). The own buffers are made
        for every layer here, at once."""
        if self.info.world_size > 1 or not self.query_host or self.batched is not None or \
                not self.step.offered(m, heads // kv_heads, self.question):
            return None
        words = self.step.words(self.own.length + m, dtype, kv_heads, dim)
        if words is None:
            return None
        layers = len(self.own.buffers)
        rows = torch.empty(layers, kv_heads, heads // kv_heads * m, dim)
        lse = torch.empty(layers, kv_heads, heads // kv_heads * m)
        if self._tracking():
            self.rows.keep_forward(rows.view(layers, kv_heads, -1, m, dim),
                                   lse.view(layers, kv_heads, -1, m), dim**-0.5)
        return StepPlan(words, self.own.length, rows, lse)

    def adopt(self, prefill) -> None:
        """(CPU, query host) Take the question's forward that starqa.coldstart.firsttoken ran
        before torch was imported (its `Prefill`) as if `attention` had run it: its keys and
        values written after the question's so far, and (tracking) its folded query rows and
        their LSE kept for `advance`, which the caller calls as after any forward."""
        def tensor(array) -> torch.Tensor:  # bf16 bits (numpy uint16) → bf16, no copy
            return torch.from_numpy(array).view(torch.bfloat16)

        for layer, (key, value) in enumerate(zip(prefill.keys, prefill.values)):
            self.own.append(layer, tensor(key)[None], tensor(value)[None])
            if self._tracking():  # the decoder's scale, as `attention` got it
                self.rows.keep_layer(layer, tensor(prefill.queries[layer]),
                                     torch.from_numpy(prefill.lses[layer]), key.shape[-1] ** -0.5)

    def key_mass(self, tokens: Sequence[int]) -> torch.Tensor:
        """[N_h] float64: the attention each shard key received from the answer's rows that
        emitted its own token, as a fraction of all their attention (`sources.key_mass`
        says why this rule). `tokens`: the answer, one token per tracked row."""
        return sources.key_mass(self.view, self.ids, self.rows, tokens)
