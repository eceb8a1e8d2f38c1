"""Carrying out a reuse plan (`starqa.reingest.reuse.plan`) in a folder of blocks: the blocks the
store holds linked in, the moved ones re-rotated there, and afterwards every block of the
folder put into the store with its checksum. The one code path of `ingest` (whatever
encodes the blocks in between: this process or a worker group) and of `eval --edit`
(which encodes in its own process), so both reuse exactly the same way.

    store:  contexts/.blocks (starqa.cache.blockstore);  folder: a staging folder of block files
"""

from __future__ import annotations

from pathlib import Path

from starqa.cache import blockstore, shards
from starqa.reingest import reuse
from starqa.cache.manifest import Block, block_file


def rope(model_path) -> object | None:
    """The model's RoPE frequencies when its blocks can be re-rotated, else None."""
    from starqa.reingest.rotate import inv_freq

    return inv_freq(Path(model_path))


def block_model(model_digest: str, model_path, length: int) -> str:
    """What the blocks' addresses name as their model: its fingerprint, and the RoPE's set
    where the frequencies depend on the context's `length` (starqa.models.rope.Rope.key:
    dynamic past its window, longrope past its original one), so a block encoded with one
    set is never reused under another."""
    from starqa.models.rope import Rope

    try:
        key = Rope.of(Path(model_path)).key(length)
    except (OSError, ValueError, KeyError):
        key = None
    return model_digest if key is None else f"{model_digest}+{key}"


def keep(plan: reuse.Plan, store: Path, folder: Path, blocks, freqs, method: str) -> None:
    """The blocks the store holds linked into `folder`; the moved ones re-rotated there
    (freqs: `rope`'s, needed when the plan rotates any)."""
    for i in plan.reused:
        blockstore.link_in(store, plan.stems[i], folder, i)
    if plan.rotated:
        from starqa.reingest.rotate import rerotate_file

        for i, source, delta in plan.rotated:
            start, end = blocks[i]
            rerotate_file(blockstore.kv_file(store, source), folder / block_file(i), delta,
                          freqs, {"index": str(i), "start": str(start), "end": str(end),
                                  "method": method, "rerotated_by": str(delta)})


def adopt(plan: reuse.Plan, store: Path, folder: Path, blocks) -> tuple[Block, ...]:
    """Every block of `folder` (kept and encoded) put into the store under its stem and
    hashed for the manifest; each checksum recorded beside its stored file. Linking changes
    a file's ctime, so the files are linked before they are stamped."""
    for index, block_stem in enumerate(plan.stems):
        blockstore.adopt(store, folder, index, block_stem)
    hashed = shards.hash_blocks(folder, blocks, known=plan.known)
    for block, block_stem in zip(hashed, plan.stems):
        blockstore.record(store, block_stem, block.sha256)
    return hashed
