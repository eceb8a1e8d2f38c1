"""The warm group's socket protocol: what a client asks (`Ask`, `Cancel`, `Ping`, `Stop`) and
what the group answers (`Piece`, `Progress`, `Finished`, `Failed`, `GroupStatus`,
`Stopping`), as frozen
dataclasses read and written with `starqa.runtime.protocol`'s codec.

On the socket each message is one JSON line: a request's fields plus `"op"` naming it, an
event's fields plus `"event"`:

    → {"op": "ask", "question": "...", "history": [[q, a], ...], "max_new_tokens": 256}
      (optional "beyond_window": true, "draft_tokens": 0 to core.MAX_DRAFT_TOKENS)
    ← {"event": "progress", "processed": 4200, "total": 4219, ...} (after each part of its
      prefill) {"event": "token", "text": "..."} ...  {"event": "done", "token_ids": [...]}
    → {"op": "cancel"}   (while an answer streams: stop it, keep the session)
    → {"op": "ping"}     ← {"event": "pong", "workers": 2, ...}
    → {"op": "stop"}     ← {"event": "stopping"}: the group ends

Any local process of the group's user may write to the socket, so `read_request` checks a
line field by field and `Ask.problem` checks the values; what is wrong comes back as a
`BadRequest` naming it, answered with a `Failed` event while the group keeps serving.
Imports nothing heavy: `starqa ask` reads these without torch.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import ClassVar, Union

from starqa.core import MAX_DRAFT_TOKENS
from starqa.core.errors import ContextLengthError, StarqaError
from starqa.phase2.answer import Progress
from starqa.runtime.protocol import ProtocolError, decode_tagged, encode


class BadRequest(ProtocolError):
    """A request line the group cannot take: what is wrong with it."""


# -------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Ask:
    """Answer `question` after the conversation's earlier turns `history` (as many of the
    latest as fit the window; the whole question must), in at most `max_new_tokens`."""

    OP: ClassVar[str] = "ask"
    question: str
    history: tuple[tuple[str, str], ...] = ()
    max_new_tokens: int = 256
    beyond_window: bool = False  # past the model's trained window, when asked to
    draft_tokens: int | None = None  # per forward (decode.Batch); None: the group's

    def problem(self) -> str | None:
        """What is wrong with the values, None when nothing is."""
        if not self.question.strip():
            return "the question is empty"
        if self.max_new_tokens < 1:
            return "max_new_tokens must be a positive integer"
        if self.draft_tokens is not None and not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return f"draft_tokens must be an integer from 0 to {MAX_DRAFT_TOKENS}"
        return None


@dataclass(frozen=True)
class Cancel:
    """Stop the answer being streamed to this client; the group keeps serving."""

    OP: ClassVar[str] = "cancel"


@dataclass(frozen=True)
class Ping:
    """Report the group's state (`GroupStatus`, the event "pong")."""

    OP: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Stop:
    """End the group (an answer being streamed to another client is cut short)."""

    OP: ClassVar[str] = "stop"


Request = Union[Ask, Cancel, Ping, Stop]
REQUESTS: dict[str, type] = {cls.OP: cls for cls in typing.get_args(Request)}


def request_line(request: Request) -> bytes:
    return (json.dumps({"op": request.OP, **encode(request)}) + "\n").encode()


def read_request(line: bytes) -> Request:
    """The request of one socket line; BadRequest naming what is wrong with any other."""
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("not a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest("not a JSON object")
    try:
        request = decode_tagged(data, "op", REQUESTS, "request")
    except ProtocolError as err:
        raise BadRequest(str(err).rstrip(".")) from None
    if isinstance(request, Ask) and (problem := request.problem()):
        raise BadRequest(problem)
    return request


# ---------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Piece:
    """The answer's next piece of text (whole characters: `prompt.TextStream`)."""

    EVENT: ClassVar[str] = "token"
    text: str


@dataclass(frozen=True)
class Finished:
    """The answer is complete: its text and token ids, the question's length in tokens with
    the earlier turns it kept, the top sources (None under top-k), whether it was cancelled,
    and its timings (first token, decode after it, total) and the query host's memory."""

    EVENT: ClassVar[str] = "done"
    text: str
    token_ids: tuple[int, ...]
    question_tokens: int
    turns_used: int
    sources: tuple[dict, ...] | None
    cancelled: bool
    first_token_s: float | None
    decode_s: float
    total_s: float
    rss_bytes: int


@dataclass(frozen=True)
class Failed:
    """The request was not answered (or the answer was cut short): why, and what to do;
    `kind`, the error's type where a client tells it apart (`ERRORS`)."""

    EVENT: ClassVar[str] = "error"
    message: str
    hint: str | None = None
    kind: str = "StarqaError"

    @classmethod
    def of(cls, error: StarqaError) -> Failed:
        return cls(str(error), error.hint, type(error).__name__)

    def error(self) -> StarqaError:
        """The error this event reports, of its type where a client tells it apart."""
        return ERRORS.get(self.kind, StarqaError)(self.message, hint=self.hint)


# the errors a Failed event keeps the type of (`Failed.kind`)
ERRORS: dict[str, type[StarqaError]] = {cls.__name__: cls for cls in (ContextLengthError,)}


@dataclass(frozen=True)
class GroupStatus:
    """The group's state (`starqa ps`'s columns): its context, workers, questions answered
    and the query host's memory and process."""

    EVENT: ClassVar[str] = "pong"
    context: str
    key: str
    workers: int
    tokens: int
    method: str
    answered: int
    rss_bytes: int
    pid: int


@dataclass(frozen=True)
class Stopping:
    """The group is ending, as a `Stop` asked."""

    EVENT: ClassVar[str] = "stopping"


Event = Union[Piece, Progress, Finished, Failed, GroupStatus, Stopping]
EVENTS: dict[str, type] = {cls.EVENT: cls for cls in typing.get_args(Event)}


def event_line(event: Event) -> bytes:
    return (json.dumps({"event": event.EVENT, **encode(event)}) + "\n").encode()


def read_event(line: bytes) -> Event:
    """The event of one socket line; ProtocolError naming what is wrong with any other."""
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError(f"The worker group sent a line that is not JSON: {line[:60]!r}.") \
            from None
    return decode_tagged(data, "event", EVENTS, "event")
