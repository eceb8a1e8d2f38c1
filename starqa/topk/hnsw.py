"""hnsw: each block's faiss HNSW index per layer and KV head (a graph is not merged; keys
in fp32 in the index), searched one block at a time; the worker keeps the k best of the
blocks' k best. The compiled kernel never serves it (the search is faiss's), and it holds
no keys to score another head's picks with: a row attends to its own k (no GQA sharing)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from starqa.attention import topk
from starqa.topk import probing
from starqa.topk.loading import (BlockFiles, Blocks, IndexOf, MeanQueries, built_index,
                                 starts)
from starqa.topk.rows import Held
from starqa.topk.shard import TopKShard

# per layer, per KV head, [(the block's first row in the shard, its faiss index)]
Searchers = Sequence[Sequence[Sequence[tuple[int, object]]]]


class HnswShard(TopKShard):
    """hnsw: searchers[layer][head], each block's index; pool: the threads the searches
    run on side by side (None with one thread)."""

    def __init__(self, held: Held, searchers: Searchers):
        super().__init__(held)
        self.searchers = searchers
        self.pool = None
        if torch.get_num_threads() > 1:
            import faiss

            # One search per block and KV head, run side by side (faiss releases the GIL),
            # each on one thread: a search is a few rows, too small to split. The setting
            # is made in the pool's threads only: OpenMP's is per thread, and faiss's call
            # sets torch's too (one OpenMP runtime in the process), so made on the caller's
            # thread it would leave the whole decode, model included, on one core (it did:
            # ivf decoded at 32K single-threaded).
            self.pool = ThreadPoolExecutor(torch.get_num_threads(),
                                           initializer=faiss.omp_set_num_threads,
                                           initargs=(1,))

    @classmethod
    def of_parts(cls, held: Held, parts: Blocks, dtype: torch.dtype | None,
                 toward: Sequence[torch.Tensor] | None) -> HnswShard:
        """Each block's HNSW indexes built here (faiss, on the CPU)."""
        layers, heads = parts[0][0].shape[:2]
        return cls(held, per_block(starts([k.shape[2] for k, _ in parts]), layers, heads,
                                   built_index(parts, held.settings.index)))

    @classmethod
    def of_cache(cls, held: Held, files: BlockFiles, mean_queries: MeanQueries | None
                 ) -> HnswShard:
        """The blocks' HNSW files read (their keys memory-mapped with --kv-on-disk)."""
        read = files.index_reader(held.settings.index)
        mapped = held.settings.kv_on_disk
        return cls(held, per_block(files.starts, files.layers, files.heads,
                                   lambda b, lay, h: read(b, lay, h, mapped)))

    def _width(self, k: int) -> int:
        """Keys a row scores at most: its k (a search returns no more)."""
        return k

    def select(self, layer: int, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys past the sink: one faiss search per KV head and block,
        side by side on `pool`, then the k best of the blocks' k best."""
        import numpy as np

        sink = self.n_sink
        x = np.ascontiguousarray(q.float().cpu().numpy())  # [Hkv, r, D]
        per_head = self.searchers[layer]
        # [Hkv, B, r, k]: one search per KV head and block, written in place; ids become
        # shard rows (-1 stays -1: a block with fewer keys than k).
        shape = (x.shape[0], len(per_head[0]), x.shape[1], min(k + sink, self.n_keys))
        scores, ids = np.empty(shape, np.float32), np.empty(shape, np.int64)

        def one(task: tuple[int, int]) -> None:
            head, j = task
            start, index = per_head[head][j]
            probing.search(index, x[head], shape[3], scores[head, j], ids[head, j])
            np.add(ids[head, j], start, out=ids[head, j], where=ids[head, j] >= 0)
            if start < sink:  # the sink's rows are attended apart
                np.copyto(ids[head, j], -1, where=ids[head, j] < sink)

        tasks = [(head, j) for head in range(shape[0]) for j in range(shape[1])]
        list(self.pool.map(one, tasks) if self.pool else map(one, tasks))
        scores, idx = torch.from_numpy(scores), torch.from_numpy(ids)
        scores = scores.permute(0, 2, 1, 3).reshape(shape[0], shape[2], -1)
        idx = idx.permute(0, 2, 1, 3).reshape(shape[0], shape[2], -1)
        return topk.top_candidates(scores.masked_fill_(idx < 0, float("-inf")), idx, k)


def per_block(first_rows: Sequence[int], layers: int, heads: int, index_of: IndexOf) -> list:
    """Per layer, per KV head, [(block's first row, index_of(block, layer, head))];
    first_rows: each block's first row, and the shard's length last (`loading.starts`)."""
    return [[[(start, index_of(block, layer, head))
              for block, start in enumerate(first_rows[:-1])]
             for head in range(heads)] for layer in range(layers)]
