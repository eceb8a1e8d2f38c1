"""Top-k attention's settings and its vector indexes on disk: built, written, hashed into
the manifest and verified (read and searched at Phase 2: `probing`).

    <context>/index-ivf-1a2b3c4d/block_00000.l000.h00.faiss   one faiss index per block,
                                                              layer and KV head
    <context>/.verified-indexes.json    {file: [size, mtime_ns, ctime_ns, sha256]}

Index kinds (`--index`), over one (block, layer, KV head)'s keys, by inner product:

    flat   exact: one matmul + topk over the keys themselves (no file; the keys stay in
           memory in the cache's dtype, or with --kv-on-disk are read from the block files
           a layer at a time, memory-mapped, and their pages released after the layer)
    ivf    faiss IndexIVFFlat (METRIC_INNER_PRODUCT): ~4 sqrt(T) k-means lists (the file
           holds the centroids and every key in fp32, plus an int64 id each). Phase 2
           does not search the files: it takes a worker's blocks' lists (which list each
           key went to), for every KV head of a layer, and keeps the keys list by list in
           memory (`ivf.IvfLayer`: the keys in the cache's dtype, 2 bytes each in
           bf16, plus an int64 row; each list's mean key as its centre, in fp32); a row
           picks the lists nearest it until about IVF_ROW_SCAN * k keys, and at least
           IVF_MIN_PROBES lists (`probing.row_probes`), with or without --kv-on-disk.
    hnsw   faiss IndexHNSWFlat (METRIC_INNER_PRODUCT, M = HNSW_M): every key in fp32 plus
           its graph links; with --kv-on-disk the keys are memory-mapped, the graph read.

A set of indexes (`manifest.IndexSet`) is written into a fresh folder, hashed, and only then
named by the manifest (written last, atomically), so readers see the old set or the new
one; faiss's own file format, never pickle. Nothing here imports torch or faiss at the top:
`ask` parses the settings before deciding whether it needs either.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from starqa.core.errors import ShardError, StarqaError
from starqa.cache.manifest import (IndexFile, IndexSet, Manifest, block_file, index_file,
    write_json_atomic, write_manifest)
from starqa.cache.shards import read_verified, write_error
from starqa.core.tensorfile import block_shape, read_tensor
from starqa.topk.probing import IVF_SCAN

ATTENTIONS = ("exact", "topk")
KINDS = ("flat", "ivf", "hnsw")
SCHEDULES = ("uniform", "linear")
# How the question's own forward attends under top-k: to every key of the context (exact,
# as in the paper, where top-k serves the generated tokens over a prefilled cache), or to
# its rows' k keys like the answer's tokens (topk: a sooner first token on a huge context).
PREFILLS = ("exact", "topk")
# What the keys a row does not retrieve count for: under ivf, "lists" gives each list's
# keys outside the row's union their list's weight and mean value (`topk.tail_part`; the
# softmax then misses no list's mass); "none" drops them, the paper's top-k. flat and hnsw
# have no lists: their rows attend to their keys alone.
TAILS = ("lists", "none")
DEFAULT_TOP_K = "1%"  # the paper: k ~ 1% of the context keeps >= 95% of dense accuracy
IVF_POINTS_PER_LIST = 39  # faiss's k-means wants at least 39 training points per centroid
IVF_LISTS_PER_SQRT = 4  # nlist ~ 4 sqrt(T), faiss's rule of thumb
IVF_TRAIN_ITERATIONS = 10
HNSW_M = 16
HNSW_EF_CONSTRUCTION = 40
VERIFIED = ".verified-indexes.json"


# ---------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class TopK:
    """`--attention topk`: `count` keys per query row per worker, or `fraction` of the
    context's tokens; the per-layer schedule; the index kind; values memory-mapped."""

    count: int | None = None
    fraction: float | None = None
    schedule: str = "uniform"
    index: str = "flat"
    kv_on_disk: bool = False
    prefill: str = PREFILLS[0]  # the question's forward (PREFILLS)
    # The context's first `sink` tokens are attended exactly, in addition to the k keys
    # retrieved (`shard.TopKShard`): StreamingLLM's attention sinks. Without them
    # SmolLM2 at 4K with k = 1% (41 keys) lost the answer's format and the needle.
    sink: int = 16
    tail: str = TAILS[0]  # TAILS; used by ivf only

    @property
    def tails(self) -> bool:
        """Whether the keys a row leaves out enter its softmax (ivf with tail "lists")."""
        return self.index == "ivf" and self.tail == "lists"

    @property
    def label(self) -> str:
        """How --top-k spells it: "1%" or "512"."""
        return f"{self.fraction * 100:g}%" if self.fraction is not None else str(self.count)

    def keys(self, n_tokens: int) -> int:
        """Keys per query row and worker for a context of `n_tokens` (at least 1)."""
        if self.count is not None:
            return self.count
        return max(1, round(self.fraction * n_tokens))

    def as_dict(self) -> dict:
        return asdict(self)

    def cli_args(self) -> list[str]:
        """The command-line options that give these settings (a warm group's `serve`)."""
        return ["--attention", "topk", "--top-k", self.label, "--top-k-schedule",
                self.schedule, "--index", self.index, "--top-k-prefill", self.prefill] \
            + ["--top-k-tail", self.tail] * (self.index == "ivf") \
            + ["--kv-on-disk"] * self.kv_on_disk

    def describe(self) -> str:
        return (f"top-k {self.label} ({self.index}, {self.schedule}"
                + (", KV on disk" if self.kv_on_disk else "")
                + (", question by top-k" if self.prefill == "topk" else "")
                + (", no tail" if self.index == "ivf" and not self.tails else "") + ")")


