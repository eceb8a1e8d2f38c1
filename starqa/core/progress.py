"""The progress protocol between the code that does the work (the launchers
`starqa.launchers.ingest` and `starqa.launchers.ask`, and `starqa.models` fetching a model) and
what draws it: the CLI's rich display (`starqa.cli.ui.RichUI`) implements it; the default does
nothing (tests, eval, bench)."""

from __future__ import annotations

import contextlib


class UI:
    """Progress callbacks; the default does nothing."""

    def status(self, message: str):
        """A context manager shown while a step runs (steps may nest: the inner one shows)."""
        return contextlib.nullcontext()

    def note(self, message: str) -> None:
        """A one-line fact worth keeping on screen (a model installed, and where)."""

    def waiting(self, message: str) -> None:
        """Workers are starting; shown until encoding starts or the first token arrives."""

    def start_encoding(self, total_tokens: int, workers: int) -> None: ...

    def advance(self, tokens: int) -> None: ...

    def token(self, text: str) -> None: ...

    def stop_wanted(self) -> bool:
        """Whether whoever reads the answer wants it to end now (a stop string appeared, the
        reader cancelled or left): a warm group is then told to cancel."""
        return False
