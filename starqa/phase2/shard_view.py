"""The shard view: the cached blocks' keys and values one Phase 2 worker attends over, laid
out once for the kernels, and the shard's part of a layer's attention.

A worker's shard never changes while it answers: its layout (the CPU kernel's tables, one
buffer a layer elsewhere), where each block's piece starts and which keys are the template's
head are found here once. `ShardAttention` composes it with the own-KV buffers
(`starqa.phase2.own_kv`) and the layer call (`starqa.phase2.layer_attention`).
"""

from __future__ import annotations

from functools import cached_property

import torch

from starqa.attention import Pieces, attend, fold_result, fused_available, partial_chunks
from starqa.attention.copymass import GatherPlan, gather_rows
from starqa.attention.kvint8 import attend_int8, cat_rows, is_int8
from starqa.native import ops as native

SLOT = 128  # shard keys per fused kernel call on CUDA (attention.partial_chunks)

# per layer the pieces (k, v), each [1, Hkv, T_i, D], in block order
Shard = list[list[tuple[torch.Tensor, torch.Tensor]]]


class ShardView:
    """This worker's blocks as the kernels read them.

    shard: per layer the pieces (k, v), each [1, Hkv, T_i, D], that hold this worker's
    blocks in order, in the compute dtype (`starqa.cache.shards.load_shard`: on the CPU a
    piece per block, memory-mapped where it lies; elsewhere one), or None for no blocks (a
    worker without blocks, or top-k attention, which holds its own); int8 KV: each k and v
    an `attention.kvint8.Int8Rows` standing for the compute dtype, attended without a
    dequantised copy. head: the keys before the first document (template, system prompt),
    which are never a source. bias: added to the score of every shard key but the first
    `unbiased` (Phase 2's context bias, `methods.ContextBias`, on this shard: the keys
    before the shared positions carry none): the parts `parts` returns carry it, and on the
    CPU the kernel's tables (`Pieces`) do, the own keys going in with none.
    """

    def __init__(self, shard: Shard | None, head: int = 0, bias: float = 0.0,
                 unbiased: int = 0):
        self.cpu = shard is not None and shard[0][0][0].device.type == "cpu"
        if shard is not None and not self.cpu:  # the fused kernels take one buffer a layer
            shard = [pieces if len(pieces) == 1 else
                     [tuple(cat_rows([p[i] for p in pieces], dim=2) for i in (0, 1))]
                     for pieces in shard]
        self.int8 = shard is not None and is_int8(shard[0][0][0])
        self.shard = shard
        self.bias, self.unbiased = bias, unbiased if bias else 0
        # (CPU) each layer's pieces as the kernel reads them, laid out once
        self.pieces = [Pieces([(k[0], v[0]) for k, v in layer], bias, unbiased)
                       for layer in shard] if self.cpu else None
        # where each piece starts among the shard's keys, then the shard's length
        self.starts = [0]
        for k, _ in shard[0] if shard else ():
            self.starts.append(self.starts[-1] + k.shape[2])
        self.n_keys = self.starts[-1]
        self.head = min(head, self.n_keys)
        self.fused = shard is not None and not self.int8 and fused_available(shard[0][0][0])

    def dtype(self, layer: int) -> torch.dtype:
        """The dtype the shard's keys of `layer` are held in (the shard part's compute
        dtype)."""
        return self.shard[layer][0][0].dtype

    def parts(self, layer: int, query: torch.Tensor, q: torch.Tensor, scale: float,
              own: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The shard's partial attentions in `layer`, in `partial_chunks`' part layout
        (outs [P, Hkv, R, D], lses [P, Hkv, R]): query [1, Hq, M, D] and its folded rows q
        [1, Hkv, R = G*M, D] (`fold_gqa`). On the CPU one kernel call over the blocks'
        pieces and, given `own` (the question's KV so far (k, v) [1, Hkv, N, D], its last M
        this forward's, seen causally), over those too; elsewhere the shard alone: a fused
        call per SLOT keys (the head its own part), or one exact part (int8 KV: dequantised
        a chunk at a time, `kvint8.attend_int8`), the first `unbiased` keys a part of their
        own. The shard's keys carry `bias` (not its first `unbiased`), the own keys none."""
        if self.cpu:
            if own is None:
                out, lse = self.pieces[layer].attend(q[0], scale=scale)
            else:
                keys, values = own
                out, lse = self.pieces[layer].attend(q[0], keys[0], values[0], scale,
                                                     query.shape[2])
            return [out[None]], [lse[None]]
        key, value = self.shard[layer][0]
        cut = min(self.unbiased, key.shape[2])
        outs, lses = self._parts(query, q, key[:, :, cut:], value[:, :, cut:], scale,
                                 max(self.head - cut, 0)) if cut < key.shape[2] else ([], [])
        if self.bias:
            lses = [lse + self.bias for lse in lses]
        if cut:  # the keys before the shared positions: a part with no bias
            head_outs, head_lses = self._parts(query, q, key[:, :, :cut], value[:, :, :cut],
                                               scale, 0)
            outs, lses = head_outs + outs, head_lses + lses
        return outs, lses

    def _parts(self, query: torch.Tensor, q: torch.Tensor, key, value, scale: float,
               head: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(Not the CPU) `parts` over key/value [1, Hkv, N, D] (N >= 1), with no bias: a
        fused call per SLOT keys (the first `head` their own part), or one exact part."""
        if self.fused:
            return partial_chunks(q, key, value, scale, SLOT, head)
        if self.int8:
            out, lse = attend_int8(q[0], key[0], value[0], scale)
            return [out[None]], [lse[None]]
        # no fused kernel here: one exact part
        out, lse = fold_result(*attend(query, key, value, scale), q.shape[1])
        return [out], [lse]

    def step_words(self, dtype: torch.dtype) -> list[tuple[int, tuple[int, ...]]] | None:
        """(CPU) Per layer the exact kernel's kind and words for starqa/native/_step.c
        (`native.Layout.step_words`); None where a layer has no compiled table or the
        shard's dtype is not the model's `dtype`."""
        layouts = [pieces.layout for pieces in self.pieces]
        if any(lay is None or lay.dtype not in (None, dtype) for lay in layouts):
            return None
        return [(native.STEP_EXACT, lay.step_words()) for lay in layouts]

    def gather_keys(self, offsets: torch.Tensor, out: torch.Tensor) -> None:
        """Write the keys at positions head + offsets [U] of every layer into out
        [L, Hkv, U, D]: a piece's keys of all layers in one op where its layers lie in one
        buffer (`block_keys`), else a layer at a time."""
        plan = self._gather_plan(offsets)
        blocks = self.block_keys
        if blocks is not None:
            gather_rows(plan, blocks.__getitem__, out, 2)
            return
        for layer in range(len(self.shard)):
            gather_rows(plan, lambda index, layer=layer: self.shard[layer][index][0][0],
                        out[layer], 1)

    def _gather_plan(self, offsets: torch.Tensor) -> GatherPlan:
        """Where the shard keys at positions head + offsets lie: (piece, the indices of the
        offsets it holds, their rows in it), the same in every layer."""
        positions = self.head + offsets
        if len(self.starts) == 2:
            return [(0, torch.arange(len(positions)), positions)]
        piece = torch.searchsorted(torch.tensor(self.starts[1:]), positions, right=True)
        plan = []
        for index in piece.unique().tolist():
            mine = (piece == index).nonzero().flatten()
            plan.append((index, mine, positions[mine] - self.starts[index]))
        return plan

    @cached_property
    def block_keys(self) -> list[torch.Tensor] | None:
        """Each piece's keys of every layer as one view [L, Hkv, T_i, D], where its layers
        lie evenly spaced in one buffer (a block file's keys [L, Hkv, T, D], as `load_shard`
        maps them), so attribution gathers a piece's keys of all layers in one op; else
        None. Found once (the shard never changes)."""
        if self.shard is None or len(self.shard) < 2 or self.int8:  # int8: a layer at a time
            return None
        views = []
        for index in range(len(self.shard[0])):
            view = self._layers_of(index)
            if view is None:
                return None
            views.append(view)
        return views

    def _layers_of(self, index: int) -> torch.Tensor | None:
        """Piece `index`'s keys of every layer as one strided view, or None where its
        layers do not lie evenly spaced in one buffer."""
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
        return first.as_strided((len(self.shard), *first.shape), (step // size, *first.stride()),
                                first.storage_offset())