_COUNT = re.compile(r"\s*(\d+)\s*")
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")


def parse_top_k(text: str) -> tuple[int | None, float | None]:
    """"512" → (512, None); "1%" or "0.5%" → (None, 0.01 / 0.005). Anything else, 0, or
    more than 100% is a StarqaError naming the problem and a value that works."""
    example = "e.g. --top-k 1% (of the context's tokens) or --top-k 512 (keys)"
    if (m := _COUNT.fullmatch(text)) is not None:
        if int(m[1]) < 1:
            raise StarqaError(f"--top-k {text.strip()} keeps no key at all.",
                              hint=f"give at least 1 key: {example}")
        return int(m[1]), None
    if (m := _PERCENT.fullmatch(text)) is not None:
        percent = float(m[1])
        if percent <= 0:
            raise StarqaError(f"--top-k {text.strip()} keeps no key at all.",
                              hint=f"give more than 0%: {example}")
        if percent > 100:
            raise StarqaError(f"--top-k {text.strip()} is more than the whole context.",
                              hint=f"give at most 100% (every key: exact attention): {example}")
        return None, percent / 100
    raise StarqaError(f"--top-k {text.strip()!r} is neither a number of keys nor a percentage.",
                      hint=example)


def topk_settings(attention: str = "exact", top_k: str | None = None,
                  schedule: str | None = None, index: str | None = None,
                  kv_on_disk: bool = False, prefill: str | None = None,
                  tail: str | None = None) -> TopK | None:
    """The top-k settings of the command line's options (None: exact attention). Options
    that only apply to top-k are an error with exact attention, never silently ignored."""
    if attention not in ATTENTIONS:
        raise StarqaError(f"Unknown --attention {attention!r}.",
                          hint=f"choose {' or '.join(ATTENTIONS)}")
    if schedule is not None and schedule not in SCHEDULES:
        raise StarqaError(f"Unknown --top-k-schedule {schedule!r}.",
                          hint=f"choose {' or '.join(SCHEDULES)}")
    if index is not None and index not in KINDS:
        raise StarqaError(f"Unknown --index {index!r}.", hint=f"choose {', '.join(KINDS)}")
    if prefill is not None and prefill not in PREFILLS:
        raise StarqaError(f"Unknown --top-k-prefill {prefill!r}.",
                          hint=f"choose {' or '.join(PREFILLS)}")
    if tail is not None and tail not in TAILS:
        raise StarqaError(f"Unknown --top-k-tail {tail!r}.", hint=f"choose {' or '.join(TAILS)}")
    if attention == "exact":
        given = [name for name, value in (("--top-k", top_k), ("--top-k-schedule", schedule),
                                          ("--index", index), ("--kv-on-disk", kv_on_disk),
                                          ("--top-k-prefill", prefill), ("--top-k-tail", tail))
                 if value]
        if given:
            raise StarqaError(f"{', '.join(given)} only apply to --attention topk.",
                              hint="add --attention topk, or drop " + ", ".join(given))
        return None
    count, fraction = parse_top_k(top_k or DEFAULT_TOP_K)
    index = index or KINDS[0]
    if tail == "lists" and index != "ivf":
        raise StarqaError(f"--top-k-tail lists estimates the keys left out from ivf's lists; "
                          f"--index {index} has none.",
                          hint="add --index ivf, or drop --top-k-tail")
    return TopK(count, fraction, schedule or SCHEDULES[0], index, kv_on_disk,
                prefill or PREFILLS[0], tail=tail or TAILS[0])


