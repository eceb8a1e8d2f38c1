"""The warm worker group's front door: a Unix socket served by the query host.

Runs inside the query-host worker of a `serve` group. Requests and events are JSON lines,
the typed messages of `starqa.workers.messages` (which shows them): `Ask`, `Cancel`, `Ping`,
`Stop` in; `Piece`s then `Finished` (or `Failed`), `GroupStatus`, `Stopping` out.

Questions from several clients are answered together: each joins the group's batch
(`starqa.phase2.decode.Batch`) at the next forward and streams its pieces to its own
client; a client's cancel, or its leaving, ends its own answer only. One client's
questions are taken one after another.

The socket lives in a short private folder (`paths.socket_dir`, mode 0700), itself mode
0600: only the user who started the group can connect, and only from this machine. The
query host tokenises the questions and picks each token; the other workers receive what to
do next by broadcast: a `Step` (these `Turn`s join, then a forward; stop; or nothing), in
`starqa.runtime.protocol`'s codec. Any local client may write to the socket: a malformed
request is answered with a `Bad request` error naming the problem, while the group keeps
serving.

Files changed under a warm group: before each question the query host compares a stat
(size, mtime, ctime, inode) of the manifest and of each shard with what it had when the
group loaded them (a few stats; nothing is read). A shard rewritten in place with the same
bytes (its checksum is checked then) or a manifest rewritten with the same blocks (a rename)
is taken as it is; any other change is refused: the asker gets an error naming the file and
the group stops, so the next question starts afresh from the files as they are now (and a
damaged shard is named then, as a cold ask names it).
"""

from __future__ import annotations

import os
import select
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from starqa.cache.manifest import MANIFEST, Manifest
from starqa.core import MAX_BATCH
from starqa.runtime.protocol import ServeJob, decode, encode
from starqa.workers import messages

HEARTBEAT_S = 20.0  # the other workers wait in a collective; never longer than this


@dataclass(frozen=True)
class Turn:
    """One question every rank answers together: the query ids (the question after as many
    earlier turns as fit the window), the answer's length and stop tokens, and the draft
    tokens per forward (None: the group's default)."""

    query_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    turns_used: int  # earlier turns of the conversation the query ids hold
    draft_tokens: int | None = None


@dataclass(frozen=True)
class Step:
    """What every rank of the group does next, as the query host broadcasts it: "run" (the
    questions of `turns` join the batch, then one forward of every question under way),
    "stop", or "noop" (a heartbeat: nothing came within HEARTBEAT_S)."""

    op: str
    turns: tuple[Turn, ...] = ()


STOP, NOOP = Step("stop"), Step("noop")


def serve_group(job: ServeJob, info, answerer, manifest: Manifest, on_ready) -> None:
    """Every rank's loop of a warm group: the query host reads requests from the socket and
    broadcasts what to do; every rank joins the new questions to its batch
    (`starqa.phase2.decode.Batch`) and runs its next forward together, until `stop` (or
    idle). Questions from several clients are answered together, each streamed to its own
    client as its tokens come."""
    from starqa.phase2 import decode as batching
    from starqa.runtime import dist

    server = Server(job, answerer, manifest) if info.is_last else None
    batch = answerer.batch()
    on_ready()
    try:
        while True:
            step = encode(server.next_step(bool(batch.active))) if server else None
            step = decode(Step, dist.broadcast_object(info, step, src=info.world_size - 1))
            if step.op == "stop":
                break
            for index, turn in enumerate(step.turns):
                request = answerer.request(list(turn.query_ids), turn.max_new_tokens,
                                           list(turn.stop_ids), turn.draft_tokens)
                asking = server.joining[index] if server else None
                answering = batch.join(request, asking.callbacks() if asking else
                                       batching.Callbacks())
                if asking:
                    asking.answering = answering
            if server:
                server.joining = []
            if batch.active:
                for answering in batch.step():
                    top = answerer.sources(answering)  # every rank, in the same order
                    if server:
                        server.finish(answering, top)
    finally:
        batch.close()
        if server:
            server.close()


