"""The errors of starqa's Python API: the CLI's own (`StarqaError`: a message and a hint),
with the two that every door answers differently told apart (HTTP: 404 and 400), and the
one a stopped stream raises. Each is a `StarqaError`, so one `except` catches them all."""

from __future__ import annotations

from starqa.core.errors import ShardError, StarqaError

__all__ = ["ContextLengthError", "ContextNotFound", "ShardError", "StarqaError", "Stopped"]


class ContextNotFound(StarqaError):
    """No context has that name, key or key prefix (or none is ingested yet)."""


class ContextLengthError(StarqaError):
    """The context, the question and the longest answer asked for do not fit the model's
    window (the message has the numbers; the hint, the ways to make them fit)."""


class Stopped(StarqaError):
    """The stream was closed before its answer was complete: there is no answer to read."""


def as_not_found(error: StarqaError) -> ContextNotFound:
    return ContextNotFound(str(error), hint=error.hint)


def as_too_long(error: StarqaError) -> ContextLengthError:
    return ContextLengthError(str(error), hint=error.hint)
