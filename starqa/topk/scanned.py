"""The index kinds whose keys a row scans itself, flat (every key) and ivf (its nearest
lists), and which the compiled top-k kernel serves (`native.TopKTable`,
starqa/native/_topk.c): the choice between the kernel and torch's and numpy's code, the
kernel's tables (one per layer), the step words for starqa/native/_step.c, and GQA's shared
picks, scored by the keys each kind holds."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from starqa.attention import topk
from starqa.native import ops as native
from starqa.topk.rows import Held
from starqa.topk.shard import Parts, TopKShard, joined, piece_positions, pieces


@dataclass(frozen=True)
class KernelKeys:
    """A layer's keys as `native.TopKTable` takes them (its docstring): keys [(first
    position, [Hkv, T, D])], key_map and key_at (ivf's list order), lists (ivf's centroids,
    offsets and probes), drop (native.DROP_KEYS for mapped keys), tail (ivf's)."""

    keys: list[tuple[int, torch.Tensor]]
    key_map: torch.Tensor | None = None
    lists: tuple[torch.Tensor, torch.Tensor, int] | None = None
    key_at: torch.Tensor | None = None
    drop: int = 0
    tail: tuple[torch.Tensor, torch.Tensor] | None = None


class ScannedShard(TopKShard):
    """A shard whose keys a row scans (flat, ivf): on the CPU one call of the compiled
    kernel per layer (`_parts_compiled`) where it was built, torch's and numpy's code
    otherwise (`TopKShard.parts`); a position's G rows attend over the union of their picks
    (`topk.share`). _tables: per layer, the kernel's `native.TopKTable` or None."""

    def __init__(self, held: Held):
        super().__init__(held)
        self._tables: dict[int, native.TopKTable | None] = {}  # `_table`, per layer
        self._releases: list[torch.Tensor | None] = []  # `step_words`' ranges, per layer

    @property
    @abc.abstractmethod
    def heads(self) -> int:
        """Hkv, the KV heads of the keys."""

    @abc.abstractmethod
    def key_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the keys at the shard rows idx [Hkv, r, k] (-1: row 0's)."""

    @abc.abstractmethod
    def _kernel_keys(self, layer: int, k: int) -> KernelKeys:
        """`layer`'s keys for the kernel's table; k, the layer's budget."""

    def _mapped_files(self) -> list:
        """The memory-mapped files the kernel reads in a layer, whose pages it releases
        after (`tensorfile.MappedTensor`): the keys' (flat on disk), then the values'."""
        return self.values.files()

    # -- Phase 2 ------------------------------------------------------------------------

    def compiles(self, tokens: int, groups: int, question: bool = False) -> bool:
        """Whether `parts`, for a forward of `tokens` positions of `groups` query heads per
        KV head, is one call of the compiled kernel that starqa/native/_step.c can make
        instead (`step_words`): not the question's exact forward or a forward scored in
        pieces. (With --kv-on-disk the step releases each layer's mapped pages itself.)"""
        if question and self.settings.prefill == "exact" or not native.available():
            return False
        # `_parts_compiled`'s pieces: one, for all the forward's positions
        return piece_positions(self.n_keys, self.heads, groups) >= tokens

    def step_words(self, bias: float = 0.0, unbiased: int = 0) -> list[tuple] | None:
        """Per layer the top-k kernel's words for starqa/native/_step.c
        (`native.TopKTable.step_words`: what `parts` passes the kernel where it `compiles`,
        the shard keys' score `bias` and the rows `unbiased` too), or None where a layer has
        no compiled table. With --kv-on-disk each layer's words name its mapped pages,
        which the step releases after the layer's attention (as `_parts_compiled` does)."""
        words, self._releases = [], []  # the ranges the words point to, kept alive here
        mapped = self._mapped_files()
        for layer in range(len(self.budgets)):
            k = self._budget(layer)
            table = self._table_of(layer, k)
            if table is None or table.selects_only:
                return None
            pages = [found for file in mapped if (found := file.pages(layer)) is not None]
            release = torch.tensor(pages, dtype=torch.int64) if pages else None
            self._releases.append(release)
            words.append(table.step_words(max(k, 1), self.n_sink, release, bias, unbiased))
        return words

    def make_tables(self) -> None:
        """Every layer's `_table` made now, where the compiled kernel could use them (a C
        compiler there): a worker makes them as it loads, not on its first answer's first
        decode token (30 tables at 32K: ~7 ms of that token)."""
        if native.available():
            for layer in range(len(self.budgets)):
                self._table_of(layer, self._budget(layer))

    # -- the kernel or torch --------------------------------------------------------------

    def _kernel_table(self, layer: int, k: int) -> native.TopKTable | None:
        """The layer's table where the compiled kernel was built (whatever q's device: it
        runs on the host), else None: torch's and numpy's code."""
        return self._table_of(layer, k) if native.available() else None

    def _parts_compiled(self, layer: int, q: torch.Tensor, k: int, scale: float,
                        tokens: int, own: tuple[torch.Tensor, torch.Tensor] | None,
                        bias: float = 0.0, unbiased: int = 0) -> Parts | None:
        """`parts` on the CPU: per piece of positions one call of the compiled kernel (the
        layer's `native.TopKTable`: each row scans its own lists, or every key, keeps its
        k best in fp32, and a position's G rows attend over their union, the sink and their
        own keys; the shard's keys weigh `bias` more, but its rows below `unbiased`); mapped
        pages of the layer are released after. None where the kernel does not attend here
        (not built, or a table that only selects)."""
        table = self._kernel_table(layer, k)
        if table is None or table.selects_only:
            return None
        k = max(k, 1)
        before = own[0].shape[2] - tokens if own is not None else 0  # own keys before this forward
        found = []
        for start, m, piece in pieces(q, tokens, self.n_keys):
            mine = None if own is None else tuple(x[0, :, :before + start + m] for x in own)
            found.append((m, *table.attend(piece, k, self.n_sink, scale, m, mine, bias,
                                           unbiased)))
        for mapped in self._mapped_files():
            mapped.release(layer)
        out, lse = joined(q, tokens, found)
        return [out], [lse]

    def _shared(self, layer: int, q: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor,
                tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' selections after GQA sharing: each row attends over the union of its
        position's G rows' picks, scored by this shard's keys (`topk.share`)."""
        return topk.share(q, scores, idx, tokens,
                          lambda rows: self.key_rows(layer, rows).to(q.device))

    def _table(self, layer: int, k: int) -> native.TopKTable | None:
        """The kernel's arguments for `layer` (laid out once: the buffers never move), or
        None where the kernel does not take these buffers. k, the layer's budget (fixed for
        the shard: `parts`), sets how many lists ivf probes, so the table is one per layer."""
        keys = self._kernel_keys(layer, k)
        values = self.values.buffers(layer)
        if not native.supports_topk([x for _, x in keys.keys], [x for _, x in values]):
            if not native.supports_topk([x for _, x in keys.keys], []):
                return None
            values = None  # on a GPU: a table that only selects (`select`)
        return native.TopKTable(keys.keys, values, keys.key_map, keys.lists, keys.key_at,
                                keys.drop, keys.tail)

    def _table_of(self, layer: int, k: int) -> native.TopKTable | None:
        """`_table`, made on the layer's first call and kept."""
        if layer not in self._tables:
            self._tables[layer] = self._table(layer, k)
        return self._tables[layer]
