"""Corpus selection and packing.

`collect` chooses which files under the user's paths become the context (git's view of a
work tree, `.gitignore`s elsewhere, no hidden, lock, binary, oversized or non-UTF-8 files)
and says why each other file was skipped. `pack` lays the chosen files out as one text, each
inside a `<document path="...">` block, and returns every file's character span so that
answers can point back to files and lines. No model code here.

In data-flow order: `sources.py` (what a corpus is made of), `git.py` (a folder's git, read
without running anything its config names), `selection.py` (`collect`, `candidates`),
`packing.py` (`pack` and the text's escapes); `watch.py` watches the chosen files and
`prompt.py` puts the packed text into the model's prompt.
"""

from starqa.corpus.git import BARE, NESTED, SUBMODULE
from starqa.corpus.packing import content_hash, escape_body, header, line_of, pack, valid_text
from starqa.corpus.selection import (CACHE, LOCK_FILES, NOT_UTF8_NAME, STARQAIGNORE, candidates,
    collect)
from starqa.corpus.sources import OUTSIDE, Corpus, FileSpan, Skipped, TextFile

__all__ = ["BARE", "CACHE", "LOCK_FILES", "NESTED", "NOT_UTF8_NAME", "OUTSIDE", "STARQAIGNORE",
           "SUBMODULE", "Corpus", "FileSpan", "Skipped", "TextFile", "candidates", "collect",
           "content_hash", "escape_body", "header", "line_of", "pack", "valid_text"]
