"""The Typer app the commands are registered on (their table is `starqa.cli`), and what
`main` and `eval` share: SIGTERM taken as Ctrl-C."""

from __future__ import annotations

import contextlib
import signal

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Ask questions about documents and code too long for ordinary LLM "
                       "inference (Star Attention on torchrun workers).")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM stops as Ctrl-C does while inside; the handler before it comes back after
    (a caller in the same process, as tests are, and the processes it forks, keep theirs)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
