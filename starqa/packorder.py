"""The order files are packed in, chosen so that re-ingesting a changed folder re-encodes
little (issue #14).

Block 0 holds the first files, and star's anchor lives in it: every block is encoded after
the anchor, so an edit there re-encodes the whole context (and for the prefix methods, an
edit re-encodes every block after it). So the files that change least go first:

- A first ingest lays the files out oldest first, by when each last changed
  (`corpus.SourceFile.changed`: the last commit that touched it in a git work tree, else
  its mtime), ties by path. Release metadata (changelogs, PKG-INFO, version files) and the
  files someone works on now end up last.
- A re-ingest keeps the previous version's order for every file still there, and puts new
  files after them (oldest first): an edited file stays where it was, so only the blocks
  that hold it change, and later blocks at most move (star re-rotates them).
- Except when a file in the previous version's first block (or star's anchor, when longer)
  changed or went: every block is encoded again then anyway, so the layout is chosen afresh,
  oldest first, at no extra cost. (`--force` keeps the layout: it re-encodes the same
  context.)

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from starqa.corpus import SourceFile
from starqa.manifest import Manifest
from starqa.reuse import file_sha


def by_age(files: Sequence[SourceFile]) -> tuple[SourceFile, ...]:
    """Oldest change first, ties by path."""
    return tuple(sorted(files, key=lambda f: (f.changed, f.path)))


def keeping(files: Sequence[SourceFile], previous: Sequence[str]) -> tuple[SourceFile, ...]:
    """The files still in `previous` (paths in context order) in that order, then the new
    ones oldest first."""
    rank = {path: i for i, path in enumerate(previous)}
    kept = sorted((f for f in files if f.path in rank), key=lambda f: rank[f.path])
    return (*kept, *(f for f in by_age(files) if f.path not in rank))


def head_changed(previous: Manifest, files: Sequence[SourceFile]) -> str | None:
    """The first file of `previous`'s head (its block 0, or star's anchor when longer) that
    is gone or changed in `files`, else None."""
    head = max(previous.blocks[0].end if previous.blocks else 0,
               previous.method.anchor_size or 0)
    now = {f.path: f for f in files}
    for old in previous.files:
        if old.token_start >= head:
            break
        new = now.get(old.path)
        if new is None or old.sha256 is None or file_sha(new.text) != old.sha256:
            return old.path
    return None


def order(files: Sequence[SourceFile], previous: Manifest | None) -> tuple[SourceFile, ...]:
    """The packing order of `files` (see the module docstring); `previous`: the last context
    of the same sources, method, model and dtype, if any."""
    if previous is None or head_changed(previous, files) is not None:
        return by_age(files)
    return keeping(files, [f.path for f in previous.files])