@dataclass(eq=False)
class Asking:
    """(Query host) A question from a client, waiting or being answered: the connection its
    answer streams to (None once the client left), its turn, its text so far and when it
    was taken up and its first token came."""

    server: Server
    conn: socket.socket | None
    turn: Turn
    stream: object = None  # its corpus.prompt.TextStream, made when it joins
    started: float = 0.0
    first: float | None = None
    cancelled: bool = False
    answering: object = None  # its phase2.decode.Answering once joined

    def callbacks(self):
        """What the batch calls for this question: each token to its client, and whether
        to stop (its client cancelled or left, or the group is stopping)."""
        from starqa.corpus.prompt import TextStream
        from starqa.phase2.decode import Callbacks

        self.stream, self.started = TextStream(self.server.tokenizer), time.perf_counter()

        def on_token(token: int) -> None:
            self.first = self.first or time.perf_counter()
            if piece := self.stream.add(token):
                self.server._send(messages.Piece(piece), self.conn)

        def on_progress(done: int, total: int) -> None:
            cached = self.server.manifest.query_position
            self.server._send(messages.Progress(cached + done, cached + total, cached,
                                                time.perf_counter() - self.started), self.conn)

        return Callbacks(on_token, lambda: self.cancelled or self.conn is None or
                         self.server.stop_seen, on_progress)


