"""Errors a user can act on. The CLI prints their message (and hint) without a traceback."""


class StarqaError(Exception):
    """A problem with the user's input or environment, explained in the message."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ShardError(StarqaError):
    """A cached shard is missing, corrupt, or does not match its manifest."""


class WorkerError(StarqaError):
    """A torchrun worker died; the message carries the tail of its stderr."""
