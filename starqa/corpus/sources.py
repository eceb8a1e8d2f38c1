"""What a corpus is made of: the files chosen (`TextFile`), those left out and why
(`Skipped`), the whole choice (`Corpus`) and each file's place in the packed text
(`FileSpan`); and the rule git's walk and the plain walk share: a symlink that leaves the
folder is not followed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TextFile:
    """One file of the corpus as read (the context holds it as a `PackedFile`)."""

    path: str  # display path, forward slashes
    text: str  # UTF-8 text, LF line ends, no BOM
    size: int  # bytes on disk
    # When it last changed, seconds since the epoch: in a git work tree, the last commit
    # that touched a file left as committed (0: before the history read); else its mtime.
    # What `packorder` lays the files out by.
    changed: int = 0


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class Corpus:
    roots: tuple[str, ...]
    files: tuple[TextFile, ...]  # sorted by path (`packorder` lays them out for packing)
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class FileSpan:
    path: str
    char_start: int  # [char_start, char_end): the whole block, header and closing tag included
    char_end: int
    text_start: int  # where the file's own text begins
    lines: int


# A symlink whose target lies outside the folder being ingested is not followed: a
# downloaded repository could otherwise pull ~/.ssh or /etc into the context (and into
# answers and sources). A user who wants the target ingests it as a path of its own.
OUTSIDE = "symlink to outside the folder (not followed; pass its target to ingest it)"


def leaves(root: Path, path: Path) -> bool:
    """Whether `path`, a symlink or below one, resolves outside `root`."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep)
