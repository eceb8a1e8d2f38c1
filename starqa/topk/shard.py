"""The top-k shard's interface: what phase2's `ShardAttention` calls on a worker's
blocks under top-k (`parts`, `compiles`, `step_words`, `make_tables`), and the work every
index kind shares: the question's exact forward, the sink, the positions in pieces, and
attention over the rows `select` picks (torch and numpy, wherever the compiled kernel
does not run). Each index kind is a subclass (`flat`, `ivf`, `hnsw`; the kinds the
compiled kernel serves through `scanned.ScannedShard`); `retrieval` picks one from the
settings."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from starqa.attention import topk
from starqa.attention import attend, partial_rows
from starqa.topk.rows import Held

if TYPE_CHECKING:  # annotations only
    from starqa.topk.loading import BlockFiles, Blocks, MeanQueries

ROWS_X_KEYS = 1 << 21  # rows * keys scored at once (a prefill of many rows goes in pieces)

Parts = tuple[list[torch.Tensor], list[torch.Tensor]]


class TopKShard(abc.ABC):
    """A worker's blocks for top-k attention: `Held`'s fields (settings, budgets, n_keys,
    values, sinks, blocks) as attributes, n_sink the sink's rows (shard rows [0, n_sink)),
    and each kind's keys or index. The defaults here are a kind the compiled kernel never
    serves; `scanned.ScannedShard` overrides them."""

    def __init__(self, held: Held):
        self.settings = held.settings
        self.budgets = list(held.budgets)
        self.n_keys = held.n_keys
        self.values = held.values
        self.sinks = held.sinks
        self.n_sink = held.sinks[0][0].shape[2] if held.sinks else 0
        self.blocks = list(held.blocks)

    @classmethod
    @abc.abstractmethod
    def of_parts(cls, held: Held, parts: Blocks, dtype: torch.dtype | None,
                 toward: Sequence[torch.Tensor] | None) -> TopKShard:
        """The shard over blocks' (k, v) [L, Hkv, T, D] in memory, its keys or index built
        here (`retrieval.from_parts`); toward: per layer [Hkv, D] (ivf's list layout)."""

    @classmethod
    @abc.abstractmethod
    def of_cache(cls, held: Held, files: BlockFiles, mean_queries: MeanQueries | None
                 ) -> TopKShard:
        """The shard over a cached context's block files, its keys or index files read
        (`retrieval.from_cache`); mean_queries: ivf's list layout."""

    @abc.abstractmethod
    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scores, idx [Hkv, r, k'] (k' <= k where fewer keys were found or exist): each
        row of q [Hkv, r, D] gets its k best keys of this worker's blocks past the sink;
        idx -1 (score -inf) where none."""

    # -- Phase 2 ------------------------------------------------------------------------

    def parts(self, layer: int, q: torch.Tensor, scale: float, tokens: int | None = None,
              own: tuple[torch.Tensor, torch.Tensor] | None = None, question: bool = False,
              bias: float = 0.0, unbiased: int = 0) -> Parts:
        """The top-k partial attention of folded queries q [1, Hkv, R, D] over this
        worker's blocks in `layer`: parts ([out [1, Hkv, R, D] in q's dtype], [lse [1, Hkv,
        R] fp32]) for `attention.merge`. tokens: the forward's positions M, R = G * M
        (`attention.fold_gqa`): the G query heads of a position share their keys
        (`retrieval`'s docstring); None: M = R, nothing shared. own (the query host, CPU
        only): its own (keys, values) [1, Hkv, L, D], the question and answer so far, the
        last M this forward's, attended causally as part of the result. question: this is
        the question's forward, which TopK.prefill "exact" attends to every key
        (`_parts_exact`). bias: added to every shard key's score but the shard rows below
        `unbiased` (Phase 2's context bias, `methods.ContextBias`: the keys the context
        holds once carry none), never to the own keys'; the picks do not depend on it, and
        the tail's estimate carries it.

        With the compiled kernel, the sink, the retrieved keys and the own keys are one
        call and one part (one softmax); elsewhere a part each."""
        k = self._budget(layer)
        tokens = tokens or q.shape[2]
        unbiased = unbiased if bias else 0  # no bias: nothing to cut
        if question and self.settings.prefill == "exact":
            return self._parts_exact(layer, q, scale, tokens, own, bias, unbiased)
        if q.device.type == "cpu":
            compiled = self._parts_compiled(layer, q, k, scale, tokens, own, bias, unbiased)
            if compiled is not None:
                return compiled
        outs, lses = [], []  # the own keys' part, then the shard's, which carry the bias
        if own is not None:
            out, lse = partial_rows(q[0], own[0][0], own[1][0], scale, tokens)
            outs.append(out[None].to(q.dtype)), lses.append(lse[None])
        if self.sinks is not None:
            sink_keys, sink_values = self.sinks[layer]
            for start, end in _cuts(self.n_sink, unbiased):  # the sink's unbiased rows a part
                out, lse = self._sink_part(q, sink_keys[:, :, start:end],
                                           sink_values[:, :, start:end], scale)
                outs.append(out.to(q.dtype))
                lses.append(lse + (bias if start >= unbiased else 0.0))
            if k < 1:  # the whole shard is the sink
                return outs, lses
        out, lse = joined(q, tokens, [
            (m, *self._part_selected(layer, piece, k, scale, m, bias, unbiased))
            for _, m, piece in pieces(q, tokens, self._width(k))])
        return outs + [out], lses + [lse]

    def compiles(self, tokens: int, groups: int, question: bool = False) -> bool:
        """Whether `parts`, for a forward of `tokens` positions of `groups` query heads per
        KV head, is one call of the compiled kernel that starqa/native/_step.c can make
        instead (`step_words`): here never."""
        return False

    def step_words(self, bias: float = 0.0, unbiased: int = 0) -> list[tuple] | None:
        """Per layer the top-k kernel's words for starqa/native/_step.c (the shard keys'
        score `bias` and the rows `unbiased` among them, as `parts`), or None where a layer
        has no compiled table: here none."""
        return None

    def make_tables(self) -> None:
        """Every layer's compiled-kernel table made now, where the kernel serves this kind:
        here nothing to make."""

    def value_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the value rows idx [Hkv, r, k] selects (-1: row 0's)."""
        return self.values.gather(layer, idx)

    # -- the kinds' hooks -----------------------------------------------------------------

    def _parts_compiled(self, layer: int, q: torch.Tensor, k: int, scale: float,
                        tokens: int, own: tuple[torch.Tensor, torch.Tensor] | None,
                        bias: float = 0.0, unbiased: int = 0) -> Parts | None:
        """`parts` on the CPU by the compiled kernel, or None where it does not run."""
        return None

    def _width(self, k: int) -> int:
        """Keys a row scores at most (`pieces`): up to every key (a prefill's rows choose
        most lists)."""
        return self.n_keys

    def _shared(self, layer: int, q: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor,
                tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' selections after GQA sharing (`topk.share`): here each row keeps its
        own (a kind that holds no keys to score another head's picks with)."""
        return scores, idx

    def _with_tail(self, layer: int, q: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, bias: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows' part with the keys left out merged in, their estimate's
        scores moved by `bias`: here they weigh nothing (top-k alone)."""
        return out, lse

    # -- the work every kind shares -------------------------------------------------------

    def _budget(self, layer: int) -> int:
        """Keys a row retrieves in `layer`: its budget, at most the shard's beyond the sink
        (below 1: the whole shard is the sink)."""
        return min(self.budgets[layer], self.n_keys - self.n_sink)

    @staticmethod
    def _sink_part(q: torch.Tensor, sink_keys: torch.Tensor, sink_values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention of q [1, Hkv, R, D] over rows of the sink (keys and values
        [1, Hkv, S, D]): out [1, Hkv, R, D], lse [1, Hkv, R]."""
        if q.device.type == "cpu":  # exact's kernel: a row's result never depends on the
            # forward's other rows (drafted tokens), as below
            out, lse = partial_rows(q[0], sink_keys[0], sink_values[0], scale)
            return out[None], lse[None]
        return attend(q, sink_keys, sink_values, scale)

    def _parts_exact(self, layer: int, q: torch.Tensor, scale: float, tokens: int,
                     own: tuple[torch.Tensor, torch.Tensor] | None, bias: float = 0.0,
                     unbiased: int = 0) -> Parts:
        """`parts` for the question's forward under TopK.prefill "exact": exact attention
        over every key of this worker's blocks (the sink's too), a part per block (its lse
        moved by `bias`; the shard rows below `unbiased` a part of their own, unmoved),
        each mapped block's layer released after its call (so a shard on disk never holds
        more than a block's layer), then (own) the question's keys, causally."""
        outs, lses, first = [], [], 0  # first: the block's first shard row
        for key, value, release in self.blocks:
            key, value = (x[layer].to(q.device, q.dtype) for x in (key, value))
            for start, end in _cuts(key.shape[-2], unbiased - first):
                out, lse = partial_rows(q[0], key[..., start:end, :], value[..., start:end, :],
                                        scale)
                outs.append(out[None])
                lses.append(lse[None] + (bias if first + start >= unbiased else 0.0))
            first += key.shape[-2]
            if release is not None:
                release(layer)
        if own is not None:
            out, lse = partial_rows(q[0], own[0][0], own[1][0], scale, tokens)
            outs.append(out[None]), lses.append(lse[None])
        return outs, lses

    def _part_selected(self, layer: int, q: torch.Tensor, k: int, scale: float, tokens: int,
                       bias: float = 0.0, unbiased: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`parts`' work where the compiled kernel does not run (hnsw, CUDA, no C compiler):
        `select`, the GQA union (`_shared`), then attention over the selected rows, and
        the keys left out (`_with_tail`), every score moved by `bias` but those of the rows
        below `unbiased`. q [Hkv, G * tokens, D] → (out [1, Hkv, r, D], lse [1, Hkv, r])
        fp32."""
        scores, idx = (t.to(q.device) for t in self.select(layer, q, k))
        scores, idx = self._shared(layer, q, scores, idx, tokens)
        if bias:  # raw scores: the bias over the scale
            scores = scores.float() + (idx >= unbiased).float() * (bias / scale)
        values = self.value_rows(layer, idx).to(q.device)
        if q.device.type != "cpu":
            out, lse = topk.attend_selected(scores, idx, values, scale)
        else:  # numpy: cheaper per call (`topk.attend_rows`)
            width = scores.shape[-1]
            masked = scores.masked_fill(idx < 0, float("-inf")).reshape(-1, width)
            out, lse = topk.attend_rows(masked.numpy(), values.float().numpy().reshape(
                -1, width, values.shape[-1]), scale)
            out, lse = (torch.from_numpy(out).view(1, *q.shape),
                        torch.from_numpy(lse).view(1, *q.shape[:2]))
        return self._with_tail(layer, q, idx, out, lse, scale, bias)


def _cuts(n: int, at: int) -> list[tuple[int, int]]:
    """Rows [0, n) as (start, end) ranges cut at `at` where it falls inside: the rows
    below a context bias's `unbiased` a range of their own."""
    return [(0, at), (at, n)] if 0 < at < n else [(0, n)]


def pieces(q: torch.Tensor, tokens: int, width: int):
    """Folded queries q [1, Hkv, G * M, D] in pieces of positions, each scoring at most
    ROWS_X_KEYS keys (`width` per row) at once (a prefill of many rows): (first position,
    positions m, piece [Hkv, G * m, D])."""
    _, heads, rows, dim = q.shape
    groups = rows // tokens
    step = piece_positions(width, heads, groups)
    if step >= tokens:
        yield 0, tokens, q[0]
        return
    by_token = q[0].view(heads, groups, tokens, dim)
    for start in range(0, tokens, step):
        piece = by_token[:, :, start:start + step].reshape(heads, -1, dim)
        yield start, piece.shape[1] // groups, piece


def piece_positions(width: int, heads: int, groups: int) -> int:
    """Positions a piece of `pieces` holds: their rows score at most ROWS_X_KEYS keys."""
    return max(1, ROWS_X_KEYS // (width * heads * groups))


def joined(q: torch.Tensor, tokens: int, found) -> tuple[torch.Tensor, torch.Tensor]:
    """The results of `pieces`' pieces [(positions m, out [(1,) Hkv, G * m, D], lse [(1,)
    Hkv, G * m])], in order, as one part of folded queries q [1, Hkv, G * M, D]: out [1,
    Hkv, G * M, D] in q's dtype and lse [1, Hkv, G * M]."""
    _, heads, rows, dim = q.shape
    groups = rows // tokens
    outs = [out.to(q.dtype).view(heads, groups, m, dim) for m, out, _ in found]
    lses = [lse.view(heads, groups, m) for m, _, lse in found]
    if len(found) == 1:
        return outs[0].view(1, heads, rows, dim), lses[0].view(1, heads, rows)
    return (torch.cat(outs, dim=2).view(1, heads, rows, dim),
            torch.cat(lses, dim=2).view(1, heads, rows))