class Server:
    """The query host's socket: requests in, each answer streamed back to the client that
    asked (see the module docstring)."""

    def __init__(self, job: ServeJob, answerer, manifest: Manifest):
        from starqa.models import stop_ids
        from starqa.corpus.prompt import QueryTokens

        self.answerer = answerer
        self.manifest = manifest
        self.path = Path(job.socket)
        self.keepalive = job.keepalive
        # (the plain tokenizers library where it can: a cold ask's head start going on as
        # the group does not wait a second for transformers before it listens)
        self.tokens = QueryTokens(manifest.query_template, Path(job.model_path))
        if not job.lazy_tokenizer:  # ready for `chat`'s history from the start
            self.tokens.full()
        self.tokenizer = self.tokens.tokenizer
        self.stop_ids = sorted(stop_ids(self.tokenizer, Path(job.model_path)))
        self.window = manifest.model.window
        self.path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self.listener.listen(16)
        self.buffers: dict[socket.socket, bytes] = {}  # connected clients, unread bytes
        self.conn: socket.socket | None = None  # the client whose line is being served
        self.last_activity = time.monotonic()
        self.answered = 0
        self.waiting: list[Asking] = []  # asked, not joined yet (first come, first joined)
        self.joining: list[Asking] = []  # in the step being broadcast, in its order
        self.asking: list[Asking] = []  # joined, being answered
        self.stop_seen = False  # a client asked the group to stop
        self.stopper: socket.socket | None = None  # ... which is told `Stopping` at the end
        self.loaded = _stamps(manifest)  # what the group answers from, as it was on disk

    # -- requests ---------------------------------------------------------------------

    def next_step(self, busy: bool) -> Step:
        """The next step for every worker: run (new questions join; the batch's next
        forward), stop, or a heartbeat no-op. While questions are being answered
        (`busy`) it only takes the requests already there; else it waits for one."""
        deadline = time.monotonic() + HEARTBEAT_S
        while True:
            if self.stop_seen and not busy:
                for asking in self.waiting:  # asked, never taken up
                    self._send(_stopped(), asking.conn)
                self.waiting = []
                self._send(messages.Stopping(), self.stopper)
                return STOP
            if not busy and not self.waiting and self.keepalive > 0 and \
                    time.monotonic() - self.last_activity > self.keepalive:
                return STOP
            ready = busy or self.stop_seen or bool(self.waiting)
            request = self._read(timeout=0.0 if ready else
                                 max(0.0, deadline - time.monotonic()))
            if request is not None:
                self.last_activity = time.monotonic()
                self._serve(request)
                continue
            if ready:
                return self._run(busy)
            if time.monotonic() >= deadline:
                return NOOP

    def _serve(self, request: messages.Request) -> None:
        """One request line, from `self.conn`."""
        conn = self.conn
        if isinstance(request, messages.Ping):
            self._send(self.status(), conn)
        elif isinstance(request, messages.Stop):
            self.stop_seen, self.stopper = True, conn
        elif isinstance(request, messages.Cancel):  # a late one, after the answer, is harmless
            # the client's answer under way, else the question it has waiting
            mine = [a for a in self.asking if a.conn is conn] or \
                [a for a in self.waiting if a.conn is conn][:1]
            for asking in mine:
                asking.cancelled = True
        elif isinstance(request, messages.Ask):
            if (changed := self._changed()) is not None:
                self._send(messages.Failed.of(changed), conn)
                self.stop_seen = True  # the next question starts afresh from the files
                return
            turn = self._prepare(request, conn)
            if turn is not None:
                self.waiting.append(Asking(self, conn, turn))

    def _run(self, busy: bool) -> Step:
        """A run step: the waiting questions that fit the batch join it (one a client at a
        time; a question cancelled while it waited is answered as cancelled, with no
        token), unless the group is stopping."""
        joining: list[Asking] = []
        if not self.stop_seen:
            for asking in list(self.waiting):
                if len(self.asking) + len(joining) >= MAX_BATCH:
                    break
                if any(other.conn is asking.conn for other in self.asking + joining):
                    continue  # that client's earlier question first
                self.waiting.remove(asking)
                joining.append(asking)
        if not busy and not joining:
            return NOOP
        self.joining = joining
        self.asking += joining
        return Step("run", tuple(asking.turn for asking in joining))

    def _prepare(self, ask: messages.Ask, conn) -> Turn | None:
        """The question tokenised with as many earlier turns as fit the window (None: it
        does not fit, and the client has been told)."""
        from starqa.corpus import prompt

        history = list(ask.history)
        n = self.manifest.query_position  # the positions the context takes
        while True:
            ids = self.tokens.ids(ask.question, history)
            error = prompt.room_error(n, len(ids), ask.max_new_tokens, self.window)
            if error is None or ask.beyond_window or self.manifest.past_window:
                break  # a context built past the window is asked past it too
            if not history:
                self._send(messages.Failed.of(error), conn)
                return None
            history.pop(0)  # oldest turn first
        return Turn(tuple(ids), ask.max_new_tokens, tuple(self.stop_ids), len(history),
                    ask.draft_tokens)

    def finish(self, answering, top) -> None:
        """An answer ended: its last text and its record to its client."""
        asking = next(a for a in self.asking if a.answering is answering)
        self.asking.remove(asking)
        if piece := asking.stream.finish():
            self._send(messages.Piece(piece), asking.conn)
        if self.stop_seen and not asking.cancelled:
            # cut short by `starqa stop`: not an answer to pass on as one
            self._send(_stopped(), asking.conn)
            return
        end = time.perf_counter()
        self.answered += 1
        self.last_activity = time.monotonic()
        first, turn = asking.first, asking.turn
        self._send(messages.Finished(
            text=asking.stream.text.strip(), token_ids=tuple(answering.generated),
            question_tokens=len(turn.query_ids), turns_used=turn.turns_used,
            sources=None if top is None else tuple(top),
            cancelled=asking.cancelled or asking.conn is None,
            first_token_s=(first - asking.started) if first else None,
            decode_s=(end - first) if first else 0.0, total_s=end - asking.started,
            rss_bytes=_rss()), asking.conn)

    def _changed(self):
        """None while the context's files on disk are those the group loaded; else the
        StarqaError to answer with (the group then stops). See the module docstring."""
        from starqa.cache import shards
        from starqa.core.errors import StarqaError
        from starqa.cache.manifest import read_manifest

        m = self.manifest
        for path, before in self.loaded.items():
            now = _stamp(path)
            if now == before:
                continue
            what = "manifest" if path.name == MANIFEST else "shard"
            if now is not None and what == "manifest":
                try:
                    same = _block_sums(read_manifest(m.folder)) == _block_sums(m)
                except (StarqaError, OSError):
                    same = False
            elif now is not None:  # the same file (inode), the bytes the group verified
                block = next(b for b in m.blocks if m.folder / b.file == path)
                same = now[3] == before[3] and now[0] == before[0] \
                    and shards.sha256_file(path) == block.sha256
            else:
                same = False
            if same:
                self.loaded[path] = now
                continue
            how = "was removed" if now is None else "was changed"
            return StarqaError(
                f"The {what} {path} {how} on disk after this warm group of {m.name} loaded "
                "it; the group has stopped rather than answer from files that are no longer "
                "those on disk.",
                hint="ask again: a fresh start loads the files as they are now and checks "
                     f"them (naming a damaged shard); or {shards._fix(m)}")
        return None

    def status(self) -> messages.GroupStatus:
        """What a `ping` is answered with (`starqa ps` shows it)."""
        manifest = self.manifest
        return messages.GroupStatus(context=manifest.name, key=manifest.key,
                      workers=self.answerer.info.world_size, tokens=manifest.n_tokens,
                      method=manifest.method.name, answered=self.answered,
                      rss_bytes=_rss(), pid=os.getpid())

    # -- socket plumbing ----------------------------------------------------------------
    # Several clients may be connected (a chat, an `ask`, a door's requests side by side);
    # each answer streams to the client that asked (`Asking.conn`).

    def _read(self, timeout: float) -> messages.Request | None:
        """The next complete request line from any client, waiting up to `timeout`."""
        if (message := self._next_line()) is not None:
            return message
        ready, _, _ = select.select([self.listener, *self.buffers], [], [], timeout)
        for sock in ready:
            if sock is self.listener:
                conn, _ = self.listener.accept()
                self.buffers[conn] = b""
            else:
                self._receive(sock)
        return self._next_line()

    def _receive(self, sock: socket.socket) -> None:
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
        if chunk:
            self.buffers[sock] += chunk
        else:
            self._drop(sock)

    def _next_line(self) -> messages.Request | None:
        for sock, buffer in list(self.buffers.items()):
            if b"\n" not in buffer:
                continue
            line, self.buffers[sock] = buffer.split(b"\n", 1)
            self.conn = sock
            try:
                return messages.read_request(line)
            except messages.BadRequest as err:
                self._send(messages.Failed(f"Bad request: {err}."), sock)
                return None  # answered; the next line may be a good one
        return None

    def _send(self, event: messages.Event, conn: socket.socket | None) -> None:
        if conn is None:
            return
        try:
            conn.sendall(messages.event_line(event))
        except OSError:
            self._drop(conn)

    def _drop(self, sock: socket.socket) -> None:
        """A client left (or its socket failed): its answers stop at their next token."""
        sock.close()
        self.buffers.pop(sock, None)
        for asking in self.asking + self.waiting:
            if asking.conn is sock:
                asking.conn = None
        self.waiting = [asking for asking in self.waiting if asking.conn is not None]
        if sock is self.stopper:
            self.stopper = None
        if sock is self.conn:
            self.conn = None

    def close(self) -> None:
        """Disconnect every client and remove the socket."""
        for sock in list(self.buffers):
            self._drop(sock)
        self.listener.close()
        self.path.unlink(missing_ok=True)


def _stopped() -> messages.Failed:
    return messages.Failed("The warm group was stopped (starqa stop) while it answered; the "
                           "answer was cut short.", "ask again: a new group starts")


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """(size, mtime_ns, ctime_ns, inode) of `path`, None when it is gone: a write or a
    replacement changes it (ctime cannot be set back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _stamps(manifest: Manifest) -> dict[Path, tuple | None]:
    """The stamps of the context's manifest and of the shards this machine holds."""
    files = [manifest.folder / MANIFEST] + \
        [manifest.folder / manifest.blocks[i].file for i in manifest.local_blocks]
    return {path: _stamp(path) for path in files}


def _block_sums(manifest: Manifest) -> list[tuple]:
    return [(b.file, b.bytes, b.sha256) for b in manifest.blocks]


def _rss() -> int:
    """Current resident memory of this process in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