def topk_of(data: dict | None) -> TopK | None:
    """A job's or a run file's settings (`TopK.as_dict`) back; None: exact."""
    return TopK(**data) if data else None


def memory_bytes(manifest: Manifest, settings: TopK) -> int:
    """About the bytes Phase 2 holds for a context under `settings`: the keys (flat) or
    the index files (read whole, unless memory-mapped with --kv-on-disk), and the values
    unless they stay on disk (blocks hold keys and values in equal halves)."""
    half = sum(b.bytes for b in manifest.blocks) // 2
    found = find_set(manifest, settings.index)
    if settings.index == "flat":
        keys = 0 if settings.kv_on_disk else half
    else:
        keys = 0 if settings.kv_on_disk or found is None else sum(f.bytes for f in found.files)
    return keys + (0 if settings.kv_on_disk else half)


# ---------------------------------------------------------------------------------------
# building


def ivf_lists(n_keys: int) -> int:
    """IVF lists for `n_keys` keys: ~4 sqrt(T), with enough keys to train each centroid."""
    by_sqrt = int(IVF_LISTS_PER_SQRT * math.sqrt(n_keys))
    return max(1, min(by_sqrt, n_keys // IVF_POINTS_PER_LIST))


def build(kind: str, keys):
    """A faiss index of `kind` (ivf, hnsw) over keys [T, D] (numpy float32), inner product."""
    import faiss
    import torch

    # as many threads as torch has here (a worker's share of the cores); hnsw searches one
    faiss.omp_set_num_threads(torch.get_num_threads())
    n, dim = keys.shape
    if kind == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, ivf_lists(n), faiss.METRIC_INNER_PRODUCT)
        index.cp.niter = IVF_TRAIN_ITERATIONS
        index.cp.seed = 1234  # the same keys give the same index
        index.cp.min_points_per_centroid = 1  # a short block has few lists; no warning
        index.train(keys)
    elif kind == "hnsw":
        # faiss's HNSW defaults to L2: inner product has to be asked for.
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    else:
        raise ValueError(f"no index file for kind {kind!r}")
    index.add(keys)
    return index


def params(kind: str) -> dict:
    """What a set of `kind` was built with (recorded in the manifest)."""
    if kind == "ivf":
        return {"lists_per_sqrt": IVF_LISTS_PER_SQRT, "scan": IVF_SCAN,
                "train_iterations": IVF_TRAIN_ITERATIONS}
    return {"M": HNSW_M, "ef_construction": HNSW_EF_CONSTRUCTION}


def new_folder(kind: str) -> str:
    """A fresh IndexSet folder name (`manifest.INDEX_FOLDER`)."""
    return f"index-{kind}-{secrets.token_hex(4)}"


def write_block(folder: Path, kind: str, block: int, keys) -> float:
    """Build and write the indexes of one block's keys [L, Hkv, T, D] (a torch tensor) into
    `folder` (an IndexSet folder being filled), each file through a temporary name and a
    rename; returns the seconds it took."""
    import faiss

    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    layers, heads = keys.shape[0], keys.shape[1]
    for layer in range(layers):
        for head in range(heads):
            rows = keys[layer, head].float().contiguous().cpu().numpy()
            path = folder / index_file(block, layer, head)
            tmp = path.with_name(path.name + ".tmp")
            try:
                faiss.write_index(build(kind, rows), str(tmp))
            except RuntimeError as err:  # faiss says a failed write in words: its errno lost
                raise write_error(err, tmp) from err
            os.replace(tmp, path)
    return time.perf_counter() - started


def hash_set(context: Path, folder: str, kind: str, n_blocks: int, seconds: float) -> IndexSet:
    """The manifest entry of the indexes written into `context / folder`: every block's
    files present (ShardError otherwise), sized and hashed (and remembered by stat)."""
    from starqa.cache.shards import sha256_file

    layers, heads = block_shape(context / block_file(0))[:2]
    files, verified = [], read_verified(context, VERIFIED)
    for block in range(n_blocks):
        for layer in range(layers):
            for head in range(heads):
                name = index_file(block, layer, head)
                path = context / folder / name
                if not path.exists():
                    raise ShardError(f"the {kind} index {folder}/{name} was not written; "
                                     "nothing was kept")
                st = path.stat()
                sha = sha256_file(path)
                files.append(IndexFile(block=block, layer=layer, head=head, file=name,
                                       bytes=st.st_size, sha256=sha))
                verified[f"{folder}/{name}"] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha]
    with contextlib.suppress(OSError):
        write_json_atomic(context / VERIFIED, verified)
    return IndexSet(kind=kind, folder=folder, params=params(kind),
                    build_seconds=round(seconds, 3), files=tuple(files))


