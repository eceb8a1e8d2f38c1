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


class ProgressLog:
    """Encoding progress as plain lines, for a log rather than a terminal: one when `every`
    seconds have passed since the last, and one at the end, each with the rate so far and
    the time left at that rate ("Encoded 7,680 of 46,746 tokens (16%) · 120 tok/s · about
    5 min 25 s left")."""

    def __init__(self, total: int, started: float, every: float = 30.0):
        self.total, self.started, self.every = total, started, every
        self.done = 0
        self.last = started

    def advance(self, tokens: int, now: float) -> str | None:
        """Count `tokens` more encoded at time `now`; the line to print, or None."""
        self.done += tokens
        if self.done < self.total and now - self.last < self.every:
            return None
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        share = self.done / max(self.total, 1)
        line = f"Encoded {self.done:,} of {self.total:,} tokens ({share:.0%}) · {rate:,.0f} tok/s"
        if self.done < self.total and rate > 0:
            line += f" · about {_duration((self.total - self.done) / rate)} left"
        return line


def _duration(seconds: float) -> str:
    """'3 h 2 min', '5 min 25 s', '40 s'."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds} s"
