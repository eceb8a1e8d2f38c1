"""The errors of starqa's Python API: the CLI's own (`StarqaError`: a message and a hint),
with the ones every door answers differently told apart (HTTP: 404 and 400), each raised
where the fact is known (`starqa.core.errors`), and the one a stopped stream raises. Each
is a `StarqaError`, so one `except` catches them all."""

from starqa.core.errors import (ContextLengthError, ContextNotFound, ShardError, StarqaError,
    Stopped)

__all__ = ["ContextLengthError", "ContextNotFound", "ShardError", "StarqaError", "Stopped"]
