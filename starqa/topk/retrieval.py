"""Phase 2's top-k part on one worker: its blocks' keys (flat) or faiss indexes (ivf,
hnsw), its values (in memory, or memory-mapped from the shard files with --kv-on-disk),
and `parts`, which `decode.ShardAttention` calls in place of exact attention over a shard.

The question's own forward attends to every key of the worker's blocks, exactly (TopK.prefill
"exact", the default): the paper retrieves top-k keys for the generated tokens, over a
cache the whole prompt was prefilled into; with SmolLM2 at 1% the question's rows, left to
their k keys, lost needles that exact attention found (docs/topk.md). Its KV
and its answer's are the query host's own, attended exactly as ever. "topk" gives the
question's rows their k keys too (a sooner first token on a huge context).

The worker holding the context's first block also attends exactly to its first
`TopK.sink` tokens (StreamingLLM's attention sinks: the template and system prompt, where
much of every head's attention mass rests), in addition to the k keys it retrieves from
the rest; the sink is a part of its own for the LSE merge, and the retrieval never returns
its rows, so every key is counted once and k >= the shard is still exact.

GQA: the G query heads of a KV head share what they retrieve at each position (each
picks its k keys, each attends over the union of the G picks: `topk.share`), except under
hnsw, which holds no keys to score another head's picks with (its rows attend to their
own k).

ivf's tail (`TopK.tail` "lists", the default; `topk`'s docstring): the keys outside a
position's union count in its softmax by their lists, each list's as many copies of its
centre holding its mean value (`IvfLayer.tail`), so no list's weight is missing. In the
compiled kernel, or `topk.tail_part` beside `_part_selected`'s attention.

On the CPU, flat and ivf attend through starqa's compiled top-k kernel (`native.topk_attend`,
starqa/native/_topk.c): one call per layer scores each row's keys exactly in fp32, keeps its k
best, shares them and attends; a position's result never depends on the forward's other
positions (drafted tokens are checked as extra positions). hnsw, CUDA, and machines where
the kernel was not built take the torch/numpy/faiss code below, which selects the same
keys up to a bf16 ranking's near-ties at the k-th place.

Each worker retrieves k keys per query row from its own blocks, so the union over workers
holds the context's global top k; `attention.merge` then combines the parts exactly, as
for exact attention. Scores are exact fp32 inner products with the cache's keys (flat
recomputes them, see `topk.select_exact`; ivf stores the keys in the cache's dtype,
hnsw in fp32), and only the selected value rows are read. Source attribution needs every
key's share of the attention, which top-k never computes: answers under top-k name no
sources.

What each kind holds per layer (N: the worker's keys, Hkv KV heads):

    flat   the keys [Hkv, N, D] in the compute dtype; with --kv-on-disk, none: each
           block's keys are memory-mapped, scanned a layer at a time and that layer's pages
           released (every key is still read, from the page cache)
    ivf    every KV head's IVF lists over all the worker's blocks (`IvfLayer`: the
           blocks' lists, their keys in list order in the cache's dtype, their centres
           [Hkv, C, D]: each list's mean key, bf16 values; the lists laid out by a mean
           query, `starqa.topk.listlayout`, so a row's lie near each other; with the tail, each
           list's mean value [Hkv, C, D] bf16 and each row's list [Hkv, N] int32). A row
           ranks its KV head's C centres, picks its nearest lists (`indexes.row_probes`: about
           IVF_ROW_SCAN * k keys, at least IVF_MIN_PROBES lists) and keeps the k best of
           their keys (`native.topk_attend`, one call per layer; on a GPU the same
           selection, `native.TopKTable.select`, on the host; numpy's `_select_ivf` where
           no kernel was built).
    hnsw   each block's faiss HNSW index per KV head (a graph is not merged), searched one
           block at a time; the worker keeps the k best of the blocks' k best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

import torch

from starqa.topk import indexes
from starqa.native import ops as native
from starqa.core import tensorfile
from starqa.attention import topk
from starqa.attention import attend, merge, partial_rows
from starqa.core.errors import StarqaError
from starqa.topk.indexes import TopK
from starqa.topk.listlayout import list_order
from starqa.cache.manifest import Manifest, block_file

ROWS_X_KEYS = 1 << 21  # rows * keys scored at once (a prefill of many rows goes in pieces)
SCAN_STEP = 512  # ivf scans a multiple of this many keys per KV head (see _select_ivf)


class TopKShard:
    """A worker's blocks for top-k attention.

    keys: per layer [Hkv, N, D] in the compute dtype (flat), else None. ivf: per layer
    an `IvfLayer`, else None (its selections' ids are head * N + row). searchers (hnsw):
    per layer, per KV head, [(first row in the shard, a block's faiss index)], else None.
    values: per layer [Hkv, N, D] (in memory), or
    mapped_values: per block (first row, its values `tensorfile.MappedTensor`); mapped_keys
    likewise for flat with --kv-on-disk. budgets: keys per row in each layer
    (`topk.layer_budgets`). sinks: per layer (keys, values) [1, Hkv, S, D] fp32, the
    context's first S tokens, on the worker that holds them, else None. blocks: per block
    in order (k, v [L, Hkv, T, D], in memory or memory-mapped, and a function that releases
    a layer's pages, or None), read by the question's exact forward only."""

    def __init__(self, settings: TopK, budgets: Sequence[int], n_keys: int, keys=None,
                 ivf=None, searchers=None, values=None, mapped_values=None,
                 sinks=None, mapped_keys=None, blocks=()):
        self.settings = settings
        self.budgets = list(budgets)
        self.n_keys = n_keys
        self.sinks = sinks
        self.n_sink = sinks[0][0].shape[2] if sinks else 0  # shard rows [0, n_sink)
        self.keys = keys
        self.ivf = ivf
        self.searchers = searchers
        self.values = values
        self.mapped_values = mapped_values
        self.mapped_keys = mapped_keys
        self.blocks = list(blocks)
        self.pool = None
        self._tables: dict[int, native.TopKTable | None] = {}  # `_table`, per layer
        self._releases: list[torch.Tensor | None] = []  # `step_words`' ranges, per layer
        if searchers and torch.get_num_threads() > 1:
            import faiss

            # hnsw: one search per block and KV head, run side by side (faiss releases the
            # GIL), each on one thread: a search is a few rows, too small to split. The
            # setting is made in the pool's threads only: OpenMP's is per thread, and
            # faiss's call sets torch's too (one OpenMP runtime in the process), so made on
            # the caller's thread it would leave the whole decode, model included, on one
            # core (it did: ivf decoded at 32K single-threaded).
            self.pool = ThreadPoolExecutor(torch.get_num_threads(),
                                           initializer=faiss.omp_set_num_threads,
                                           initargs=(1,))

    @classmethod
    def from_parts(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], settings: TopK,
                   n_tokens: int, dtype: torch.dtype | None = None, first: bool = True,
                   toward: Sequence[torch.Tensor] | None = None) -> TopKShard | None:
        """From blocks' (k, v), each [L, Hkv, T, D], in memory, building any index here
        (`starqa eval`, tests); first: they begin with the context's first block (the
        sink's). Values, flat's keys and the sink stay on the blocks' device; ivf and hnsw
        search on the CPU (faiss). toward: per layer [Hkv, D], what ivf lays its lists out
        by (`listlayout.mean_queries`), else as built. None when there are no blocks."""
        if not parts:
            return None
        layers, heads = parts[0][0].shape[:2]
        device = parts[0][0].device
        keys = ivf = searchers = None
        if settings.index == "flat":
            keys = _per_layer([k for k, _ in parts], dtype, device)
        else:
            def index_of(block: int, layer: int, head: int):
                return indexes.build(settings.index,
                                     parts[block][0][layer, head].float().cpu().numpy())

            if settings.index == "ivf":
                ivf = [IvfLayer.of([k[layer].cpu() for k, _ in parts], index_of, layer, dtype,
                                   None if toward is None else toward[layer],
                                   [v[layer].cpu() for _, v in parts] if settings.tails else None)
                       for layer in range(layers)]
            else:
                searchers = _per_block(_starts([k.shape[2] for k, _ in parts]), layers, heads,
                                       index_of)
        n = sum(k.shape[2] for k, _ in parts)
        budgets = topk.layer_budgets(settings.keys(n_tokens), layers, settings.schedule)
        return cls(settings, budgets, n, keys, ivf, searchers,
                   _per_layer([v for _, v in parts], dtype, device),
                   sinks=_sinks(*parts[0], settings.sink, device) if first else None,
                   blocks=[(k, v, None) for k, v in parts])

    @classmethod
    def from_cache(cls, manifest: Manifest, blocks: Sequence[int], settings: TopK,
                   dtype: torch.dtype, device: torch.device,
                   mean_queries: Callable[[torch.Tensor], Sequence[torch.Tensor] | None]
                   | None = None
                   ) -> TopKShard | None:
        """This worker's blocks of a cached context, every file checksum-verified: the
        shards (as `load_shard` does) and, for ivf and hnsw, the index files.
        mean_queries: given token ids, per layer [Hkv, D] (`listlayout.mean_queries`): ivf
        lays its lists out by those of the worker's first block's ids, else as built."""
        from starqa.cache.shards import verify_checksums

        if not blocks:
            return None
        verify_checksums(manifest, blocks, contents=True)
        paths = [manifest.folder / block_file(b) for b in blocks]
        layers, heads = tensorfile.block_shape(paths[0])[:2]
        starts = _starts([tensorfile.block_shape(path)[2] for path in paths])
        keys = ivf = searchers = values = mapped = mapped_keys = None
        # every block's keys and values, mapped (nothing is read until used): the
        # question's exact forward, the sink, and with --kv-on-disk what Phase 2 reads
        maps = [tuple(tensorfile.MappedTensor(p, name) for name in ("k", "v")) for p in paths]
        if settings.kv_on_disk:
            mapped = [(start, value) for (_, value), start in zip(maps, starts)]
        else:  # read first: ivf's tail takes its lists' mean values from these
            values = _read_per_layer(paths, "v", layers, dtype, device)
        if settings.index == "flat" and settings.kv_on_disk:
            mapped_keys = [(start, key) for (key, _), start in zip(maps, starts)]
        elif settings.index == "flat":
            keys = _read_per_layer(paths, "k", layers, dtype, device)
        else:
            found = indexes.find_set(manifest, settings.index)
            if found is None:
                raise StarqaError(
                    f"Context {manifest.name!r} has no {settings.index} indexes.",
                    hint=f"build them: {indexes.rebuild_command(manifest, settings.index)}")
            files = {(e.block, e.layer, e.head): e.file for e in found.files}
            indexes.verify(manifest, found, blocks)
            where = manifest.folder / found.folder

            def index_of(block: int, layer: int, head: int, mapped: bool = settings.kv_on_disk):
                return indexes.read_index(where / files[(blocks[block], layer, head)], mapped)

            if settings.index == "ivf":
                toward = None if mean_queries is None else mean_queries(
                    tensorfile.read_tensor(paths[0], "ids", mapped=True))
                def values_of(layer: int):  # the tail's: the values read above, once
                    if not settings.tails:
                        return None
                    if values is not None:
                        return [values[layer].cpu()]
                    return [tensorfile.read_layer(p, "v", layer) for p in paths]

                # The blocks' files are read mapped (only their lists are used: which list
                # each key went to), the keys one layer at a time.
                ivf = [IvfLayer.of([tensorfile.read_layer(p, "k", layer) for p in paths],
                                   lambda b, lay, h: index_of(b, lay, h, True), layer, dtype,
                                   None if toward is None else toward[layer], values_of(layer))
                       for layer in range(layers)]
            else:
                searchers = _per_block(starts, layers, heads, index_of)
        budgets = topk.layer_budgets(settings.keys(manifest.n_tokens), layers,
                                     settings.schedule)
        releases = [lambda layer, k=k, v=v: (k.release(layer), v.release(layer)) for k, v in maps]
        sinks = None
        if blocks[0] == 0:
            sinks = _sinks(maps[0][0].tensor, maps[0][1].tensor, settings.sink, device,
                           releases[0])
        return cls(settings, budgets, starts[-1], keys, ivf, searchers, values, mapped,
                   sinks=sinks, mapped_keys=mapped_keys,
                   blocks=[(k.tensor, v.tensor, release)
                           for (k, v), release in zip(maps, releases)])

    # -- Phase 2 ------------------------------------------------------------------------

    def parts(self, layer: int, q: torch.Tensor, scale: float, tokens: int | None = None,
              own: tuple[torch.Tensor, torch.Tensor] | None = None, question: bool = False
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The top-k partial attention of folded queries q [1, Hkv, R, D] over this
        worker's blocks in `layer`: parts ([out [1, Hkv, R, D] in q's dtype], [lse [1, Hkv,
        R] fp32]) for `attention.merge`. tokens: the forward's positions M, R = G * M
        (`attention.fold_gqa`): the G query heads of a position share their keys (module
        docstring); None: M = R, nothing shared. own (the query host, CPU only): its own
        (keys, values) [1, Hkv, L, D], the question and answer so far, the last M this
        forward's, attended causally as part of the result. question: this is the question's
        forward, which TopK.prefill "exact" attends to every key (`_parts_exact`).

        With the compiled kernel, the sink, the retrieved keys and the own keys are one
        call and one part (one softmax); elsewhere a part each."""
        k = self._budget(layer)
        tokens = tokens or q.shape[2]
        if question and self.settings.prefill == "exact":
            return self._parts_exact(layer, q, scale, tokens, own)
        native_ok = q.device.type == "cpu" and self.searchers is None and native.available()
        table = self._table_of(layer, k) if native_ok else None
        if table is not None and not table.selects_only:
            return self._parts_native(layer, q, max(k, 1), scale, tokens, own)
        outs, lses = [], []
        if own is not None:
            out, lse = partial_rows(q[0], own[0][0], own[1][0], scale, tokens)
            outs.append(out[None].to(q.dtype)), lses.append(lse[None])
        if self.sinks is not None:
            sink_keys, sink_values = self.sinks[layer]
            if q.device.type == "cpu":  # exact's kernel: a row's result never depends on
                # the forward's other rows (drafted tokens), as below
                out, lse = partial_rows(q[0], sink_keys[0], sink_values[0], scale)
                out, lse = out[None], lse[None]
            else:
                out, lse = attend(q, sink_keys, sink_values, scale)
            outs.append(out.to(q.dtype))
            lses.append(lse)
            if k < 1:  # the whole shard is the sink
                return outs, lses
        # flat and ivf score up to every key per row (a prefill's rows choose most lists),
        # hnsw k: positions go in pieces of at most ROWS_X_KEYS scores
        width = k if self.searchers is not None else self.n_keys
        out, lse = _joined(q, tokens, [(m, *self._part_selected(layer, piece, k, scale, m))
                                       for _, m, piece in _pieces(q, tokens, width)])
        return outs + [out], lses + [lse]

    def compiles(self, tokens: int, groups: int, question: bool = False) -> bool:
        """Whether `parts`, for a forward of `tokens` positions of `groups` query heads per
        KV head, is one call of the compiled kernel that starqa/native/_step.c can make instead
        (`step_words`): not the question's exact forward, hnsw or a forward scored in
        pieces. (With --kv-on-disk the step releases each layer's mapped pages itself.)"""
        if (question and self.settings.prefill == "exact" or self.searchers is not None
                or not native.available()):
            return False
        heads = self.ivf[0].centroids.shape[0] if self.ivf is not None else \
            self.keys[0].shape[0] if self.keys is not None else \
            self.mapped_keys[0][1].tensor.shape[1] if self.mapped_keys else None
        # `_parts_native`'s pieces: one, for all the forward's positions
        return heads is not None and _piece_positions(self.n_keys, heads, groups) >= tokens

    def step_words(self) -> list[tuple[int, ...]] | None:
        """Per layer the top-k kernel's words for starqa/native/_step.c
        (`native.TopKTable.step_words`: what `parts` passes the kernel where it `compiles`), or
        None where a layer has no compiled table. With --kv-on-disk each layer's words name its
        mapped pages, which the step releases after the layer's attention (as `_parts_native`
        does)."""
        words, self._releases = [], []  # the ranges the words point to, kept alive here
        mapped = (self.mapped_keys or []) + (self.mapped_values or [])
        for layer in range(len(self.budgets)):
            k = self._budget(layer)
            table = self._table_of(layer, k)
            if table is None or table.selects_only:
                return None
            pages = [found for _, file in mapped if (found := file.pages(layer)) is not None]
            release = torch.tensor(pages, dtype=torch.int64) if pages else None
            self._releases.append(release)
            words.append(table.step_words(max(k, 1), self.n_sink, release))
        return words

    def _parts_exact(self, layer: int, q: torch.Tensor, scale: float, tokens: int,
                     own: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`parts` for the question's forward under TopK.prefill "exact": exact attention
        over every key of this worker's blocks (the sink's too), a part per block, each
        mapped block's layer released after its call (so a shard on disk never holds more
        than a block's layer), then (own) the question's keys, causally."""
        outs, lses = [], []
        for key, value, release in self.blocks:
            out, lse = partial_rows(q[0], *(x[layer].to(q.device, q.dtype) for x in (key, value)),
                                    scale)
            outs.append(out[None]), lses.append(lse[None])
            if release is not None:
                release(layer)
        if own is not None:
            out, lse = partial_rows(q[0], own[0][0], own[1][0], scale, tokens)
            outs.append(out[None]), lses.append(lse[None])
        return outs, lses

    def _parts_native(self, layer: int, q: torch.Tensor, k: int, scale: float, tokens: int,
                      own: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`parts` for flat and ivf on the CPU: per piece of positions one call of the
        compiled kernel (the layer's `native.TopKTable`: each row scans its own lists, or
        every key, keeps its k best in fp32, and a position's G rows attend over their
        union, the sink and their own keys). Mapped pages of the layer are released after."""
        table = self._tables[layer]
        before = own[0].shape[2] - tokens if own is not None else 0  # own keys before this forward
        found = []
        for start, m, piece in _pieces(q, tokens, self.n_keys):
            mine = None if own is None else tuple(x[0, :, :before + start + m] for x in own)
            found.append((m, *table.attend(piece, k, self.n_sink, scale, m, mine)))
        for _, mapped in (self.mapped_keys or []) + (self.mapped_values or []):
            mapped.release(layer)
        out, lse = _joined(q, tokens, found)
        return [out], [lse]

    def _part_selected(self, layer: int, q: torch.Tensor, k: int, scale: float, tokens: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`parts`' work where the compiled kernel does not run (hnsw, CUDA, no C compiler):
        `select`, the GQA union (`topk.share`; hnsw keeps no keys to score another head's
        picks with, so its rows attend to their own), then attention over the selected
        rows, and under ivf with the tail, the tail's part merged in. q [Hkv, G * tokens, D]
        → (out [1, Hkv, r, D], lse [1, Hkv, r]) fp32."""
        scores, idx = (t.to(q.device) for t in self.select(layer, q, k))
        if self.searchers is None:
            scores, idx = topk.share(q, scores, idx, tokens,
                                     lambda rows: self.key_rows(layer, rows).to(q.device))
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
        lay = self.ivf[layer] if self.ivf is not None else None
        if lay is None or lay.tail is None:
            return out, lse
        # the tail (`topk.tail_part`), computed on the CPU where the lists are
        import numpy as np

        left = topk.lists_left(idx.cpu(), lay.list_of, torch.from_numpy(np.diff(lay.offsets)),
                               self.n_sink)
        centre = torch.matmul(q.float().cpu(), torch.from_numpy(lay.centroids).transpose(1, 2))
        rest, rest_lse = topk.tail_part(centre, left, lay.tail, scale)
        return merge([out.float(), rest.to(out.device)], [lse, rest_lse.to(lse.device)])

    def _table(self, layer: int, k: int) -> native.TopKTable | None:
        """The kernel's arguments for `layer` (laid out once: the buffers never move), or
        None where the kernel does not take these buffers. k, the layer's budget (fixed for
        the shard: `parts`), sets how many lists ivf probes, so the table is one per layer."""
        key_map = key_at = lists = tail = None
        drop = 0  # the kernel may drop the keys' pages as it scans: mapped keys only
        if self.keys is not None:
            keys = [(0, self.keys[layer])]
        elif self.mapped_keys is not None:
            keys = [(start, mapped.tensor[layer]) for start, mapped in self.mapped_keys]
            drop = native.DROP_KEYS
        else:
            lay = self.ivf[layer]
            keys = [(0, lay.keys)]
            key_map, key_at = torch.from_numpy(lay.rows), torch.from_numpy(lay.at)
            n_lists = lay.centroids.shape[1]
            lists = (torch.from_numpy(lay.centroids), torch.from_numpy(lay.offsets),
                     indexes.row_probes(self.n_keys, n_lists, k))
            tail = None if lay.tail is None else (lay.tail, lay.list_of)
        if self.values is not None:
            values = [(0, self.values[layer])]
        else:
            values = [(start, mapped.tensor[layer]) for start, mapped in self.mapped_values]
        if not native.supports_topk([x for _, x in keys], [x for _, x in values]):
            if not native.supports_topk([x for _, x in keys], []):
                return None
            values = None  # on a GPU: a table that only selects (`select`)
        return native.TopKTable(keys, values, key_map, lists, key_at, drop, tail)

    def _budget(self, layer: int) -> int:
        """Keys a row retrieves in `layer`: its budget, at most the shard's beyond the sink
        (below 1: the whole shard is the sink)."""
        return min(self.budgets[layer], self.n_keys - self.n_sink)

    def make_tables(self) -> None:
        """Every layer's `_table` made now, where the compiled kernel could use them (not
        hnsw; a C compiler there): a worker makes them as it loads, not on its first answer's
        first decode token (30 tables at 32K: ~7 ms of that token)."""
        if self.searchers is None and native.available():
            for layer in range(len(self.budgets)):
                self._table_of(layer, self._budget(layer))

    def _table_of(self, layer: int, k: int) -> native.TopKTable | None:
        """`_table`, made on the layer's first call and kept."""
        if layer not in self._tables:
            self._tables[layer] = self._table(layer, k)
        return self._tables[layer]

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scores, idx [Hkv, r, k'] (k' <= k where fewer keys were found or exist): each
        row's k best keys of this worker's blocks past the sink; idx -1 (score -inf) where
        none."""
        sink = self.n_sink
        if self.keys is not None:
            return topk.select_exact(q, self.keys[layer], k, sink)
        table = self._table_of(layer, k) if self.searchers is None and native.available() \
            else None
        if table is not None:  # ivf, or flat's keys on disk: the compiled kernel ranks them
            # on the CPU whatever q's device (on an H100's host numpy's ranking of ivf's
            # lists took ~74 ms a layer at 128K), as it does for `_parts_native`
            scores, rows = table.select(q, k, sink)
            for _, mapped in self.mapped_keys or []:
                mapped.release(layer)
            return scores, rows
        if self.mapped_keys is not None:
            return self._select_mapped(layer, q, k)
        if self.ivf is not None:
            scores, ids = self._select_ivf(layer, q, k)
            return (torch.from_numpy(scores).view(*q.shape[:2], -1),
                    torch.from_numpy(self._rows_of(ids, q.shape[1])).view(*q.shape[:2], -1))
        import numpy as np

        x = np.ascontiguousarray(q.float().cpu().numpy())  # [Hkv, r, D]
        per_head = self.searchers[layer]
        # [Hkv, B, r, k]: one search per KV head and block, written in place; ids become
        # shard rows (-1 stays -1: a block with fewer keys than k).
        shape = (x.shape[0], len(per_head[0]), x.shape[1], min(k + sink, self.n_keys))
        scores, ids = np.empty(shape, np.float32), np.empty(shape, np.int64)

        def one(task: tuple[int, int]) -> None:
            head, j = task
            start, index = per_head[head][j]
            indexes.search(index, x[head], shape[3], scores[head, j], ids[head, j])
            np.add(ids[head, j], start, out=ids[head, j], where=ids[head, j] >= 0)
            if start < sink:  # the sink's rows are attended apart
                np.copyto(ids[head, j], -1, where=ids[head, j] < sink)

        tasks = [(head, j) for head in range(shape[0]) for j in range(shape[1])]
        list(self.pool.map(one, tasks) if self.pool else map(one, tasks))
        scores, idx = torch.from_numpy(scores), torch.from_numpy(ids)
        scores = scores.permute(0, 2, 1, 3).reshape(shape[0], shape[2], -1)
        idx = idx.permute(0, 2, 1, 3).reshape(shape[0], shape[2], -1)
        return topk.top_candidates(scores.masked_fill_(idx < 0, float("-inf")), idx, k)

    def _select_mapped(self, layer: int, q: torch.Tensor, k: int):
        """`select` for flat with --kv-on-disk: each block's k best of its mapped keys in
        this layer (past the sink), then the k best of those; the layer's pages are
        released block by block. On the CPU, whatever q's device: the keys stay on disk."""
        q = q.cpu()
        scores, idx = [], []
        for start, mapped in self.mapped_keys:
            key = mapped.tensor[layer]  # [Hkv, T, D]
            skip = min(max(self.n_sink - start, 0), key.shape[1])
            if key.shape[1] > skip:
                found, rows = topk.select_exact(q, key, k, skip)
                scores.append(found)
                idx.append(rows + start)
            mapped.release(layer)
        return topk.top_candidates(torch.cat(scores, -1), torch.cat(idx, -1), k)

    def _select_ivf(self, layer: int, q: torch.Tensor, k: int):
        """The k best keys of each row among its own nearest lists: numpy (scores, ids)
        [Hkv * r, k], ids head * N + row (-1, score -inf: none); the same selection as the
        compiled kernel's (`native.topk_attend`), for a machine without it. Every row of a
        KV head (its G query heads, and a prefill's positions) picks its nearest lists;
        the head's keys in the union of them are ranked in one batched matmul in the keys'
        dtype, each row seeing only the keys of its own lists (so a row's keys never
        depend on the other rows of the forward), and each row's k best are scored again
        in fp32 (exact), as `topk.select_exact` does. Every KV head is done at once (a
        few array calls per layer, not per head): each call costs more here than its
        work."""
        import numpy as np

        lay = self.ivf[layer]
        heads, rows, dim = q.shape
        n = self.n_keys
        q = q.cpu()  # the lists and keys are on the CPU, whatever q's device
        x = q.float()
        coarse = np.matmul(x.numpy(), lay.centroids.transpose(0, 2, 1))  # [Hkv, r, C]
        n_lists = coarse.shape[2]
        probes = indexes.row_probes(n, n_lists, k)
        if probes < n_lists:
            chosen = np.argpartition(coarse, n_lists - probes, axis=-1)[..., n_lists - probes:]
            union = np.zeros((heads, n_lists), bool)
            union[np.arange(heads)[:, None, None], chosen] = True
            head_of, lists = np.nonzero(union)  # by head, then list
            begin, end = lay.offsets[head_of, lists], lay.offsets[head_of, lists + 1]
            per_head = np.bincount(head_of, weights=end - begin, minlength=heads).astype(np.int64)
            # padded to a multiple of SCAN_STEP keys (the padding is masked below): a bf16
            # matmul of a shape oneDNN has not seen costs ~10x one it has
            width = -(-int(per_head.max()) // SCAN_STEP) * SCAN_STEP
            where = np.zeros((heads, width), np.int64)  # positions in the head's list order
            valid = np.arange(width) < per_head[:, None]
            where[valid] = _ranges(begin, end)  # row-major: head by head, in order
            list_of = np.zeros((heads, width), np.int64)  # each scanned key's list
            list_of[valid] = np.repeat(lists, end - begin)
            mine = np.zeros((heads, rows, n_lists), bool)  # the lists each row chose
            np.put_along_axis(mine, chosen, True, axis=-1)
            outside = ~np.take_along_axis(
                mine, np.broadcast_to(list_of[:, None], (heads, rows, width)), -1)
        else:
            width = n
            where = np.broadcast_to(np.arange(n), (heads, n))
            valid = np.ones((heads, n), bool)
            outside = np.zeros((heads, rows, n), bool)
        flat = where + (np.arange(heads) * n)[:, None]  # [Hkv, W] rows of keys [Hkv * N]
        keys = lay.keys.view(-1, dim)
        scanned = keys.index_select(0, torch.from_numpy(flat.reshape(-1))).view(heads, width, dim)
        rank = torch.matmul(q.to(keys.dtype), scanned.transpose(1, 2)).float().numpy()
        found = np.take_along_axis(lay.rows, where, 1)  # [Hkv, W] rows in the shard
        # the padding, and the sink's rows (attended apart), are never picked
        np.putmask(rank, np.broadcast_to((~valid | (found < self.n_sink))[:, None], rank.shape)
                   | outside, -np.inf)
        take = min(k, width)
        best = np.argpartition(rank, width - take, axis=-1)[..., width - take:]  # [Hkv, r, take]
        picked = keys.index_select(0, torch.from_numpy(np.take_along_axis(
            np.broadcast_to(flat[:, None], rank.shape), best, -1).reshape(-1)))
        exact = torch.einsum("hrd,hrkd->hrk", x, picked.view(heads, rows, take, dim).float())
        exact = exact.numpy()
        missing = np.isneginf(np.take_along_axis(rank, best, -1))
        exact[missing] = -np.inf
        ids = np.take_along_axis(np.broadcast_to(found[:, None], rank.shape), best, -1)
        ids = np.where(missing, -1, ids + (np.arange(heads) * n)[:, None, None])
        if take < k:  # fewer keys than k in the shard
            exact = np.pad(exact, ((0, 0), (0, 0), (0, k - take)), constant_values=-np.inf)
            ids = np.pad(ids, ((0, 0), (0, 0), (0, k - take)), constant_values=-1)
        return exact.reshape(heads * rows, k), ids.reshape(heads * rows, k)

    def _rows_of(self, ids, rows: int):
        """ivf ids head * N + row [Hkv * r, k] → rows in the shard (-1 stays -1)."""
        import numpy as np

        first = np.repeat(np.arange(len(ids) // rows) * self.n_keys, rows)[:, None]
        return np.where(ids >= 0, ids - first, -1)

    def value_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the value rows idx [Hkv, r, k] selects (-1: row 0's)."""
        if self.values is not None:
            return topk.gather_rows(self.values[layer], idx)
        return _mapped_rows(self.mapped_values, layer, idx)

    def key_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the keys at the shard rows idx [Hkv, r, k] (-1: row 0's), for
        flat and ivf (hnsw keeps none)."""
        if self.keys is not None:
            return topk.gather_rows(self.keys[layer], idx)
        if self.mapped_keys is not None:
            return _mapped_rows(self.mapped_keys, layer, idx)
        lay = self.ivf[layer]
        at = torch.from_numpy(lay.at).to(idx.device).long()  # [Hkv, N] row -> position
        where = at.gather(1, idx.clamp(min=0).reshape(idx.shape[0], -1)).view_as(idx)
        return topk.gather_rows(lay.keys, where)


def _pieces(q: torch.Tensor, tokens: int, width: int):
    """Folded queries q [1, Hkv, G * M, D] in pieces of positions, each scoring at most
    ROWS_X_KEYS keys (`width` per row) at once (a prefill of many rows): (first position,
    positions m, piece [Hkv, G * m, D])."""
    _, heads, rows, dim = q.shape
    groups = rows // tokens
    step = _piece_positions(width, heads, groups)
    if step >= tokens:
        yield 0, tokens, q[0]
        return
    by_token = q[0].view(heads, groups, tokens, dim)
    for start in range(0, tokens, step):
        piece = by_token[:, :, start:start + step].reshape(heads, -1, dim)
        yield start, piece.shape[1] // groups, piece


def _piece_positions(width: int, heads: int, groups: int) -> int:
    """Positions a piece of `_pieces` holds: their rows score at most ROWS_X_KEYS keys."""
    return max(1, ROWS_X_KEYS // (width * heads * groups))


def _joined(q: torch.Tensor, tokens: int, found) -> tuple[torch.Tensor, torch.Tensor]:
    """The results of `_pieces`' pieces [(positions m, out [(1,) Hkv, G * m, D], lse [(1,)
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


def _mapped_rows(blocks, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """[Hkv, r, k, D]: rows idx [Hkv, r, k] (-1: zeros) of the memory-mapped block files
    [(first row, `tensorfile.MappedTensor`)], in `layer`: only those rows of the files are
    read, and each file's layer is released after."""
    first = blocks[0][1].tensor
    out = torch.zeros(*idx.shape, first.shape[-1], dtype=first.dtype)
    idx = idx.cpu()
    heads = torch.arange(idx.shape[0])[:, None, None].expand_as(idx)
    for start, mapped in blocks:
        rows = mapped.tensor
        inside = (idx >= start) & (idx < start + rows.shape[2])
        if inside.any():
            out[inside] = rows[layer][heads[inside], idx[inside] - start]
            mapped.release(layer)
    return out


def _sinks(key: torch.Tensor, value: torch.Tensor, size: int, device="cpu", release=None):
    """The sink: per layer (keys, values) [1, Hkv, S, D] fp32 of the first S = min(size,
    T) rows of a block's key, value [L, Hkv, T, D]; None when size is 0. release(layer),
    when given, is called once a layer is copied (mapped files: a read touches whole
    page-cache folios, megabytes for a few rows)."""
    size = min(size, key.shape[2])
    if size < 1:
        return None
    sinks = []
    for layer, (k, v) in enumerate(zip(key, value)):
        sinks.append((k[None, :, :size].to(device, torch.float32),
                      v[None, :, :size].to(device, torch.float32)))
        if release is not None:
            release(layer)
    return sinks


def _starts(lengths: Sequence[int]) -> list[int]:
    """Each block's first row in the shard, and the shard's length last."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


class IvfLayer:
    """One layer's ivf on a worker, every KV head's lists over all of the worker's blocks:

        centroids [Hkv, C, D] numpy fp32   each head's lists' centres (the blocks' IVF
                                           lists, C = the lists of every block, side by
                                           side or laid out by a mean query:
                                           `listlayout`), each list's mean key
                                           (`_list_means`), rounded to bf16 (the kernel
                                           reads them so: half the bytes of a decode's
                                           list choice)
        offsets   [Hkv, C + 1] numpy int64 list c of head h is keys[h][offsets[h, c]:
                                           offsets[h, c + 1]]
        rows      [Hkv, N] numpy int64     each listed key's row in the shard
        keys      [Hkv, N, D] torch        the keys in list order, in the cache's dtype
        at        [Hkv, N] numpy int32     each shard row's position in keys (the inverse
                                           of rows: GQA sharing scores a key by its row)
        tail      [Hkv, C, D] torch bf16   each list's mean value, for the tail
                                           (`topk.tail_part`; TopK.tail), or None

    The lists are the blocks' own (their IVF files: which list each key went to); the
    keys are the cache's, so scores are exact. In memory: the keys (2 bytes a dimension in
    bf16), an int64 row and an int32 position each, the centroids, and with the tail each
    list's mean value (as much again as the centroids in bf16)."""

    def __init__(self, centroids, offsets, rows, keys, tail=None):
        import numpy as np

        self.centroids, self.offsets, self.rows, self.keys = centroids, offsets, rows, keys
        self.tail = tail
        self.at = np.empty(rows.shape, np.int32)
        np.put_along_axis(self.at, rows, np.arange(rows.shape[1], dtype=np.int32)[None], axis=1)

    @cached_property
    def list_of(self) -> torch.Tensor:
        """[Hkv, N] int32: each shard row's list (the tail's counts, `topk.lists_left`)."""
        import numpy as np

        sizes = np.diff(self.offsets, axis=1)
        out = np.empty(self.rows.shape, np.int32)
        for head in range(len(sizes)):
            out[head, self.rows[head]] = np.repeat(np.arange(sizes.shape[1], dtype=np.int32),
                                                   sizes[head])
        return torch.from_numpy(out)

    @classmethod
    def of(cls, keys: Sequence[torch.Tensor], index_of, layer: int,
           dtype: torch.dtype | None = None, toward: torch.Tensor | None = None,
           values: Sequence[torch.Tensor] | None = None) -> IvfLayer:
        """From the blocks' keys of this layer (each [Hkv, T, D]) and their IVF indexes
        index_of(block, layer, head); toward [Hkv, D]: each head's lists laid out by it
        (`listlayout.list_order`), else as built; values (the blocks' values of the layer,
        as keys): each list's mean value kept, for the tail."""
        import faiss
        import numpy as np

        heads = keys[0].shape[0]
        centroids, offsets, rows, ordered, means = [], [], [], [], []
        for head in range(heads):
            cents, lists, first = [], [], 0
            for block in range(len(keys)):
                owner = index_of(block, layer, head)  # alive while its IVF view is used
                index = faiss.extract_index_ivf(owner)
                cents.append(index.quantizer.reconstruct_n(0, index.nlist))
                index.make_direct_map()  # key -> (list << 32 | offset in list)
                lists.append((faiss.vector_to_array(index.direct_map.array) >> 32) + first)
                first += index.nlist
            assigned = np.concatenate(lists)
            whole = torch.cat([k[head] for k in keys]) if len(keys) > 1 else keys[0][head]
            whole = whole.to(dtype or whole.dtype)
            counts = np.bincount(assigned, minlength=first)  # keys a list
            cents = _list_means(whole, assigned, counts, np.concatenate(cents))
            if values is not None:  # an empty list's mean value: 0 (it has no key to stand for)
                mean = _list_means(torch.cat([v[head] for v in values]), assigned, counts,
                                   np.zeros_like(cents))
            laid = list_order(cents, None if toward is None else toward[head])
            if laid is not None:  # list laid[i] becomes list i
                place = np.empty_like(laid)
                place[laid] = np.arange(len(laid))
                assigned, cents, counts = place[assigned], cents[laid], counts[laid]
                if values is not None:
                    mean = mean[laid]
            if values is not None:
                means.append(mean)
            order = np.argsort(assigned, kind="stable")  # the head's keys, list by list
            centroids.append(cents)
            offsets.append(np.concatenate([[0], np.cumsum(counts)]))
            rows.append(order)
            ordered.append(whole.index_select(0, torch.from_numpy(order)))
        rounded = torch.from_numpy(np.stack(centroids).astype(np.float32)).bfloat16().float()
        tail = torch.from_numpy(np.stack(means)).bfloat16() if means else None
        return cls(np.ascontiguousarray(rounded.numpy()),
                   np.stack(offsets), np.stack(rows), torch.stack(ordered), tail)


def _list_means(keys: torch.Tensor, assigned, counts, centroids):
    """Each list's mean key [C, D] numpy fp32, from keys [N, D], each key's list `assigned`
    [N] and each list's keys `counts` [C] (numpy int64); an empty list keeps its index's
    centroid (centroids [C, D]). (Of values likewise: each list's mean value.)

    Phase 2 ranks lists by their centre's inner product with a row, and a list's mean is
    nearer its keys than the centroid its index trained (10 k-means iterations, after which
    every key went to its nearest centroid): on SmolLM2's decode queries
    (`benchmarks/dev/topk_recall.py`) the same lists probed found more of the exact top k,
    0.932 -> 0.955 at 8K (48 lists a row) and 0.922 -> 0.939 at 32K (68)."""
    import numpy as np

    owner, counts = torch.from_numpy(assigned), torch.from_numpy(counts)
    sums = torch.zeros(len(centroids), keys.shape[1]).index_add_(0, owner, keys.float())
    means = (sums / counts.clamp(min=1)[:, None]).numpy()
    return np.where((counts > 0).numpy()[:, None], means, centroids).astype(np.float32)


def _ranges(begin, end):
    """The positions of ranges [begin_i, end_i) one after the other, numpy int64."""
    import numpy as np

    lengths = end - begin
    before = np.cumsum(lengths) - lengths  # where range i starts in the result
    return np.arange(lengths.sum()) - np.repeat(before - begin, lengths)


def _per_block(starts: Sequence[int], layers: int, heads: int, index_of):
    """hnsw: per layer, per KV head, [(block's first row, index_of(block, layer, head))]."""
    return [[[(start, index_of(block, layer, head)) for block, start in enumerate(starts[:-1])]
             for head in range(heads)] for layer in range(layers)]


def _read_per_layer(paths: Sequence, name: str, layers: int, dtype: torch.dtype,
                    device: torch.device | str) -> list[torch.Tensor]:
    """Tensor `name` of the block files, per layer [Hkv, N, D] in `dtype`: read a layer at
    a time, so loading holds one layer more than the result, never a second copy."""
    out = []
    for layer in range(layers):
        blocks = [tensorfile.read_layer(path, name, layer) for path in paths]
        whole = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        out.append(whole.to(device=device, dtype=dtype))
    return out


def _per_layer(parts: Sequence[torch.Tensor], dtype: torch.dtype | None,
               device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Blocks' tensors [L, Hkv, T_i, D] → per layer [Hkv, N, D] (one copy, in `dtype`)."""
    whole = torch.cat(list(parts), dim=2) if len(parts) > 1 else parts[0]
    whole = whole.to(device=device, dtype=dtype or whole.dtype)
    return list(whole.unbind(0))
