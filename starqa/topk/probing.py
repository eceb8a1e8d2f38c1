"""Top-k's index files at Phase 2: read (`read_index`, memory-mapped with --kv-on-disk) and
searched (`search`); how far a search looks: the IVF lists a faiss search probes over one
block's index, and the lists a Phase 2 row scans in a worker's ivf (`row_probes`, over
`ivf.IvfLayer`'s lists of every block). Nothing here imports faiss at the top
(`indexes`' rule: `ask` parses the settings without it).
"""

from __future__ import annotations

import math
from pathlib import Path

IVF_SCAN = 4  # a search scans about this many times k keys per block (nprobe lists)
# Phase 2's ivf (`ivf.IvfLayer`): each row picks the nearest lists holding about this
# many times k of the worker's keys and keeps the k best of their keys (its own lists only:
# since the compiled kernel, a row's keys never depend on the forward's other rows).
# Measured on SmolLM2's keys and queries at 32K (7 blocks, k = 328): 4k per row found 0.83
# of the exact top k (0.92 of its attention mass), 8k 0.95 (0.98). 8 until the tail
# (TAILS): with the keys it leaves out counted by their lists, a key the scan misses still
# weighs in, and 4k with a floor of 48 lists kept at 8K what 8k with 64 did (docs/topk.md,
# "ivf's tail"), for a third less of a 32K token's time.
IVF_ROW_SCAN = 4
# ...and never fewer than this many lists (or all of them): what a row finds depends on
# how many lists it probes more than on the share of keys they hold. Measured on SmolLM2 at
# 8K (4 blocks, 208 lists, k = 82): 8k keys per row is 17 lists, which found 0.75 of the
# exact top k; 32 lists 0.88, 48 lists 0.93 (32K's 68 lists of 840: 0.92). At 4K (9 lists
# of 101) `eval --index ivf` kept 0.74 of exact's accuracy; with a floor of 48, 1.04
# (docs/results.md). With each list's centre its mean key, 8K's rows find 0.955 of the
# exact top k with 48 lists, 0.974 with 64 (benchmarks/dev/topk_recall.py). 64 until the
# tail; with it 48 (and 4k keys: 48 at 32K too) kept every answer of 8K's seed 3 but one
# that 4% loses too (docs/results.md).
IVF_MIN_PROBES = 48


def ivf_probes(n_keys: int, n_lists: int, k: int, scan: int = IVF_SCAN) -> int:
    """Lists an IVF search of k keys probes among n_lists holding n_keys: enough to see
    about scan * k keys (every list when k is most of the keys)."""
    return min(n_lists, max(1, math.ceil(scan * k * n_lists / max(n_keys, 1))))


def row_probes(n_keys: int, n_lists: int, k: int) -> int:
    """Lists a Phase 2 row scans in a worker's ivf (`ivf.IvfLayer`): its nearest,
    about IVF_ROW_SCAN * k keys' worth, at least IVF_MIN_PROBES (at most every list)."""
    return min(n_lists, max(IVF_MIN_PROBES, ivf_probes(n_keys, n_lists, k, IVF_ROW_SCAN)))


def search(index, rows, k: int, scores=None, ids=None):
    """The k best keys (inner product) of `index` for rows [R, D] (numpy float32): returns
    (scores [R, k] float32, ids [R, k] int64; -1 past the keys found), written into
    `scores` and `ids` when given (preallocated, C-contiguous). IVF scans the nearest lists
    until about IVF_SCAN * k keys are seen (all of them when k is most of the keys); HNSW
    searches with a candidate list of max(3k/2, 64)."""
    import faiss

    if isinstance(index, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(nprobe=ivf_probes(index.ntotal, index.nlist, k))
    else:
        params = faiss.SearchParametersHNSW(efSearch=max(k * 3 // 2, 64))
    return index.search(rows, k, params=params, D=scores, I=ids)


def read_index(path: Path, mapped: bool):
    """A faiss index from its file; `mapped`: its vectors memory-mapped, not read."""
    import faiss

    # IO_FLAG_MMAP_IFC maps the vectors in place: IVF's inverted lists (keys and ids),
    # HNSW's flat storage (its graph is read).
    return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mapped else 0)
