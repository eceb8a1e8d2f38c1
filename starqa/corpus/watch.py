"""`starqa ingest --watch`: keep a context in step with the folders it was ingested from.

After the first ingest, the folders are watched (`watchfiles`); once files stop changing
for `QUIET_MS`, the sources are ingested again, incrementally (`ingest.ingest`: only the
blocks that changed are encoded; the commit is atomic, so stopping at any moment leaves
the previous context whole). A change only counts when it touches what `ingest` reads:
a file of the last ingest, an ignore file (`.gitignore`, `.starqaignore`), or a new file
the same selection rules (`corpus.candidates`: git, ignore files, --include, --exclude)
would take; edits to ignored files cause no work. The caller's re-ingest also hands a
warm group over to the new version (`client.follow`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from starqa import corpus
from starqa.core.errors import StarqaError

QUIET_MS = 800  # re-ingest once no file changed for this long
MAX_WAIT_MS = 10_000  # ... or after this long, when files never stop changing
RULE_FILES = (".gitignore", corpus.STARQAIGNORE)


@dataclass(frozen=True)
class Selection:
    """What the watcher compares changes with: the real paths `ingest` would consider."""

    paths: tuple[str, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    files: frozenset[str] = frozenset()

    def refreshed(self) -> Selection:
        return Selection(self.paths, self.include, self.exclude,
                         frozenset(corpus.candidates(self.paths, include=self.include,
                                                     exclude=self.exclude)))

    def touched(self, changed: Iterable[str]) -> bool:
        """Does any changed path matter to an ingest? (a file it reads or would read, or
        a rule that chooses them)"""
        changed = {os.path.realpath(p) for p in changed}
        if any(Path(p).name in RULE_FILES for p in changed) or changed & self.files:
            return True
        return bool(changed & self.refreshed().files)  # added files the rules take


def watch(selection: Selection, reingest: Callable[[], None],
          on_error: Callable[[StarqaError], None], *, quiet_ms: int = QUIET_MS,
          stop_event=None) -> None:
    """Call `reingest` a moment after each burst of changes that touches the selection,
    until KeyboardInterrupt (or `stop_event` is set). A StarqaError of one re-ingest (a
    file grew past the window, a file became unreadable) goes to `on_error`, and watching
    goes on: the next edit may fix it."""
    from watchfiles import watch as changes

    selection = selection.refreshed()
    for batch in changes(*selection.paths, debounce=MAX_WAIT_MS, step=quiet_ms,
                         stop_event=stop_event, raise_interrupt=True):
        if not selection.touched(path for _, path in batch):
            continue
        try:
            reingest()
        except StarqaError as err:
            on_error(err)
        selection = selection.refreshed()
