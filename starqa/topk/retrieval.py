"""Phase 2's top-k part on one worker, and the one place its index kind is chosen
(`SHARD_CLASSES`, `from_parts`, `from_cache`): its blocks' keys (flat) or faiss indexes (ivf,
hnsw), its values (in memory, or memory-mapped from the shard files with --kv-on-disk),
and `parts` (`shard.TopKShard`), which phase2's `ShardAttention` calls in place of exact
attention over a shard.

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

On the CPU, flat and ivf attend through starqa's compiled top-k kernel (`native.topk_attend`,
starqa/native/_topk.c; `scanned.ScannedShard`): one call per layer scores each row's keys
exactly in fp32, keeps its k best, shares them and attends; a position's result never
depends on the forward's other positions (drafted tokens are checked as extra positions).
hnsw, CUDA, and machines where the kernel was not built take the torch/numpy/faiss code
(`shard.TopKShard`), which selects the same keys up to a bf16 ranking's near-ties at the
k-th place.

Each worker retrieves k keys per query row from its own blocks, so the union over workers
holds the context's global top k; `attention.merge` then combines the parts exactly, as
for exact attention. Scores are exact fp32 inner products with the cache's keys (flat
recomputes them, see `topk.select_exact`; ivf stores the keys in the cache's dtype,
hnsw in fp32), and only the selected value rows are read. Source attribution needs every
key's share of the attention, which top-k never computes: answers under top-k name no
sources.

What each kind holds per layer (N: the worker's keys, Hkv KV heads), a class each:

    flat   `flat.FlatShard`: the keys [Hkv, N, D] in the compute dtype; with --kv-on-disk
           (`flat.MappedFlatShard`) none: each block's keys are memory-mapped, scanned a
           layer at a time and that layer's pages released
    ivf    `ivf.IvfShard`: every KV head's IVF lists over all the worker's blocks
           (`ivf.IvfLayer`), a row scanning its nearest lists, with the tail
    hnsw   `hnsw.HnswShard`: each block's faiss HNSW index per KV head, searched one block
           at a time; the worker keeps the k best of the blocks' k best

What every kind loads alike (values, sink, budgets, blocks) is `loading`'s; where rows lie
(in memory or mapped), `rows`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from starqa.cache.manifest import Manifest
from starqa.topk import loading
from starqa.topk.flat import FlatShard
from starqa.topk.hnsw import HnswShard
from starqa.topk.indexes import TopK
from starqa.topk.ivf import IvfShard
from starqa.topk.shard import TopKShard

# each of `indexes.KINDS`: its shard class (flat's keys on disk: `FlatShard.of_cache`'s choice)
SHARD_CLASSES: dict[str, type[TopKShard]] = {"flat": FlatShard, "ivf": IvfShard,
                                             "hnsw": HnswShard}


def shard_class(settings: TopK) -> type[TopKShard]:
    """The shard class of `settings`' index kind (`TopK.index`, one of `indexes.KINDS`)."""
    return SHARD_CLASSES[settings.index]


def from_parts(parts: loading.Blocks, settings: TopK, n_tokens: int,
               dtype: torch.dtype | None = None, first: bool = True,
               toward: Sequence[torch.Tensor] | None = None) -> TopKShard | None:
    """From blocks' (k, v), each [L, Hkv, T, D], in memory, building any index here
    (`starqa eval`, tests); first: they begin with the context's first block (the
    sink's). Values, flat's keys and the sink stay on the blocks' device; ivf and hnsw
    search on the CPU (faiss). toward: per layer [Hkv, D], what ivf lays its lists out
    by (`listlayout.mean_queries`), else as built. None when there are no blocks."""
    if not parts:
        return None
    held = loading.held_of_parts(parts, settings, n_tokens, dtype, first)
    return shard_class(settings).of_parts(held, parts, dtype, toward)


def from_cache(manifest: Manifest, blocks: Sequence[int], settings: TopK,
               dtype: torch.dtype, device: torch.device,
               mean_queries: loading.MeanQueries | None = None) -> TopKShard | None:
    """This worker's blocks of a cached context, every file checksum-verified: the
    shards (as `load_shard` does) and, for ivf and hnsw, the index files.
    mean_queries: given token ids, per layer [Hkv, D] (`listlayout.mean_queries`): ivf
    lays its lists out by those of the worker's first block's ids, else as built."""
    if not blocks:
        return None
    if manifest.kv == "int8":
        return _dequantized(manifest, blocks, settings, dtype, device, mean_queries)
    files = loading.BlockFiles.of(manifest, blocks, dtype, device)
    return shard_class(settings).of_cache(files.held(settings), files, mean_queries)


def _dequantized(manifest: Manifest, blocks: Sequence[int], settings: TopK,
                 dtype: torch.dtype, device: torch.device,
                 mean_queries: loading.MeanQueries | None) -> TopKShard:
    """`from_cache` for a context of int8 KV (`Manifest.kv`): top-k holds its own copy of
    the keys and values, so the blocks are dequantised into `dtype` as they load (checksums
    verified first) and taken as blocks in memory (`from_parts`): ivf's and hnsw's indexes
    are built here, and --kv-on-disk keeps nothing on disk (docs/topk.md)."""
    from starqa.cache.shards import load_block, verify_checksums

    verify_checksums(manifest, blocks, contents=True)
    loaded = [load_block(manifest, i, device=device, verified=True, dtype=dtype) for i in blocks]
    parts = [(k.to(device, dtype), v.to(device, dtype)) for k, v, _ in loaded]
    toward = mean_queries(loaded[0][2]) if mean_queries is not None else None
    return from_parts(parts, settings, manifest.n_tokens, dtype, blocks[0] == 0, toward)
