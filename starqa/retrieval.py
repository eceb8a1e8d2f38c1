"""Phase 2's top-k part on one worker: its blocks' keys (flat) or faiss indexes (ivf,
hnsw), its values (in memory, or memory-mapped from the shard files with --kv-on-disk),
and `parts`, which `phase2.ShardAttention` calls in place of exact attention over a shard.

Each worker retrieves k keys per query row from its own blocks (each block's index gives
its k best, the worker keeps the k best of those), so the union over workers holds the
context's global top k; `attention.merge` then combines the parts exactly, as for exact
attention. Scores come back from faiss as fp32 inner products of the fp32 keys (flat
recomputes them in fp32, see `topk.select_exact`), and only the selected value rows are
read. Source attribution needs every key's share of the attention, which top-k never
computes: answers under top-k name no sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from starqa import indexes, topk
from starqa.errors import StarqaError
from starqa.indexes import TopK
from starqa.manifest import Manifest, block_file

ROWS_X_KEYS = 1 << 21  # rows * k gathered at once (a prefill of many rows goes in pieces)


class TopKShard:
    """A worker's blocks for top-k attention.

    keys: per layer [Hkv, N, D] in the compute dtype (flat), else None. searchers: per
    block (its first row in the shard, per layer per head a faiss index), else None.
    values: per layer [Hkv, N, D] (in memory), or per block (first row, [L, Hkv, T, D]
    memory-mapped). budgets: keys per row in each layer (`topk.layer_budgets`)."""

    def __init__(self, settings: TopK, budgets: Sequence[int], n_keys: int, keys=None,
                 searchers=None, values=None, mapped_values=None):
        self.settings = settings
        self.budgets = list(budgets)
        self.n_keys = n_keys
        self.keys = keys
        self.searchers = searchers
        self.values = values
        self.mapped_values = mapped_values
        self.pool = None
        if searchers:
            import faiss

            # One search per block and KV head, each single-threaded (a search of a few
            # rows is too small to split; faiss's OpenMP threads would also spin against
            # torch's), run side by side on a pool (faiss releases the GIL).
            faiss.omp_set_num_threads(1)
            searches = len(searchers) * len(searchers[0][1][0])
            if min(searches, torch.get_num_threads()) > 1:
                self.pool = ThreadPoolExecutor(min(searches, torch.get_num_threads()))

    @classmethod
    def from_parts(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], settings: TopK,
                   n_tokens: int, dtype: torch.dtype | None = None) -> TopKShard | None:
        """From blocks' (k, v), each [L, Hkv, T, D], in memory, building any index here
        (`starqa eval`, tests). None when there are no blocks."""
        if not parts:
            return None
        layers = parts[0][0].shape[0]
        keys, searchers, offset = None, None, 0
        if settings.index == "flat":
            keys = _per_layer([k for k, _ in parts], dtype)
        else:
            searchers = []
            for k, _ in parts:
                rows = k.float().cpu().numpy()
                searchers.append((offset, [[indexes.build(settings.index, rows[layer, head])
                                            for head in range(k.shape[1])]
                                           for layer in range(layers)]))
                offset += k.shape[2]
        n = sum(k.shape[2] for k, _ in parts)
        budgets = topk.layer_budgets(settings.keys(n_tokens), layers, settings.schedule)
        return cls(settings, budgets, n, keys, searchers, _per_layer([v for _, v in parts], dtype))

    @classmethod
    def from_cache(cls, manifest: Manifest, blocks: Sequence[int], settings: TopK,
                   dtype: torch.dtype, device: torch.device) -> TopKShard | None:
        """This worker's blocks of a cached context, every file checksum-verified: the
        shards (as `load_shard` does) and, for ivf and hnsw, the index files."""
        from starqa.shards import verify_checksums

        if not blocks:
            return None
        verify_checksums(manifest, blocks)
        paths = [manifest.folder / block_file(b) for b in blocks]
        layers, heads = indexes.block_shape(paths[0])[:2]
        starts = [0]
        for path in paths:
            starts.append(starts[-1] + indexes.block_shape(path)[2])
        keys = searchers = values = mapped = None
        if settings.index == "flat":
            keys = _per_layer([indexes.read_block_tensor(p, "k") for p in paths], dtype, device)
        else:
            found = indexes.find_set(manifest, settings.index)
            if found is None:
                raise StarqaError(
                    f"Context {manifest.name!r} has no {settings.index} indexes.",
                    hint=f"build them: {indexes.rebuild_command(manifest, settings.index)}")
            files = {(e.block, e.layer, e.head): e.file for e in found.files}
            indexes.verify(manifest, found, blocks)
            where = manifest.folder / found.folder
            searchers = [(start, [[indexes.read_index(where / files[(b, layer, head)],
                                                      settings.kv_on_disk)
                                   for head in range(heads)] for layer in range(layers)])
                         for b, start in zip(blocks, starts)]
        if settings.kv_on_disk:
            mapped = [(start, indexes.read_block_tensor(p, "v", mapped=True))
                      for p, start in zip(paths, starts)]
        else:
            values = _per_layer([indexes.read_block_tensor(p, "v") for p in paths], dtype,
                                device)
        budgets = topk.layer_budgets(settings.keys(manifest.n_tokens), layers,
                                     settings.schedule)
        return cls(settings, budgets, starts[-1], keys, searchers, values, mapped)

    # -- Phase 2 ------------------------------------------------------------------------

    def parts(self, layer: int, q: torch.Tensor, scale: float
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The top-k partial attention of folded queries q [1, Hkv, R, D] over this
        worker's blocks in `layer`: ([out [1, Hkv, R, D] in q's dtype], [lse [1, Hkv, R]
        fp32]), one part for `attention.merge`."""
        k = min(self.budgets[layer], self.n_keys)
        rows = q.shape[2]
        step = max(1, ROWS_X_KEYS // (k * q.shape[1]))
        outs, lses = [], []
        for start in range(0, rows, step):
            piece = q[0, :, start:start + step]  # [Hkv, r, D]
            scores, idx = (t.to(q.device) for t in self.select(layer, piece, k))
            values = self.value_rows(layer, idx).to(q.device)
            out, lse = topk.attend_selected(scores, idx, values, scale)
            outs.append(out.to(q.dtype))
            lses.append(lse)
        if len(outs) == 1:
            return outs, lses
        return [torch.cat(outs, dim=2)], [torch.cat(lses, dim=2)]

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scores, idx [Hkv, r, k]: each row's k best keys of this worker's blocks."""
        if self.keys is not None:
            return topk.select_exact(q, self.keys[layer], k)
        import numpy as np

        x = q.float().cpu().numpy()  # [Hkv, r, D]
        rows = [np.ascontiguousarray(x[head]) for head in range(x.shape[0])]
        tasks = [(start, head, index) for start, per_layer in self.searchers
                 for head, index in enumerate(per_layer[layer])]

        def one(task):
            start, head, index = task
            found, block_ids = indexes.search(index, rows[head], min(k, index.ntotal))
            return found, np.where(block_ids >= 0, block_ids + start, -1)

        done = list(self.pool.map(one, tasks) if self.pool else map(one, tasks))
        heads = x.shape[0]  # tasks run block by block, head by head: regroup per block
        scores = [np.stack([s for s, _ in done[b:b + heads]]) for b in range(0, len(done), heads)]
        ids = [np.stack([i for _, i in done[b:b + heads]]) for b in range(0, len(done), heads)]
        scores = torch.from_numpy(np.concatenate(scores, axis=-1))
        idx = torch.from_numpy(np.concatenate(ids, axis=-1))
        scores = scores.masked_fill(idx < 0, float("-inf"))
        return topk.top_candidates(scores, idx, k)

    def value_rows(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """[Hkv, r, k, D]: the value rows idx [Hkv, r, k] selects (-1: zeros)."""
        if self.values is not None:
            return topk.gather_rows(self.values[layer], idx)
        first = self.mapped_values[0][1]
        out = torch.zeros(*idx.shape, first.shape[-1], dtype=first.dtype)
        idx = idx.cpu()
        heads = torch.arange(idx.shape[0])[:, None, None].expand_as(idx)
        for start, mapped in self.mapped_values:
            inside = (idx >= start) & (idx < start + mapped.shape[2])
            if inside.any():  # only these rows of the file are read
                out[inside] = mapped[layer][heads[inside], idx[inside] - start]
        return out


def _per_layer(parts: Sequence[torch.Tensor], dtype: torch.dtype | None,
               device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Blocks' tensors [L, Hkv, T_i, D] → per layer [Hkv, N, D] (one copy, in `dtype`)."""
    whole = torch.cat(list(parts), dim=2) if len(parts) > 1 else parts[0]
    whole = whole.to(device=device, dtype=dtype or whole.dtype)
    return list(whole.unbind(0))

