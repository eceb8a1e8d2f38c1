"""Warm worker groups through the Python API: start one for a context (or find the one that
runs), stop it, and ask it a question with the conversation so far, over its socket
(`starqa.workers.client`). Questions for one context can also take turns (`Turns`), first
come first served, so that a door with many clients asks its group as many at a time as it
answers together (`core.MAX_BATCH`).

The machine's groups as `starqa ps`, `stop` and `serve` see them are here too: the ones
running (`running_groups`), the ones to stop and what became of each (`stopping`,
`stop_groups`), a group kept in this process (`serve`), and the hand-over of a context's
group to its new version after an ingest (`hand_over`)."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from starqa import engine
from starqa.api.catalog import find
from starqa.api.errors import Stopped
from starqa.api.streams import Channel
from starqa.cache.context import Context
from starqa.cache.manifest import Manifest
from starqa.core import MAX_BATCH
from starqa.core.progress import UI
from starqa.phase2.answer import Answer, Question
from starqa.topk import indexes
from starqa.topk.indexes import TopK
from starqa.workers import client, messages, runfile
from starqa.workers.runfile import RunInfo
from starqa.workers.client import elsewhere, wait_started


@dataclass(frozen=True)
class Group:
    """A warm worker group serving one context (`starqa ps` lists them)."""

    key: str
    name: str
    workers: int
    pid: int
    keepalive: float  # idle seconds before it exits; <= 0: never

    @classmethod
    def of(cls, info: RunInfo) -> Group:
        return cls(key=info.key, name=info.name, workers=info.workers, pid=info.pid,
                   keepalive=info.keepalive)


@dataclass(frozen=True)
class GroupSettings:
    """How the groups a door starts run: workers (None: as `starqa serve` chooses), the
    idle seconds before one exits (<= 0: never) and top-k attention (None: exact)."""

    workers: int | None = None
    keepalive: float = engine.DEFAULT_KEEPALIVE
    topk: TopK | None = None


def warm(context: Context | str | None = None, *, workers: int | None = None,
         keepalive: float = engine.DEFAULT_KEEPALIVE) -> Group:
    """The warm group serving `context`: the one that runs, else one started now (this
    waits until its workers are ready), which exits after `keepalive` idle seconds."""
    return Group.of(_running(find(context).key, GroupSettings(workers, keepalive)))


def stop(context: Context | str | None = None) -> bool:
    """Stop the warm group serving `context`; False when none ran."""
    return client.stop_group(find(context).key)


def running_groups() -> list[dict]:
    """Every warm group of this machine (`starqa ps`), as its run file describes it, with
    what the group says of itself now (questions answered, the query host's memory) where
    it answers within 5 s; a group busy answering or starting, and this machine's part of a
    group served from another, as their run files say. JSON-ready (`runfile.with_status`)."""
    return [runfile.with_status(group, _status(group)) for group in client.running()]


def _status(group: RunInfo) -> messages.GroupStatus | None:
    """What `group` says of itself within 5 s; None where it does not (busy answering or
    starting, or served from another machine)."""
    if not group.socket:  # part of a group served from another machine
        return None
    try:
        conn = client.Client(group, timeout=5)
        try:
            return conn.ping()
        finally:
            conn.close()
    except Exception:  # busy answering or starting: what the run file says
        return None


def stopping(refs: Sequence[str] | None) -> tuple[list[RunInfo], list[str]]:
    """What `starqa stop` ends: (the run info of the groups serving the contexts `refs`
    names, every group for None; the keys of those among them still starting, which a
    launcher holds and no run file names yet: `wait_started` waits for them)."""
    groups = client.running()
    keys = None if refs is None else {find(ref).key for ref in refs}
    if keys is not None:
        groups = [g for g in groups if g.key in keys]
    return groups, [k for k in client.starting() if keys is None or k in keys]


def stop_groups(groups: Sequence[RunInfo]) -> Iterator[tuple[RunInfo, str]]:
    """Stop each of `groups`, yielding it with what became of it: "stopped"; "died" (it
    had died without cleaning up: its run file and socket are removed); "elsewhere" (this
    machine's part of a group served from another: stopped from its query host, see
    `elsewhere`). When every one is such a part, the first's error is raised instead."""
    parts = [g for g in groups if not g.socket]
    if parts and len(parts) == len(groups):
        raise elsewhere(parts[0])
    for group in groups:
        if group in parts:
            yield group, "elsewhere"
        else:
            yield group, "stopped" if client.stop(group) else "died"


def serve(opts: engine.ServeOptions, ui: UI = UI(),
          on_ready: Callable[[RunInfo], None] | None = None) -> None:
    """Keep a warm group for `opts.context` in this process (`starqa serve`), until it is
    stopped (`stop`), its keep-alive runs out or KeyboardInterrupt; `on_ready` gets its run
    info once every worker is ready (across machines: each node's)."""
    engine.serve(opts, ui, on_ready)


def hand_over(result: engine.IngestResult) -> list[Group]:
    """After an ingest that encoded (not a cache hit), the warm groups that served an
    earlier version of the context (its name, another key) are stopped and one is started
    for the new version with their settings (`client.follow`); returns the groups
    replaced."""
    m = result.manifest
    if m is None or result.cache_hit:
        return []
    return [Group.of(info) for info in client.follow(m.name, m.key)]


def _running(key: str, settings: GroupSettings) -> RunInfo:
    """The run info of context `key`'s group (`client.running`), started if none runs."""
    group = client.find(key)
    if group is None:
        group = start(find(key), settings)
    return group


def start(manifest: Manifest, settings: GroupSettings, ui: UI = UI()) -> RunInfo:
    """Start a warm group for `manifest`'s context in the background (`starqa serve`) and
    return its run info once every worker is ready, the steps shown on `ui`; with top-k
    attention, its index files are checked (built where missing) first."""
    topk = settings.topk
    if topk is not None:
        with ui.status(f"Checking {topk.index} indexes"):
            indexes.ensure(manifest, topk.index)
    with ui.status(f"Starting workers for {manifest.name} (loading model and shards)"):
        return client.start(manifest.key, settings.workers, settings.keepalive,
                            attention=topk.cli_args() if topk else ())


def ask_group(question: Question, context: Context, settings: GroupSettings,
              channel: Channel, turns: Turns | None = None) -> Answer:
    """Answer `question` on the context's warm group (started with `settings` if none
    runs, or if the one found died), each piece into `channel`; its turn taken in `turns`
    first, where given. A stop the reader asks for (`channel`) cancels the answer there and
    still reads its record (sources, timings) to the end."""
    asked = time.perf_counter()
    with turns.turn(context.key, channel) if turns else contextlib.nullcontext():
        group = _running(context.key, settings)
        try:
            return client.ask_warm(group, question, context, _passing(channel),
                                   lambda: channel.stop_wanted, asked, channel.progress)
        except (client.Unreachable, client.GroupLeft):  # died, or was exiting: another
            client.forget(group)
            group = start(find(context.key), settings)
            return client.ask_warm(group, question, context, _passing(channel),
                                   lambda: channel.stop_wanted, asked, channel.progress)


def _passing(channel: Channel) -> Callable[[str], None]:
    """Each piece into `channel` while its reader is there."""
    def piece(text: str) -> None:
        if not channel.closed.is_set():
            channel.piece(text)
    return piece


class Turns:
    """Up to `limit` questions at a time per context (those its group answers together), the
    others waiting in the order they came. A question whose reader leaves while it waits
    leaves the queue (`Stopped`)."""

    def __init__(self, limit: int = MAX_BATCH):
        self.limit = limit
        self._lock = threading.Condition()
        self._waiting: dict[str, collections.deque] = {}
        self._busy: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def turn(self, key: str, channel: Channel):
        me = object()
        with self._lock:
            line = self._waiting.setdefault(key, collections.deque())
            line.append(me)
            try:
                while line[0] is not me or self._busy[key] >= self.limit:
                    if channel.closed.is_set():
                        raise Stopped("The question was withdrawn while it waited its turn.")
                    self._lock.wait(0.1)
            finally:
                line.remove(me)
                self._lock.notify_all()
            self._busy[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[key] -= 1
                self._lock.notify_all()

    def waiting(self) -> int:
        """Questions waiting for their turn, over every context."""
        with self._lock:
            return sum(len(line) for line in self._waiting.values())

    def answering(self) -> int:
        """Questions being answered now, over every context."""
        with self._lock:
            return sum(self._busy.values())
