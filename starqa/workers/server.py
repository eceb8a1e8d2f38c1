"""The warm worker group's front door: a Unix socket served by the query host.

Runs inside the query-host worker of a `serve` group. Requests and events are JSON lines,
the typed messages of `starqa.workers.messages` (which shows them): `Ask`, `Cancel`, `Ping`,
`Stop` in; `Piece`s then `Finished` (or `Failed`), `GroupStatus`, `Stopping` out.

The socket lives in a short private folder (`paths.socket_dir`, mode 0700), itself mode
0600: only the user who started the group can connect, and only from this machine. The
query host tokenises the question and picks each token; the other workers receive what to
do next by broadcast: a `Step` (answer a `Turn`, stop, or nothing), in
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
    """What every rank of the group does next, as the query host broadcasts it: "ask"
    (answer `turn`), "stop", or "noop" (a heartbeat: nothing came within HEARTBEAT_S)."""

    op: str
    turn: Turn | None = None


STOP, NOOP = Step("stop"), Step("noop")


def serve_group(job: ServeJob, info, answerer, manifest: Manifest, on_ready) -> None:
    """Every rank's loop of a warm group: the query host reads requests from the socket and
    broadcasts them; every rank answers each `ask` together, until `stop` (or idle)."""
    from starqa.runtime import dist

    server = Server(job, answerer, manifest) if info.is_last else None
    on_ready()
    try:
        while True:
            step = encode(server.next_request()) if server else None
            step = decode(Step, dist.broadcast_object(info, step, src=info.world_size - 1))
            if step.op == "stop":
                break
            if step.op == "ask":
                if server:
                    server.answer(step.turn)
                else:
                    turn = step.turn
                    answerer.answer(list(turn.query_ids), turn.max_new_tokens,
                                    list(turn.stop_ids), draft_tokens=turn.draft_tokens)
    finally:
        if server:
            server.close()


class Server:
    """The query host's socket: requests in, answers streamed back to the client that
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
        self.listener.listen(4)
        self.buffers: dict[socket.socket, bytes] = {}  # connected clients, unread bytes
        self.conn: socket.socket | None = None  # the client being answered
        self.last_activity = time.monotonic()
        self.answered = 0
        self.cancel_seen = False
        self.stop_seen = False  # another client asked the group to stop mid-answer
        self.loaded = _stamps(manifest)  # what the group answers from, as it was on disk

    # -- requests ---------------------------------------------------------------------

    def next_request(self) -> Step:
        """The next step for every worker: ask / stop, or a heartbeat no-op."""
        deadline = time.monotonic() + HEARTBEAT_S
        while time.monotonic() < deadline:
            if self.keepalive > 0 and time.monotonic() - self.last_activity > self.keepalive:
                return STOP
            request = self._read(timeout=max(0.0, deadline - time.monotonic()))
            if request is None:
                continue
            self.last_activity = time.monotonic()
            if isinstance(request, messages.Ping):
                self._send(self.status())
            elif isinstance(request, messages.Stop):
                self._send(messages.Stopping())
                return STOP
            elif isinstance(request, messages.Ask):
                if (changed := self._changed()) is not None:
                    self._send(messages.Failed.of(changed))
                    return STOP
                turn = self._prepare(request)
                if turn is not None:
                    return Step("ask", turn)
            # a late Cancel, after the answer ended, is harmless
        return NOOP

    def _prepare(self, ask: messages.Ask) -> Turn | None:
        """The question tokenised with as many earlier turns as fit the window (None: it
        does not fit, and the client has been told)."""
        from starqa.corpus import prompt

        history = list(ask.history)
        n = self.manifest.query_position  # the positions the context takes
        while True:
            ids = self.tokens.ids(ask.question, history)
            error = prompt.room_error(n, len(ids), ask.max_new_tokens, self.window)
            if error is None or ask.beyond_window:
                break
            if not history:
                self._send(messages.Failed.of(error))
                return None
            history.pop(0)  # oldest turn first
        return Turn(tuple(ids), ask.max_new_tokens, tuple(self.stop_ids), len(history),
                    ask.draft_tokens)

    def answer(self, turn: Turn) -> None:
        """Answer `turn` with the other ranks, streaming its text to the client that asked."""
        from starqa.corpus.prompt import TextStream

        started = time.perf_counter()
        first: list[float] = []
        stream = TextStream(self.tokenizer)

        def on_token(token: int) -> None:
            first or first.append(time.perf_counter())
            if piece := stream.add(token):
                self._send(messages.Piece(piece))

        tokens, top = self.answerer.answer(list(turn.query_ids), turn.max_new_tokens,
                                      list(turn.stop_ids), on_token, self._cancelled,
                                      draft_tokens=turn.draft_tokens)
        if piece := stream.finish():
            self._send(messages.Piece(piece))
        if self.stop_seen:  # cut short by `starqa stop`: not an answer to pass on as one
            self._send(messages.Failed(
                "The warm group was stopped (starqa stop) while it answered; the answer was "
                "cut short.", "ask again: a new group starts"))
            return
        text = stream.text
        end = time.perf_counter()
        self.answered += 1
        self.last_activity = time.monotonic()
        self._send(messages.Finished(
            text=text.strip(), token_ids=tuple(tokens), question_tokens=len(turn.query_ids),
            turns_used=turn.turns_used, sources=None if top is None else tuple(top),
            cancelled=self.cancel_seen, first_token_s=(first[0] - started) if first else None,
            decode_s=(end - first[0]) if first else 0.0, total_s=end - started,
            rss_bytes=_rss()))
        self.cancel_seen = False

    def _cancelled(self) -> bool:
        """Polled once per generated token: a cancel from the asking client, or it left."""
        asker = self.conn
        if asker is None:
            return True
        others = [sock for sock in self.buffers if sock is not asker]
        ready, _, _ = select.select([asker, self.listener, *others], [], [], 0)
        for sock in ready:
            if sock is self.listener:  # `starqa stop` (or ps) connecting meanwhile
                conn, _ = self.listener.accept()
                self.buffers[conn] = b""
            else:
                self._receive(sock)
        if any(messages.peek_op(line) == messages.Stop.OP
               for sock, buffer in self.buffers.items()
               if sock is not self.conn for line in buffer.split(b"\n")[:-1]):
            self.stop_seen = True  # stop ends the answer; its line is served next
        if self.stop_seen:
            return True
        if self.conn is None:  # disconnected
            self.cancel_seen = True
        else:  # take cancels out of its unread lines; anything else waits its turn
            *lines, partial = self.buffers[asker].split(b"\n")
            kept = [line for line in lines if messages.peek_op(line) != messages.Cancel.OP]
            self.cancel_seen = self.cancel_seen or len(kept) < len(lines)
            self.buffers[asker] = b"".join(line + b"\n" for line in kept) + partial
        return self.cancel_seen

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
    # Several clients may be connected (a chat and an `ask` side by side); requests are
    # served one at a time, each answer streaming to the client that asked (`self.conn`).

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
                self._send(messages.Failed(f"Bad request: {err}."))
                return None  # answered; the next line may be a good one
        return None

    def _send(self, event: messages.Event) -> None:
        if self.conn is None:
            return
        try:
            self.conn.sendall(messages.event_line(event))
        except OSError:
            self._drop(self.conn)

    def _drop(self, sock: socket.socket) -> None:
        sock.close()
        self.buffers.pop(sock, None)
        if sock is self.conn:
            self.conn = None

    def close(self) -> None:
        """Disconnect every client and remove the socket."""
        for sock in list(self.buffers):
            self._drop(sock)
        self.listener.close()
        self.path.unlink(missing_ok=True)


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
