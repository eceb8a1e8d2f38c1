"""Warm worker groups through the Python API: start one for a context (or find the one that
runs), stop it, and ask it a question with the conversation so far, over its socket
(`starqa.workers.client`). Questions for one context can also take turns (`Turns`), first
come first served, so that a door with many clients asks its group one at a time."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass

import starqa.api.answers as answers
from starqa import engine
from starqa.api.answers import Answer, Question, Timings
from starqa.api.catalog import Context, find
from starqa.api.errors import Stopped, StarqaError, as_too_long
from starqa.api.streams import Channel
from starqa.cache.manifest import Manifest
from starqa.workers import client


@dataclass(frozen=True)
class Group:
    """A warm worker group serving one context (`starqa ps` lists them)."""

    key: str
    name: str
    workers: int
    pid: int
    keepalive: float  # idle seconds before it exits; <= 0: never

    @classmethod
    def of(cls, info: dict) -> Group:
        return cls(key=info["key"], name=info["name"], workers=info["workers"],
                   pid=info["pid"], keepalive=info["keepalive"])


@dataclass(frozen=True)
class GroupSettings:
    """How the groups a door starts run: workers (None: as `starqa serve` chooses) and the
    idle seconds before one exits (<= 0: never)."""

    workers: int | None = None
    keepalive: float = engine.DEFAULT_KEEPALIVE


def warm(context: Context | str | None = None, *, workers: int | None = None,
         keepalive: float = engine.DEFAULT_KEEPALIVE) -> Group:
    """The warm group serving `context`: the one that runs, else one started now (this
    waits until its workers are ready), which exits after `keepalive` idle seconds."""
    return Group.of(_running(find(context).key, GroupSettings(workers, keepalive)))


def stop(context: Context | str | None = None) -> bool:
    """Stop the warm group serving `context`; False when none ran."""
    return client.stop_group(find(context).key)


def _running(key: str, settings: GroupSettings) -> dict:
    """The run info of context `key`'s group (`client.running`), started if none runs."""
    group = client.find(key)
    if group is None:
        group = client.start(key, settings.workers, settings.keepalive)
    return group


def _connect(key: str, settings: GroupSettings) -> tuple[dict, client.Client]:
    """A connection to context `key`'s group, started if none runs (or the one found died)."""
    group = _running(key, settings)
    try:
        return group, client.Client(group)
    except client.Unreachable:  # it died without cleaning up: start another
        client.forget(group)
        group = client.start(key, settings.workers, settings.keepalive)
        return group, client.Client(group)


def ask_group(question: Question, context: Context, settings: GroupSettings,
              channel: Channel, turns: Turns | None = None) -> Answer:
    """Answer `question` on the context's warm group, each piece into `channel`; its turn
    taken in `turns` first, where given. A stop the reader asks for (`channel`) cancels the
    answer there and still reads its record (sources, timings) to the end."""
    asked = time.perf_counter()
    with turns.turn(context.key, channel) if turns else contextlib.nullcontext():
        group, conn = _connect(context.key, settings)
        try:
            sent = time.perf_counter()
            done, first = _events(conn, question, channel)
        except StarqaError as error:
            raise classified(error, find(context.key), question) from None
        finally:
            conn.close()
    end = time.perf_counter()
    timings = Timings(total_s=end - sent, first_token_s=(first - sent) if first else None,
                      prefill_s=done["first_token_s"], decode_s=done["decode_s"],
                      wait_s=sent - asked)
    return answers.of_group(done, context, group, timings, question.max_new_tokens)


def _events(conn: client.Client, question: Question, channel: Channel) -> tuple[dict, float]:
    """The group's answer: (its `done` event, when its first token came)."""
    first, cancelled = 0.0, False
    for event in conn.ask(question.text, question.history, question.max_new_tokens,
                          question.beyond_window):
        if channel.stop_wanted and not cancelled:
            conn.cancel()  # the group stops at its next token and sends its record
            cancelled = True
        if event["event"] == "token":
            first = first or time.perf_counter()
            if not channel.closed.is_set():
                channel.piece(event["text"])
        elif event["event"] == "done":
            return event, first
    raise StarqaError("The warm group ended the answer without its record.")


def classified(error: StarqaError, manifest: Manifest, question: Question) -> StarqaError:
    """`error`, as a ContextLengthError where the context, the question and its longest
    answer do not fit the window (whatever said so: the group, a cold ask); the check
    runs only once something has failed."""
    if question.beyond_window or type(error) is not StarqaError:
        return error  # a damaged shard, a worker's death: never about the window
    from pathlib import Path

    from starqa.corpus import prompt

    try:
        ids = prompt.QueryTokens(manifest.query_template, Path(manifest.model.path)).ids(
            question.text)
    except Exception:  # the model moved or cannot be read: the error says what it says
        return error
    if prompt.room_error(manifest.n_tokens, len(ids), question.max_new_tokens,
                         manifest.model.window) is None:
        return error
    return as_too_long(error)


class Turns:
    """One question at a time per context, in the order they came. A question whose reader
    leaves while it waits leaves the queue (`Stopped`)."""

    def __init__(self):
        self._lock = threading.Condition()
        self._waiting: dict[str, collections.deque] = {}
        self._busy: set[str] = set()

    @contextlib.contextmanager
    def turn(self, key: str, channel: Channel):
        me = object()
        with self._lock:
            line = self._waiting.setdefault(key, collections.deque())
            line.append(me)
            try:
                while line[0] is not me or key in self._busy:
                    if channel.closed.is_set():
                        raise Stopped("The question was withdrawn while it waited its turn.")
                    self._lock.wait(0.1)
            finally:
                line.remove(me)
                self._lock.notify_all()
            self._busy.add(key)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(key)
                self._lock.notify_all()

    def waiting(self) -> int:
        """Questions waiting for their turn, over every context."""
        with self._lock:
            return sum(len(line) for line in self._waiting.values())

    def answering(self) -> int:
        """Questions being answered now (one per context at most)."""
        with self._lock:
            return len(self._busy)
