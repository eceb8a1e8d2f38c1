"""The order files are packed in, chosen so that re-ingesting a changed folder re-encodes
little (issue #14).

Block 0 holds the first files, and star's anchor lives in it: every block is encoded after
the anchor, so an edit there re-encodes the whole context (and for the prefix methods, an
edit re-encodes every block after it). So the files that change least go first:

- A first ingest lays the files out oldest first, by when each last changed
  (`corpus.TextFile.changed`: the last commit that touched it in a git work tree, else
  its mtime), ties by path. Release metadata (changelogs, PKG-INFO, version files) and the
  files someone works on now end up last.
- A re-ingest keeps the previous version's order for every file still there, and puts new
  files after them (oldest first): an edited file stays where it was, so only the blocks
  that hold it change, and later blocks at most move (star re-rotates them).
- Except when that order changes the previous version's first block (or star's anchor,
  when longer), token for token: every block is encoded again then anyway, so the layout
  is chosen afresh, oldest first, at no extra cost (`ingest` packs twice then).
  `--force` keeps the layout: it re-encodes the same context.

Pure Python, no torch (the block files' token ids are read with safetensors' numpy API).
"""

from __future__ import annotations

from collections.abc import Sequence

from starqa.corpus import TextFile
from starqa.cache.manifest import Manifest


def by_age(files: Sequence[TextFile]) -> tuple[TextFile, ...]:
    """Oldest change first, ties by path."""
    return tuple(sorted(files, key=lambda f: (f.changed, f.path)))


def keeping(files: Sequence[TextFile], previous: Sequence[str]) -> tuple[TextFile, ...]:
    """The files still in `previous` (paths in context order) in that order, then the new
    ones oldest first."""
    rank = {path: i for i, path in enumerate(previous)}
    kept = sorted((f for f in files if f.path in rank), key=lambda f: rank[f.path])
    return (*kept, *(f for f in by_age(files) if f.path not in rank))


def head_kept(previous: Manifest, ids: Sequence[int]) -> bool:
    """Whether context `ids` starts with the same head as `previous`: its first block (or
    star's anchor, when longer), read back from the block files' own token ids. Unknown
    (a block file unreadable) counts as kept: the reuse plan decides what to encode."""
    from safetensors import safe_open

    head = max(previous.blocks[0].end if previous.blocks else 0,
               previous.method.anchor_size or 0)
    old: list[int] = []
    try:
        for block in previous.blocks:
            if block.start >= head:
                break
            with safe_open(str(previous.folder / block.file), framework="numpy") as f:
                old += f.get_tensor("ids").tolist()
    except Exception:  # noqa: BLE001 (any unreadable file: unknown)
        return True
    return list(ids[:head]) == old[:head]


def as_packed(files: Sequence[TextFile], manifest: Manifest) -> tuple[TextFile, ...]:
    """`files` (e.g. `corpus.collect`'s, sorted by path) in the order `manifest` packed them:
    a reference prompt rebuilt outside `ingest` (tests, benchmarks) is then the very one."""
    by_path = {f.path: f for f in files}
    return tuple(by_path[f.path] for f in manifest.files)
