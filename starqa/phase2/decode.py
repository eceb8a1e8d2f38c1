"""Phase 2: encode the question on every worker against its shards and generate, merging
partial attentions exactly across workers (one all-gather per layer per step).

Every worker runs all layers on the same query tokens (starqa.models.decoder). In each layer
worker h computes (A_h, lse_h) over its own shard, with no mask (the shard lies wholly
before the query), in one fused kernel call in the cache's dtype. The query host (the
worker holding the last block) also attends, causally, to the KV of the question and the
tokens generated so far, which only it keeps, in buffers allocated once and reused by every
question. The all-gathered partials are merged by LSE, so every worker continues with the
same, exact attention output. A world of one is the same code with no collective.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from starqa.runtime import dist
from starqa.native import ops as native
from starqa.attention import (Pieces, attend, fold_gqa, fused_available, merge, partial_chunks,
    partial_rows)
from starqa.models.decoder import StepPlan
from starqa.core.errors import StarqaError
from starqa.phase2.lookup import Drafter

SLOT = 128  # shard keys per fused kernel call on CUDA (attention.partial_chunks)
# Drafted tokens checked per forward (`generate`): 3 makes a forward of 4 rows, which costs
# torch's int4 kernel 1.8x a row's time (measured, Qwen2.5-Coder-1.5B's shapes, 2-core
# Zen 5) where a fifth row would double it.
DRAFT_TOKENS = 3
MAX_DRAFT_TOKENS = 16  # the most a setting or a request may ask for
# key_mass holds every layer's keys (fp32) of this much of its candidates at a time: below
# glibc's largest mmap threshold (32 MB), so each piece reuses the last one's heap memory
# instead of faulting in fresh pages (first attribution at 32K: 30 → 18 ms; 4 MB: 19).
MASS_BYTES = 8 << 20


def draft_tokens_setting(default: int = DRAFT_TOKENS) -> int:
    """Drafted tokens per forward: STARQA_DRAFT_TOKENS if set (0 turns drafts off), else
    `default`. They never change the answer on CPU (see `generate`), only its speed."""
    raw = os.environ.get("STARQA_DRAFT_TOKENS")
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) > MAX_DRAFT_TOKENS:
        raise StarqaError(f"STARQA_DRAFT_TOKENS={raw!r} is not a number of tokens from 0 to "
                          f"{MAX_DRAFT_TOKENS}.",
                          hint="export STARQA_DRAFT_TOKENS=3   (or 0 to answer without drafts)")
    return int(raw)


class ShardAttention:
    """The attention of every layer for Phase 2 on one worker (starqa.models.decoder calls it).

    shard: per layer the pieces (k, v), each [1, Hkv, T_i, D], that hold this worker's
    blocks in order, in the compute dtype (`starqa.cache.shards.load_shard`: on the CPU a piece
    per block, memory-mapped where it lies; elsewhere one), or None for no blocks; ids:
    their token ids [N_h] (what source attribution matches the answer against). While
    `track` is set, it keeps the last query row of every forward (the row that picks the
    next token) and its global LSE, for `key_mass`.
    """

    def __init__(self, info: dist.DistInfo,
                 shard: list[list[tuple[torch.Tensor, torch.Tensor]]] | None,
                 query_host: bool, head: int = 0, ids: torch.Tensor | None = None,
                 retriever=None):
        self.info = info
        # Top-k attention over this worker's blocks (starqa.topk.retrieval.TopKShard), in place
        # of the exact shard part (shard is then None: no sources are tracked).
        self.retriever = retriever
        self.cpu = shard is not None and shard[0][0][0].device.type == "cpu"
        if shard is not None and not self.cpu:  # the fused kernels take one buffer a layer
            shard = [pieces if len(pieces) == 1 else
                     [tuple(torch.cat([p[i] for p in pieces], dim=2) for i in (0, 1))]
                     for pieces in shard]
        self.shard = shard
        # (CPU) each layer's pieces as the kernel reads them, laid out once
        self._pieces = [Pieces([(k[0], v[0]) for k, v in pieces]) for pieces in shard] \
            if self.cpu else None
        self.query_host = query_host
        # where each piece starts among the shard's keys, then the shard's length
        self._starts = [0]
        for k, _ in shard[0] if shard else ():
            self._starts.append(self._starts[-1] + k.shape[2])
        self.n_keys = self._starts[-1]
        self.ids = ids
        # Keys before the first document (template, system prompt) are never a source.
        self.head = min(head, self.n_keys)
        self.track = False
        self.fused = shard is not None and fused_available(shard[0][0][0])
        # Each tracked forward's query rows that picked a token [L, Hkv, G, P, D] and their
        # global LSE [L, Hkv, G, P] (see `key_mass`).
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the running forward's rows [Hkv, G, M(, D)]: per layer (`attention`), or of every
        # layer at once (`compiled`)
        self._last: list | tuple | None = None
        # `compiled`'s words while the own buffers stay (False: this attention has none)
        self._words: torch.Tensor | bool | None = None
        # (query host) per layer this question's and answer's KV [1, Hkv, capacity, D],
        # written in place: allocated by the first question, grown by a longer one
        self._own: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._capacity = 64
        self.length = 0  # tokens of the question and answer in the own buffers
        # the forward under way is the question's (the first after `begin`): top-k may
        # attend it exactly (TopK.prefill)
        self.question = False

    def begin(self, capacity: int) -> None:
        """A new question of about `capacity` tokens (question + answer): forget the last
        one's KV. Buffers of that size are allocated once and reused by later questions;
        they grow if a question needs more."""
        self.length = 0
        self.question = True
        self._rows, self._last = [], None
        if capacity > self._capacity:
            self._own, self._capacity = [], capacity
            self._forget_words()

    def advance(self, kept: int, picked: slice | None = None) -> None:
        """The forward that just ran added its first `kept` tokens to the question's KV (the
        rest, drafted tokens the model did not pick, are written over by the next); its rows
        `picked` (default: the last) each picked a token of the answer, in order."""
        self.question = False
        if self.query_host:
            self.length += kept
        if self.track and self.n_keys and self._last is not None:
            picked = picked or slice(-1, None)
            q, lse = self._last if isinstance(self._last, tuple) else (
                torch.stack([q for q, _ in self._last]), torch.stack([x for _, x in self._last]))
            self._rows.append((q[:, :, :, picked], lse[:, :, :, picked]))
        self._last = None

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        # query [1, Hq, M, D]; key, value [1, Hkv, M, D]: this forward's tokens. Also an
        # AttentionHook (starqa.phase1.hooks), so a transformers model can drive it in tests.
        _, q_heads, m, dim = query.shape
        kv_heads = key.shape[1]
        scale = dim**-0.5 if scale is None else scale
        dtype = self.shard[layer][0][0].dtype if self.shard is not None else key.dtype
        # Work in the folded layout [*, Hkv, R = G*M, D]: query heads of a KV head as rows.
        q = fold_gqa(query, kv_heads, dtype)
        # top-k on the CPU: the retriever attends this forward's own keys too (one kernel call)
        own_in_retriever = self.retriever is not None and query.device.type == "cpu"
        outs, lses = [], []
        if self.cpu:  # the shard's pieces and (query host) this question's KV: one call
            if self.query_host:
                keys, values = self._append(layer, key, value)
                out, lse = self._pieces[layer].attend(q[0], keys[0], values[0], scale, m)
            else:
                out, lse = self._pieces[layer].attend(q[0], scale=scale)
            outs, lses = [out[None]], [lse[None]]
        elif self.retriever is not None:
            own = self._append(layer, key, value) if self.query_host and own_in_retriever \
                else None
            outs, lses = self.retriever.parts(layer, q, scale, m, own, self.question)
        elif self.shard is not None:
            if self.fused:
                outs, lses = partial_chunks(q, *self.shard[layer][0], scale, SLOT, self.head)
            else:  # no fused kernel here: one exact part, attribution per shard
                out, lse = _folded(attend(query, *self.shard[layer][0], scale), kv_heads)
                outs, lses = [out], [lse]
        if self.query_host and not self.cpu and not own_in_retriever:
            keys, values = self._append(layer, key, value)
            if query.device.type == "cpu":  # no blocks here: exact's kernel, this forward's
                # keys causally; a row's result never depends on the forward's other rows,
                # so drafted tokens cannot change the answer
                out, lse = partial_rows(q[0], keys[0], values[0], scale, m)
                outs.append(out[None]), lses.append(lse[None])
            elif m == 1 and fused_available(query):  # one new token sees every key: no mask
                own_outs, own_lses = partial_chunks(q, keys, values, scale, keys.shape[2])
                outs += own_outs
                lses += own_lses
            else:
                out, lse = _folded(attend(query, keys, values, scale, causal=True), kv_heads)
                outs.append(out), lses.append(lse)
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
        if self.track and self.n_keys:
            # Kept, not computed, here (views, no kernels): this forward's query rows and
            # their global LSE, rows (g, m) with m fastest; `advance` keeps those that
            # picked a token, and key_mass() uses them once the answer is done.
            self._scale = scale
            self._last_layer(layer, q.view(kv_heads, -1, m, dim), lse.view(kv_heads, -1, m))
        return out.view(1, q_heads, m, dim)

    def _last_layer(self, layer: int, q: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep a layer's rows of the running forward (`advance` stacks them)."""
        if not isinstance(self._last, list):
            self._last = [None] * len(self.shard)
        self._last[layer] = (q, lse)

    def compiled(self, m: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int
                 ) -> StepPlan | None:
        """This forward's attention as starqa/native/_step.c's words (`decoder.Decoder.forward`'s
        `compiled`: every layer in one call), or None where it goes layer by layer: a world
        of more than one (a collective between the layers), not on the CPU, the shard's
        dtype not the model's, top-k's exact question, or no compiled kernel for the
        attention (top-k with --kv-on-disk is compiled: the step releases each layer's
        mapped pages). The own buffers are made for every layer here, at once; their words
        are kept while the buffers stay."""
        if self.info.world_size > 1 or not self.query_host or self._words is False or not (
                self.cpu and self.retriever is None or self.retriever is not None and
                self.shard is None and self.retriever.compiles(m, heads // kv_heads,
                                                               self.question)):
            return None
        end = self.length + m
        if self._words is None or self._own[0][0].shape[2] < end:
            self._words = self._step_words(end, dtype, kv_heads, dim)
            if self._words is None:
                self._words = False  # no compiled step for this attention: never again
                return None
        layers = len(self._own)
        rows = torch.empty(layers, kv_heads, heads // kv_heads * m, dim)
        lse = torch.empty(layers, kv_heads, heads // kv_heads * m)
        if self.track and self.n_keys:
            self._scale = dim**-0.5
            self._last = (rows.view(layers, kv_heads, -1, m, dim),
                          lse.view(layers, kv_heads, -1, m))
        return StepPlan(self._words, self.length, rows, lse)

    def _forget_words(self) -> None:
        if self._words is not False:
            self._words = None

    def _step_words(self, end: int, dtype: torch.dtype, kv_heads: int, dim: int
                    ) -> torch.Tensor | None:
        """`compiled`'s words, with every layer's own buffers made to hold `end` keys; None
        where the attention has no compiled kernel (or the shard's dtype is not the
        model's)."""
        if self.retriever is None:
            layouts = [pieces.layout for pieces in self._pieces]
            if any(lay is None or lay.dtype not in (None, dtype) for lay in layouts):
                return None
            kinds = [(native.STEP_EXACT, lay.step_words()) for lay in layouts]
        else:
            tables = self.retriever.step_words()
            if tables is None:
                return None
            kinds = [(native.STEP_TOPK, words) for words in tables]
        for layer in range(len(kinds)):
            self._grow(layer, end, (1, kv_heads, 0, dim), dtype, torch.device("cpu"))
        return native.step_words([(kind, dim**-0.5, *own, own[0].shape[2], *args)
                                  for (kind, args), own in zip(kinds, self._own)],
                                 attention=True)

    def adopt(self, prefill) -> None:
        """(CPU, query host) Take the question's forward that starqa.coldstart.firsttoken ran before
        torch was imported (its `Prefill`) as if `attention` had run it: its keys and values
        written after the question's so far, and (tracking) its folded query rows and their
        LSE kept for `advance`, which the caller calls as after any forward."""
        def tensor(array) -> torch.Tensor:  # bf16 bits (numpy uint16) → bf16, no copy
            return torch.from_numpy(array).view(torch.bfloat16)

        for layer, (key, value) in enumerate(zip(prefill.keys, prefill.values)):
            self._append(layer, tensor(key)[None], tensor(value)[None])
            if self.track and self.n_keys:
                self._scale = key.shape[-1] ** -0.5  # the decoder's, as `attention` got it
                self._last_layer(layer, tensor(prefill.queries[layer]),
                                 torch.from_numpy(prefill.lses[layer]))

    def _append(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Write this forward's KV after the question's so far; returns the filled views."""
        end = self.length + key.shape[2]
        self._grow(layer, end, key.shape, key.dtype, key.device)
        own_k, own_v = self._own[layer]
        own_k[:, :, self.length:end] = key
        own_v[:, :, self.length:end] = value
        return own_k[:, :, :end], own_v[:, :, :end]

    def _grow(self, layer: int, end: int, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> None:
        """Make the own buffers of `layer` (layers come in order) [1, Hkv, capacity, D] hold
        `end` keys, keeping what this question wrote so far; shape: a key's [1, Hkv, *, D]."""
        if len(self._own) > layer and self._own[layer][0].shape[2] >= end:
            return
        shape = (1, shape[1], max(end, self._capacity), shape[3])
        grown = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
        self._forget_words()  # the compiled step's words point at the buffers
        if len(self._own) > layer:  # keep what this question wrote so far
            for new, old in zip(grown, self._own[layer]):
                new[:, :, :self.length] = old[:, :, :self.length]
            self._own[layer] = grown
        else:
            self._own.append(grown)

    def key_mass(self, tokens: Sequence[int]) -> torch.Tensor:
        """[N_h] float64: the attention each shard key received from the answer's rows that
        emitted its own token, as a fraction of all their attention. `tokens`: the answer,
        one token per tracked row.

        Row s picked tokens[s]; it counts only on keys holding that same token id, averaged
        over the answer's tokens, the layers and the query heads: where the answer copied
        its words from. Summed over every worker's keys it is the share of the answer's
        attention that went to copying from the documents (`sources.top_sources` uses it to
        tell a sourced answer from one the model made up or knew). Why this rule:
        on `starqa eval`'s look-alike files (the needle in one of several files of the same
        kind) it put the needle's file first on every correctly answered sample, while the
        raw mass of every key (what this replaced) almost never did. Raw mass rewards what
        attention attends to out of habit whatever it emits (the end of the context, file
        headers, attention sinks); weighting it by value norms, subtracting a baseline
        (the mass from a neutral question, or the answer's mean) or keeping only the
        sharpest heads or the later layers all did worse than matching tokens (measured
        side by side on `eval`'s qa task). It costs one dot product per (row, matching key),
        after the answer, in one batched matmul per distinct token: no pass over the keys
        while decoding. The head gets nothing."""
        mass = torch.zeros(self.n_keys, dtype=torch.float64)
        rows_kept = sum(q.shape[3] for q, _ in self._rows)
        steps = min(len(tokens), rows_kept)
        if self.ids is None or not steps:
            return mass
        emitted = torch.as_tensor(list(tokens[:steps]), dtype=self.ids.dtype)
        ids = self.ids[self.head:]
        # [S, U]: which row emitted the token of which candidate key (U: keys whose token
        # the answer emitted at all, offset by the head).
        where = torch.isin(ids, emitted).nonzero().flatten()
        if not where.numel():
            return mass
        # Only the (row, key) pairs whose tokens match count. The rows that emitted one
        # token all match the same keys: each token is one batched matmul of its rows
        # against its keys, every layer at once (gathering a query per pair made a tensor
        # of pairs x heads x D: at 32K tokens of context attribution took as long as
        # decoding; a matmul per token and layer spent 13% of decode on op overhead at 8K).
        order = torch.argsort(ids[where], stable=True)
        where = where[order]  # the candidates, token by token
        tokens_of = ids[where]
        queries = torch.cat([q.float() for q, _ in self._rows], dim=3)[:, :, :, :steps]
        lses = torch.cat([lse.float() for _, lse in self._rows], dim=3)[:, :, :, :steps]
        # queries [L, Hkv, G, S, D], lses [L, Hkv, G, S]
        layers, kv_heads, groups, _, dim = queries.shape
        queries = queries.mul_(self._scale).view(layers * kv_heads, groups, steps, dim)
        lses = lses.view(layers * kv_heads, groups, steps)
        # candidates in pieces whose keys (every layer, fp32) take at most MASS_BYTES
        piece = max(1, MASS_BYTES // (layers * kv_heads * dim * 4))
        device = queries.device  # the shard's and the rows' (CUDA: the GPU)
        gathered = torch.empty(layers, kv_heads, min(piece, len(where)), dim, device=device)
        blocks = self._block_keys()
        for start in range(0, len(where), piece):
            chosen = where[start:start + piece]
            # [L * Hkv, U, D] fp32, gathered a layer at a time into one buffer and read in
            # place by the matmuls below as [L * Hkv, D, U]
            keys = gathered[:, :, :len(chosen)]
            plan = self._gather_plan(chosen)
            if blocks is not None:  # every layer at once, per piece
                _gather(plan, blocks.__getitem__, keys, 2)
            else:
                for layer in range(layers):
                    _gather(plan, lambda index, layer=layer: self.shard[layer][index][0][0],
                            keys[layer], 1)
            keys = keys.reshape(layers * kv_heads, -1, dim).transpose(1, 2)
            probs = torch.empty(len(chosen))
            runs = torch.unique_consecutive(tokens_of[start:start + piece], return_counts=True)
            first = 0
            for token, count in zip(*(t.tolist() for t in runs)):
                emitters = (emitted == token).nonzero().flatten().to(device)
                q = queries[:, :, emitters].reshape(layers * kv_heads, -1, dim)
                lse = lses[:, :, emitters].reshape(layers * kv_heads, -1, 1)
                # [L * Hkv, G * S_t, U_t]: the token's rows against its keys, every layer
                scores = torch.baddbmm(-lse, q, keys[:, :, first:first + count])
                probs[first:first + count] = scores.exp_().sum(dim=(0, 1)).cpu()
                first += count
            mass.index_add_(0, chosen + self.head, probs.double())
        return mass / (steps * layers * kv_heads * groups)

    def _gather_plan(self, offsets: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where the shard keys at positions head + offsets lie: (piece, the indices of the
        offsets it holds, their rows in it), the same in every layer."""
        positions = self.head + offsets
        if len(self._starts) == 2:
            return [(0, torch.arange(len(positions)), positions)]
        piece = torch.searchsorted(torch.tensor(self._starts[1:]), positions, right=True)
        plan = []
        for index in piece.unique().tolist():
            mine = (piece == index).nonzero().flatten()
            plan.append((index, mine, positions[mine] - self._starts[index]))
        return plan

    def _block_keys(self) -> list[torch.Tensor] | None:
        """Each piece's keys of every layer as one view [L, Hkv, T_i, D], where its layers lie
        evenly spaced in one buffer (a block file's keys [L, Hkv, T, D], as `load_shard` maps
        them), so attribution gathers a piece's keys of all layers in one op; else None.
        Found once (the shard never changes)."""
        if not hasattr(self, "_blocks"):
            self._blocks = self._find_block_keys()
        return self._blocks

    def _find_block_keys(self) -> list[torch.Tensor] | None:
        if self.shard is None or len(self.shard) < 2:
            return None
        views = []
        for index in range(len(self.shard[0])):
            first = self.shard[0][index][0][0]
            size, storage = first.element_size(), first.untyped_storage().data_ptr()
            step = self.shard[1][index][0][0].data_ptr() - first.data_ptr()
            if step <= 0 or step % size or any(
                    layer[index][0][0].untyped_storage().data_ptr() != storage or
                    layer[index][0][0].data_ptr() != first.data_ptr() + i * step or
                    layer[index][0][0].stride() != first.stride() or
                    layer[index][0][0].shape != first.shape
                    for i, layer in enumerate(self.shard)):
                return None
            views.append(first.as_strided((len(self.shard), *first.shape),
                                          (step // size, *first.stride()),
                                          first.storage_offset()))
        return views


def _gather(plan, source, out: torch.Tensor, dim: int) -> None:
    """Write the keys `plan` (`ShardAttention._gather_plan`) locates into `out`: for each
    (piece, indices, rows), rows `rows` of `source(piece)` along `dim` go to `indices`."""
    for index, mine, rows in plan:
        keys = source(index)
        keys = keys.index_select(dim, rows.to(keys.device))
        if len(plan) == 1:
            out.copy_(keys)
        else:
            out.index_copy_(dim, mine.to(out.device), keys.to(out.device, out.dtype))


def _folded(result: tuple[torch.Tensor, torch.Tensor], kv_heads: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`'s (out [1, Hq, M, D], lse [1, Hq, M]) as one part in the folded layout:
    ([1, Hkv, G*M, D], [1, Hkv, G*M])."""
    out, lse = result
    return (out.reshape(1, kv_heads, -1, out.shape[-1]), lse.reshape(1, kv_heads, -1))


@torch.inference_mode()
def generate(decoder, info: dist.DistInfo, hook: ShardAttention, query_ids: Sequence[int],
             start_position: int, max_new_tokens: int, stop_ids: set[int],
             on_token: Callable[[int], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             context_ids: torch.Tensor | None = None,
             draft_tokens: int = DRAFT_TOKENS, prefilled=None) -> list[int]:
    """Greedy generation of up to `max_new_tokens` after `query_ids` (at positions from
    `start_position`). The query host picks the tokens and broadcasts them; it sends a stop
    instead when `should_stop()` (evaluated there only) asks to stop early.

    Drafts (`draft_tokens` > 0): after the question, each forward is the answer's last token
    and up to `draft_tokens` tokens guessed by prompt lookup (starqa.phase2.lookup) in the
    context's ids (`context_ids`, the query host's), the question and the answer so far.
    Every row picks its next token; the guesses are kept up to the first the model did not
    pick, and the pick after the last kept one is the answer's next token, so one forward
    gives 1 to draft_tokens + 1 tokens. On CPU with int8/int4 weights each row's arithmetic
    is that of a one-token forward (`Decoder.forward(rowwise=True)`, the attention kernel
    treats rows alike), so the answer is bit for bit the one without drafts; elsewhere it
    is the same up to rounding.

    prefilled: the question's forward, run already by starqa.coldstart.firsttoken (a cold ask's head
    start, before torch was imported; a world of one on the CPU), whose first token it
    streamed itself: adopted instead of run again, and that token not passed to
    `on_token` a second time."""
    device = decoder.device
    src = info.world_size - 1
    draft_tokens = max(0, draft_tokens)
    drafter = (Drafter(context_ids, query_ids, max_new_tokens)
               if hook.query_host and draft_tokens else None)
    # What the query host broadcasts after each forward (`_pack`), the same on every rank.
    message = (torch.zeros(2 * draft_tokens + 4, dtype=torch.long, device=device)
               if info.world_size > 1 else None)
    ids, drafts, position = list(query_ids), 0, start_position
    generated: list[int] = []
    hook.begin(len(query_ids) + max_new_tokens + draft_tokens)
    hook.track = True
    try:
        streamed: list[int] = []  # the tokens starqa.coldstart.firsttoken streamed already
        while len(generated) < max_new_tokens:
            first = len(ids) - 1 - drafts  # the row that picks the answer's next token
            if prefilled is not None:  # the question's forward, run before torch came
                hook.adopt(prefilled)
                rows = torch.from_numpy(prefilled.hidden).view(decoder.dtype)
                streamed, prefilled = list(prefilled.emitted), None
            else:
                rows = decoder.forward(torch.tensor(ids, device=device),
                                       torch.arange(position, position + len(ids),
                                                    device=device),
                                       hook.attention, rowwise=drafts > 0,
                                       compiled=hook.compiled)[first:]
            picked = None
            if hook.query_host:
                stop = should_stop is not None and should_stop()
                picked = _pick(decoder, rows, ids[first:], drafter, stop_ids,
                               max_new_tokens - len(generated), draft_tokens, stop)
            if info.world_size > 1:  # the query host's picks, to every rank
                if picked is not None:
                    _pack(message, *picked)
                picked = _unpack(dist.broadcast(info, message, src=src))
            tokens, finished, next_drafts = picked
            quiet = len(streamed)  # streamed already: not passed to on_token again
            if tokens[:quiet] != streamed:
                raise RuntimeError(f"the first token computed before torch ({streamed}) is "
                                   f"not the one torch picks ({tokens[:1]})")
            streamed = []
            # The rows before `first` and the len(tokens) from it hold the answer's tokens.
            hook.advance(first + len(tokens), slice(first, first + len(tokens)))
            position += first + len(tokens)
            for index, token in enumerate(tokens):
                generated.append(token)
                if on_token is not None and index >= quiet:
                    on_token(token)
            if finished or not tokens:
                break
            drafts, ids = len(next_drafts), [tokens[-1], *next_drafts]
    finally:
        hook.track = False
    return generated


def _pick(decoder, hidden: torch.Tensor, ids: list[int], drafter: Drafter | None,
          stop_ids: set[int], budget: int, draft_tokens: int, stop: bool
          ) -> tuple[list[int], bool, list[int]]:
    """(Query host) From the last forward's rows that pick tokens, hidden [1 + d, H] for its
    input ids [1 + d] (the answer's last token and d drafts): the answer's next tokens (at
    most `budget`, none from a stop token on), whether the answer is finished, and the
    drafts for the next forward."""
    if stop:
        return [], True, []
    picks = _argmax(decoder.logits(hidden))
    kept = 0  # drafts the model picked itself
    while kept < len(ids) - 1 and picks[kept] == ids[1 + kept]:
        kept += 1
    tokens, finished = picks[:kept + 1][:budget], False
    for i, token in enumerate(tokens):
        if token in stop_ids:
            tokens, finished = tokens[:i], True
            break
    budget -= len(tokens)
    drafts: list[int] = []
    if drafter is not None and not finished and budget > 1:
        drafter.extend(tokens)
        drafts = drafter.propose(min(draft_tokens, budget - 1))
    return tokens, finished or budget < 1, drafts


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first largest logit (a NaN counts as the largest), as torch's argmax and
    starqa.coldstart.firsttoken's numpy one pick it. On the CPU numpy's over the logits widened to
    fp32 (exactly: the same picks): torch's argmax of a bf16 row of 49,152 took ~180 µs of each
    decode token, numpy's ~20."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return np.argmax(logits.float().numpy(), axis=-1).tolist()


def _pack(message: torch.Tensor, tokens: list[int], finished: bool, drafts: list[int]) -> None:
    """`_pick`'s result into the broadcast message [2 D + 4] (D drafted tokens at most):
    [len(tokens), finished, tokens padded to D + 1, len(drafts), drafts padded to D]."""
    room = (len(message) - 4) // 2
    values = [0] * len(message)
    values[0], values[1] = len(tokens), int(finished)
    values[2:2 + len(tokens)] = tokens
    values[3 + room] = len(drafts)
    values[4 + room:4 + room + len(drafts)] = drafts
    message.copy_(torch.tensor(values, dtype=torch.long))


def _unpack(message: torch.Tensor) -> tuple[list[int], bool, list[int]]:
    """`_pack`'s inverse, on every rank: (tokens, finished, drafts)."""
    values, room = message.tolist(), (len(message) - 4) // 2
    at = 4 + room  # the drafts, after their count
    return values[2:2 + values[0]], bool(values[1]), values[at:at + values[at - 1]]
