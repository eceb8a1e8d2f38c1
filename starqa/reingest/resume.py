"""Resuming an interrupted ingest. Phase 1 writes each block whole (a temporary file renamed
into the staging folder), and a block's stem names everything its KV depends on
(`starqa.reingest.reuse.address`), so the blocks finished before Ctrl-C, a crash or a killed
worker are the very blocks a full run would write: they are put into the content-addressed
store (`starqa.cache.blockstore`), and running the same ingest again links them in and
encodes only the rest."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from starqa.cache import blockstore, store
from starqa.cache.manifest import block_file
from starqa.core import tensorfile
from starqa.reingest import reuse


def keep_finished(plan: reuse.Plan, block_store: Path, folder: Path,
                  todo: Iterable[int]) -> int:
    """The blocks of `todo` that `folder` holds whole, put into the store under their stems
    (`plan.stems`); how many."""
    from starqa.cache.shards import sha256_file

    kept = 0
    for index in todo:
        kv, block_stem = folder / block_file(index), plan.stems[index]
        if _whole(kv) and not blockstore.has(block_store, block_stem):
            blockstore.adopt(block_store, folder, index, block_stem)
            blockstore.record(block_store, block_stem, sha256_file(kv))
            kept += 1
    return kept


def _whole(path: Path) -> bool:
    """Whether a block file is whole: its header reads, and its data ends where the file
    does."""
    try:
        start, head = tensorfile.header(path)
        end = max(entry["data_offsets"][1] for name, entry in head.items()
                  if name != "__metadata__")
        return path.stat().st_size == start + end
    except (OSError, ValueError, KeyError, TypeError):
        return False


def recover(root: Path, key: str, plan: reuse.Plan, block_store: Path) -> int:
    """The finished blocks of earlier ingests of context `key` on this machine whose process
    died before it could keep them (a crash, `kill -9`: its staging folder was left), kept
    now and their folders removed; how many blocks."""
    kept = 0
    for folder in store.stale_staging(root, key):
        kept += keep_finished(plan, block_store, folder, plan.todo)
        shutil.rmtree(folder, ignore_errors=True)
    return kept
