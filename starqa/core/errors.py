"""Errors a user can act on. The CLI prints their message (and hint) without a traceback."""

import errno


class StarqaError(Exception):
    """A problem with the user's input or environment, explained in the message."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ShardError(StarqaError):
    """A cached shard is missing, corrupt, or does not match its manifest."""


class ContextNotFound(StarqaError):
    """No context has that name, key or key prefix (or none is ingested yet): raised by
    the cache's lookup (`starqa.cache.store.match_context`)."""


class ContextLengthError(StarqaError):
    """The context, the question and the longest answer asked for do not fit the model's
    window: raised by the one room check (`starqa.corpus.prompt.room_error`), wherever it
    runs (the message has the numbers; the hint, the ways to make them fit)."""


class Stopped(StarqaError):
    """An answer's reader left (or withdrew its question) before the answer was complete:
    there is no answer to read."""


class WorkerError(StarqaError):
    """A torchrun worker died; the message carries the tail of its stderr."""


def disk_full(err: OSError, who: str) -> StarqaError | None:
    """A write that failed for want of space (or quota), as an error a user can act on;
    None for any other OSError. Writes go to a staging folder that is committed whole or
    not at all, so nothing of the failed run is kept."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = f" ({err.filename})" if err.filename else ""
    return StarqaError(
        f"{who} ran out of disk space while writing{where}. Nothing of this run was kept; "
        "the cache is as it was before.",
        hint="free space (starqa cache shows what the cache holds; starqa cache --clean or "
             "starqa rm NAME removes contexts), or put the cache on a larger disk with "
             "STARQA_HOME=/path, then run the command again")