# ---------------------------------------------------------------------------------------
# the lazy build, and the command that (re)builds


def find_set(manifest: Manifest, kind: str) -> IndexSet | None:
    return next((s for s in manifest.indexes if s.kind == kind), None)


def rebuild_command(manifest: Manifest, kind: str) -> str:
    return f"starqa index {manifest.key} --index {kind}"


def ensure(manifest: Manifest, kind: str, *, rebuild: bool = False,
           on_build: Callable[[str], None] | None = None) -> Manifest:
    """The context with a set of `kind` indexes (flat needs none): built now when it has
    none (or `rebuild`), from its shards' keys, and committed (new folder, then the
    manifest, then the old folder removed) under the context's lock. A context whose folder
    is read-only and lacks them is a StarqaError that says where they can be built."""
    from starqa.cache import store
    from starqa.cache.manifest import read_manifest

    if kind not in KINDS:
        raise StarqaError(f"Unknown --index {kind!r}.", hint=f"choose {', '.join(KINDS)}")
    if kind == "flat" or (find_set(manifest, kind) is not None and not rebuild):
        return manifest
    folder = manifest.folder
    if not os.access(folder, os.W_OK):
        raise StarqaError(
            f"Context {manifest.name!r} has no {kind} indexes for top-k attention, and its "
            f"folder {folder} is read-only, so they cannot be built now.",
            hint=f"build them once where the cache is writable: {rebuild_command(manifest, kind)}"
                 f" (or ingest with --index {kind}); --index flat needs no index")
    with store.context_lock(folder.parent, folder.name):
        manifest = read_manifest(folder)  # another process may have built them meanwhile
        old = find_set(manifest, kind)
        if old is not None and not rebuild:
            return manifest
        from starqa.cache.shards import verify_checksums

        verify_checksums(manifest, contents=True)
        name = new_folder(kind)
        staging = folder / f".{name}.tmp"
        try:
            seconds = 0.0
            for block in range(len(manifest.blocks)):
                if on_build is not None:
                    on_build(f"Building {kind} indexes for top-k attention: block {block + 1} "
                             f"of {len(manifest.blocks)}")
                seconds += write_block(staging, kind, block, read_tensor(
                    folder / block_file(block), "k"))
            os.replace(staging, folder / name)
            built = hash_set(folder, name, kind, len(manifest.blocks), seconds)
            kept = tuple(s for s in manifest.indexes if s.kind != kind)
            manifest = write_manifest(folder, replace(manifest, indexes=(*kept, built)))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(folder / name, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(folder / old.folder, ignore_errors=True)
        return manifest


# ---------------------------------------------------------------------------------------
# verifying


def verify(manifest: Manifest, found: IndexSet, blocks: Sequence[int]) -> list[Path]:
    """The paths of `found`'s files for `blocks`, each present with its recorded size and
    sha256 (remembered by size, mtime and ctime in .verified-indexes.json, so an unchanged
    file is hashed once); a ShardError naming the file and the command that rebuilds the
    set otherwise."""
    from starqa.cache.shards import sha256_file

    remembered = read_verified(manifest.folder, VERIFIED)
    verified = dict(remembered)
    wanted = set(blocks)
    paths = []
    for entry in found.files:
        if entry.block not in wanted:
            continue
        key = f"{found.folder}/{entry.file}"
        path = manifest.folder / key
        hint = f"rebuild the {found.kind} indexes: {rebuild_command(manifest, found.kind)}"
        if not path.exists():
            raise ShardError(f"Index file {path} is missing.", hint=hint)
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        known = remembered.get(key)
        sha = known[3] if known and known[:3] == stamp else (
            sha256_file(path) if st.st_size == entry.bytes else "")
        if sha != entry.sha256:
            raise ShardError(f"Index file {path} fails its checksum (corrupt or modified).",
                             hint=hint)
        verified[key] = [*stamp, sha]
        paths.append(path)
    if verified != remembered:
        with contextlib.suppress(OSError):  # a read-only cache: verified, not remembered
            write_json_atomic(manifest.folder / VERIFIED, verified)
    return paths

