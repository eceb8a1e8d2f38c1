"""Incremental re-ingest (issue #14): which blocks of a new context are already stored,
which can be re-rotated from another position, which must be encoded; and what changed in
the files since the previous ingest of the same sources.

A block's address hashes everything its KV depends on: the model's fingerprint, the dtype,
the method's name and the block's inputs as its registry entry states them
(`Method.block_inputs`: star, the anchor's and the block's tokens; pulsar, its assembled
input; dense, ring and apb, every token before it and how it was cut). The position offset
is named beside it (`blockstore.stem`). Whether an address is found decides reuse; the
method's `reuse` kind decides what follows a block that is not found ("prefix": every
later block is encoded too). Launcher side, no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from starqa.cache import blockstore
from starqa import methods
from starqa.methods import MethodConfig

ADDRESS_FORMAT = 1


def address(model_digest: str, dtype: str, method: str, inputs: dict) -> str:
    material = json.dumps({"format": ADDRESS_FORMAT, "model": model_digest, "dtype": dtype,
                           "method": method, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class Plan:
    """Per block of the new context: its stem, and what happens to it."""

    stems: tuple[str, ...]
    reused: tuple[int, ...] = ()  # found in the store: linked in
    rotated: tuple[tuple[int, str, int], ...] = ()  # (block, stored stem, δ positions)
    todo: tuple[int, ...] = ()  # encoded
    known: dict[int, str] = field(default_factory=dict)  # reused blocks' checked sha256


@dataclass(frozen=True)
class BlockStore:
    """The content-addressed block store a plan looks in (`blockstore.store_dir`), and what
    its blocks' addresses hash besides their inputs: the model's fingerprint, the dtype."""

    folder: Path
    model_digest: str
    dtype: str


def plan(config: MethodConfig, ids, blocks, prepared: dict | None, store: BlockStore, *,
         force: bool = False, rotate: bool = True) -> Plan:
    """What to do with each block: reuse what the store holds (checked against its recorded
    checksum), re-rotate a star block that only moved (`rotate`: the model's RoPE allows
    it) by at most a block's length from where it was encoded exactly (the error grows with
    the distance: benchmarks/rerotate_error.py), encode the rest. `force`: encode every
    block."""
    encoder = methods.get(config.name)
    addresses = [address(store.model_digest, store.dtype, config.name,
                         encoder.block_inputs(ids, config, blocks, i, prepared))
                 for i in range(len(blocks))]
    folder = store.folder
    stems = [blockstore.stem(a, start) for a, (start, _) in zip(addresses, blocks)]
    if force:
        return Plan(tuple(stems), todo=tuple(range(len(blocks))))
    reused, rotated, todo, known = [], [], [], {}
    for i, (addr, (start, _)) in enumerate(zip(addresses, blocks)):
        if todo and encoder.reuse == "prefix":  # after a change, every later block
            todo.append(i)
            continue
        # exactly encoded first, else one re-rotated to this offset before
        for candidate in (stems[i], blockstore.stem(addr, start, rotated=True)):
            if blockstore.has(folder, candidate) and (
                    sha := blockstore.checked_sha(folder, candidate)):
                reused.append(i)
                known[i], stems[i] = sha, candidate
                break
        else:
            if encoder.position_free(config) and (same := _anywhere(folder, addr)):
                reused.append(i)  # its KV is the same at any offset: kept as it is
                known[i], stems[i] = same
                continue
            moved = sorted((abs(start - offset), offset, stored) for offset, stored
                           in blockstore.offsets(folder, addr)
                           if abs(start - offset) <= config.block_size) \
                if rotate and encoder.rotatable(config) else []
            source = next(((offset, stored) for _, offset, stored in moved
                           if blockstore.checked_sha(folder, stored)), None)
            if source is None:
                todo.append(i)
            else:
                rotated.append((i, source[1], start - source[0]))
                stems[i] = blockstore.stem(addr, start, rotated=True)
    return Plan(tuple(stems), tuple(reused), tuple(rotated), tuple(todo), known)


def _anywhere(folder: Path, addr: str) -> tuple[str, str] | None:
    """(checksum, stem) of an exactly encoded, intact file of `addr` at any offset."""
    for _, stored in blockstore.offsets(folder, addr):
        if sha := blockstore.checked_sha(folder, stored):
            return sha, stored
    return None


# ---------------------------------------------------------------------------------------
# what changed in the files


@dataclass(frozen=True)
class Changes:
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def touches(self, old_spans: dict[str, tuple[int, int]],
                new_spans: dict[str, tuple[int, int]], end: int) -> list[str]:
        """The changed, added or removed files that lie (before or after) in tokens [0, end)."""
        return [p for p in (*self.changed, *self.added, *self.removed)
                if any(span[0] < end for span in (old_spans.get(p), new_spans.get(p)) if span)]


def file_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def changes(previous: dict[str, str | None], current: dict[str, str]) -> Changes:
    """Files changed, added and removed between two {path: sha256} maps (a previous file
    without a recorded checksum counts as changed)."""
    return Changes(
        changed=tuple(sorted(p for p in current if p in previous and previous[p] != current[p])),
        added=tuple(sorted(p for p in current if p not in previous)),
        removed=tuple(sorted(p for p in previous if p not in current)))


@dataclass(frozen=True)
class Reuse:
    """What an incremental ingest did, for the report (`ui.ingest_report`)."""

    blocks: int
    reused: int
    rotated: int
    encoded: int
    changes: Changes | None  # None: no earlier context of these sources to compare with
    why: str | None = None  # why more was encoded than the changed files' blocks
    in_process: bool = False  # encoded in the launcher, no worker group started


def kept_block_size(previous: int, n_tokens: int) -> int | None:
    """The block size a re-ingest of `n_tokens` plans with when the previous version used
    `previous` and none is given: the previous one while the default for the new length
    stays within 2x of it, else None (the default). The default follows the length, so an
    edit of a few tokens could move it a step, and every block boundary with it: nothing
    would be reused."""
    from starqa.methods import default_block

    default = default_block(n_tokens)
    return previous if default / 2 <= previous <= default * 2 else None
