"""Talking to warm worker groups (`starqa serve`) from the CLI: finding them, starting one
in the background, asking, cancelling, stopping. Imports nothing heavy, so a warm `ask` pays
for no torch or transformers import.

A running group is described by its run file, `$STARQA_HOME/run/<key>.json` (a `RunInfo`,
`starqa.workers.runfile`, written by the launcher once every worker is ready;
`paths.run_dir`: elsewhere when the cache root is read-only), which names its socket: a
short private path whatever the root's length (`paths.socket_path`). A group across
machines has a run file on each; only the query host's names a socket, the others' say
which node they are (`node`, `nodes`) and where the query host is (`query`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from starqa.core import paths
from starqa.cache import store
from starqa.cache.context import Context
from starqa.cache.manifest import Manifest
from starqa.core.errors import StarqaError, WorkerError
from starqa.phase2.answer import Answer, Progress, Question, Timings, finish_of, \
    sources_of
from starqa.runtime.protocol import ProtocolError
from starqa.workers import messages, runfile
from starqa.workers.runfile import RunInfo


def run_dir() -> Path:
    """Where this process writes run files, locks and logs (made on first use)."""
    return paths.run_dir()


def socket_path(key: str) -> Path:
    return paths.socket_path(key)


def log_path(key: str) -> Path:
    """The log of context `key`'s group: where one was written, without making folders."""
    logs = [folder / f"{key}.log" for folder in paths.run_dirs()]
    return next((log for log in logs if log.exists()), logs[0])


class Unreachable(StarqaError):
    """A group's run file names a socket nobody listens on: the group died without
    cleaning up (kill -9, out of memory) and its run file and socket are stale."""


def alive(pid: int) -> bool:
    """Whether process `pid` runs: not gone, and not a zombie (killed, not yet reaped; in a
    container whose init reaps late one stays for seconds, and its socket refuses)."""
    if not store.process_alive(pid):
        return False
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone since (or no /proc: not Linux)
    except (OSError, IndexError):
        return True


def forget(info: RunInfo) -> None:
    """Remove the run file and socket of a group found dead (`Unreachable`), where ours:
    only while no launcher holds the context's slot (`claim`), so never those of a group
    starting for it right now (same names)."""
    try:
        held = claim(info.key)
    except (StarqaError, OSError):
        return
    if held is None:
        return
    with held:
        _forget(info)


def _forget(info: RunInfo) -> None:
    for folder in paths.run_dirs():
        with contextlib.suppress(OSError):
            (folder / f"{info.key}.json").unlink(missing_ok=True)
    if info.socket:
        with contextlib.suppress(OSError):
            Path(info.socket).unlink(missing_ok=True)


def running() -> list[RunInfo]:
    """Live groups, and this machine's parts of groups served from another machine (no
    socket here). Stale run files of dead launchers are removed where they can be. Reads
    only: a read-only cache root, or one with no run folder yet, has none."""
    found = []
    files = sorted(f for folder in paths.run_dirs() if folder.is_dir()
                   for f in folder.glob("*.json"))
    for file in files:
        try:
            if file.stat().st_uid != os.getuid():
                continue  # another user's group (a shared cache), or planted: not ours
            info = runfile.read(file)
            live = alive(info.pid) and (info.socket is None or Path(info.socket).exists())
        except (OSError, ValueError, ProtocolError):  # unreadable, or not a run file this
            continue  # starqa wrote (garbage, another version's)
        if live:
            found.append(info)
        else:
            with contextlib.suppress(OSError):
                file.unlink(missing_ok=True)
    return found


def find(key: str) -> RunInfo | None:
    """The group serving `key` from this machine (one whose socket is here), or None."""
    return next((info for info in running() if info.key == key and info.socket), None)


def group_for(manifest: Manifest, model: str | None = None, weights: str | None = None,
              topk: dict | None = None) -> tuple[RunInfo | None, str | None]:
    """The warm group that answers a question about `manifest`'s context as asked, if one
    runs here: (its run info, None); where one runs that cannot answer it so, (None, why);
    (None, None) where none runs, or the question names another model (which the cold
    path refuses, saying why). `model`: the model the question names (an embedded name,
    `STARQA_MODEL`'s value, a folder or a GGUF file; None: the context's own), `weights`
    (None: the group's) and `topk` (`TopK.as_dict()`; None: exact attention) as asked."""
    group = find(manifest.key)
    if group is None:
        return None, None
    if not names_model(manifest, model):  # the cold path says why: never a silent mix
        return None, None
    if weights not in (None, group.weights):
        return None, (f"its warm group answers with {group.weights} weights, not {weights} "
                      f"(starqa stop {manifest.name} ends it)")
    if group.topk != topk:
        running = "top-k" if group.topk else "exact"
        return None, (f"its warm group answers with {running} attention, not as asked "
                      f"(starqa stop {manifest.name} ends it)")
    return group, None


def names_model(manifest: Manifest, spec: str | None) -> bool:
    """Whether `spec` names the model the context was made with: None, its embedded name or
    an alias of it, the spec it was ingested with, or a path to the same folder, GGUF file
    or a folder with the same fingerprint. Reads no weights (a folder's fingerprint is
    cached beside them)."""
    if spec is None or spec == manifest.model.spec:
        return True
    from starqa import models

    recorded = manifest.model
    asked, made = models.embedded_model(spec), models.embedded_model(recorded.spec)
    if asked or made:
        return bool(asked and made and asked.name == made.name)
    path = Path(spec).expanduser()
    if not path.exists():
        return False
    same = {Path(recorded.path).resolve(), Path(recorded.spec).expanduser().resolve()}
    if path.resolve() in same:
        return True
    try:
        return path.is_dir() and models.fingerprint(path)["digest"] == recorded.digest
    except (OSError, ValueError, KeyError):
        return False


def part(key: str) -> RunInfo | None:
    """This machine's part of a group serving `key` from another machine, or None."""
    return next((info for info in running() if info.key == key and not info.socket), None)


def elsewhere(group: RunInfo) -> StarqaError:
    """The error for asking or stopping on a machine that only runs part of `group`."""
    return StarqaError(
        f"This machine runs node {group.node} of the warm group of {group.name}; "
        f"its socket is on the query host, {group.query}.",
        hint=f"run it on that machine (there: starqa ps; starqa stop {group.name})")


CLAIM_ENV = "STARQA_CLAIMED"  # "KEY:FD": the slot's lock, held by `spawn` for its child


def claim(key: str):
    """An exclusive hold on context `key`'s group slot (an open file with a lock that the
    kernel drops when the process ends, however it ends), or None when another process holds
    it. Use as a context manager; the holder is the group's launcher."""
    import fcntl

    handed = os.environ.get(CLAIM_ENV, "")  # `spawn` took the slot for this process
    if handed.startswith(f"{key}:"):
        del os.environ[CLAIM_ENV]
        with contextlib.suppress(OSError, ValueError):
            return os.fdopen(int(handed.split(":", 1)[1]), "w")
    fh = open(run_dir() / f"{key}.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh


def starting() -> list[str]:
    """Keys of groups being started on this machine: a launcher holds their slot (`claim`)
    and no run file says they listen yet. Reads only (a shared lock probe, no file made)."""
    import fcntl

    ready = {info.key for info in running()}
    keys = []
    for folder in paths.run_dirs():
        for lock in sorted(folder.glob("*.lock")) if folder.is_dir() else ():
            if lock.stem in ready or lock.stem in keys:
                continue
            try:
                with open(lock, "rb") as fh:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                keys.append(lock.stem)
            except OSError:
                continue
    return keys


def wait_started(keys: Sequence[str], wait_s: float = 300) -> list[RunInfo]:
    """The run info of each of `keys` once its group listens; one whose launcher gives up
    (its slot let go with no group) or that is not ready within `wait_s` is left out."""
    deadline = time.monotonic() + wait_s
    found: dict[str, RunInfo] = {}
    pending = list(keys)
    while pending and time.monotonic() < deadline:
        for key in list(pending):
            if (info := find(key)) is not None:
                found[key] = info
                pending.remove(key)
            elif key not in starting():
                if (info := find(key)) is not None:  # became ready just now
                    found[key] = info
                pending.remove(key)
        time.sleep(0.1)
    return list(found.values())


def spawn(key: str, workers: int | None, keepalive: float,
          weights: str | None = None, attention: Sequence[str] = ()) -> subprocess.Popen | None:
    """Start `starqa serve` for context `key` in the background, its output in the run
    folder's `<key>.log`; returns at once. The context's slot is taken here and handed to
    the child (its lock's descriptor, inherited), so the group counts as starting from
    this moment (`starting`: `stop` waits for it); None, and nothing started, when a group
    holds the slot already."""
    held = claim(key)
    if held is None:
        return None
    with held:
        log = run_dir() / f"{key}.log"
        cmd = [sys.executable, "-m", "starqa", "serve", key, "--keep-alive", str(keepalive)]
        cmd += (["--workers", str(workers)] if workers else []) + \
               (["--weights", weights] if weights else []) + list(attention)
        with open(log, "w") as fh:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                                    start_new_session=True, pass_fds=(held.fileno(),),
                                    env=paths.child_env(**{CLAIM_ENV: f"{key}:{held.fileno()}"}))


def start(key: str, workers: int | None, keepalive: float, wait_s: float = 300,
          weights: str | None = None, attention: Sequence[str] = ()) -> RunInfo:
    """Start `starqa serve` for context `key` in the background; returns its run info once
    every worker is ready (or raises with the tail of its log)."""
    log = run_dir() / f"{key}.log"
    proc = spawn(key, workers, keepalive, weights, attention)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (info := find(key)) is not None:
            return info
        if proc is None or proc.poll() is not None:
            if (holder := claim(key)) is None:  # another launcher is starting it (follow)
                time.sleep(0.2)
                continue
            holder.close()
            if (info := find(key)) is not None:
                return info
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            if not tail.strip():  # it could not even write its log
                raise WorkerError(
                    f"The worker group for {key} exited while starting, leaving nothing in "
                    f"its log {log}: is that disk full, or the folder not writable?",
                    hint=f"free space there (df -h {shlex.quote(str(log.parent))} shows it), "
                         "then run the command again")
            raise WorkerError(f"The worker group for {key} exited while starting:\n{tail}")
        time.sleep(0.2)
    if proc is not None:
        proc.terminate()
    raise WorkerError(f"The worker group for {key} did not become ready in {wait_s:.0f} s "
                      f"(log: {log}).")


def stop_group(key: str) -> bool:
    """Stop the warm group serving context `key`, if one runs; True when one was stopped."""
    group = find(key)
    return group is not None and stop(group)


def stop(group: RunInfo, wait_s: float = 30.0) -> bool:
    """Stop `group` (its run info, with a socket on this machine) and wait, up to `wait_s`,
    until its launcher has exited (so what it read, a context's shards, is free to remove);
    False when it had died without cleaning up (kill -9), in which case its run file and
    socket are removed. A group already stopping (stopped a moment ago: its socket closes
    under the request) counts as stopped."""
    try:
        conn = Client(group, timeout=30)
    except Unreachable:  # it died without cleaning up: nothing left to stop
        forget(group)
        return False
    try:
        conn.stop()
    except (OSError, WorkerError):  # closed under us: it was stopping already
        pass
    finally:
        conn.close()
    deadline = time.monotonic() + wait_s
    while alive(group.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def follow(name: str, key: str) -> list[RunInfo]:
    """Hand warm groups over to a new ingest of context `name` (its new `key`): a group
    serving an earlier version (the same name, another key) is stopped, and one for `key`
    started in the background with the same settings (workers, keep-alive, weights,
    attention), so the next `ask` or chat question is answered from the new shards without
    a restart by hand. Returns the replaced groups' run info."""
    replaced = []
    for group in running():
        if group.name != name or group.key == key:
            continue
        try:
            stop_group(group.key)
        except (StarqaError, OSError):
            continue  # it went away meanwhile, or cannot be reached: nothing to hand over
        replaced.append(group)
        spawn(key, group.requested_workers, group.keepalive, group.weights,
              group.attention_args)
    return replaced


class GroupLeft(StarqaError):
    """A warm group closed its socket before the first token: it was exiting as it was
    asked (`starqa stop`, its keep-alive ending), so the question goes elsewhere."""


def ask_warm(group: RunInfo, question: Question, context: Context,
             on_piece: Callable[[str], None], stop_wanted: Callable[[], bool] = lambda: False,
             asked: float | None = None,
             on_progress: Callable[[Progress], None] | None = None) -> Answer:
    """The one warm-ask loop: answer `question` on `group` over its socket (no model load,
    no torch import here), each piece of text to `on_piece` (and the prefill's progress to
    `on_progress`), and return its `Answer`.
    `stop_wanted` is read at every piece: once true, the group is told to cancel (it stops
    at its next token and still sends its record), and no more pieces are passed on.
    `asked`: when the question was asked (`time.perf_counter()`; default: now), which its
    timings count from. Ctrl-C cancels the answer and leaves the group warm. Raises
    `Unreachable` (the group died without cleaning up) and `GroupLeft` (it was exiting)
    before any piece, so that the caller can answer elsewhere."""
    asked = time.perf_counter() if asked is None else asked
    conn = Client(group)
    sent, first, cancelled, done = time.perf_counter(), None, False, None
    try:
        for event in conn.ask(question.text, question.history, question.max_new_tokens,
                              question.beyond_window):
            if not cancelled and stop_wanted():
                conn.cancel()
                cancelled = True
            if isinstance(event, messages.Finished):
                done = event
            elif isinstance(event, messages.Progress):
                if on_progress is not None and not cancelled:
                    on_progress(event)
            else:
                first = first or time.perf_counter()
                if not cancelled:
                    on_piece(event.text)
    except KeyboardInterrupt:  # stop the answer, leave the group warm
        with contextlib.suppress(OSError):
            conn.cancel()
        raise
    except (ConnectionResetError, BrokenPipeError) as err:
        if first is None:
            raise GroupLeft(f"The warm group of {context.name} was exiting.") from None
        raise StarqaError(f"The warm group of {context.name} ended in the middle of the answer "
                          f"({err}).", hint="ask again: a cold answer starts a new group; "
                          "starqa ps shows the running groups") from None
    finally:
        conn.close()
    if done is None:
        raise StarqaError("The warm group ended the answer without its record.")
    timings = Timings.since(asked, first, time.perf_counter(), done.first_token_s,
                            done.decode_s, sent)
    return Answer(text=done.text, context=context, token_ids=tuple(done.token_ids),
                  question_tokens=done.question_tokens,
                  sources=sources_of(done.sources, not group.topk), timings=timings,
                  finish=finish_of(done.token_ids, question.max_new_tokens, done.cancelled),
                  warm=True, workers=group.workers, weights=group.weights,
                  attention=_attention(group.topk), peak_bytes=(done.rss_bytes,))


def _attention(topk: dict | None) -> str:
    """A group's attention as `Answer.attention` says it."""
    if not topk:
        return "exact"
    from starqa.topk.indexes import TopK

    return TopK(**topk).describe()


class Client:
    """One connection to a group's query host."""

    def __init__(self, info: RunInfo, timeout: float = 600):
        self.info = info
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(info.socket)
        except OSError as err:
            self.sock.close()
            dead = isinstance(err, (ConnectionRefusedError, FileNotFoundError))
            raise (Unreachable if dead else StarqaError)(
                f"Cannot reach the worker group of {info.name} ({err}).",
                hint="starqa ps shows running groups; starqa stop ends them") from None
        self.reader = self.sock.makefile("rb")

    def send(self, request: messages.Request) -> None:
        self.sock.sendall(messages.request_line(request))

    def events(self) -> Iterator[messages.Event]:
        for line in self.reader:
            yield messages.read_event(line)
        raise WorkerError("The worker group closed the connection (did a worker die? "
                          f"see {log_path(self.info.key)}).")

    def ask(self, question: str, history=(), max_new_tokens: int = 256,
            beyond_window: bool = False, draft_tokens: int | None = None,
            ) -> Iterator[messages.Piece | messages.Progress | messages.Finished]:
        """Stream one answer: its prefill's progress and its pieces of text, then its record
        (`Finished`); a `Failed`
        is raised as a StarqaError. draft_tokens: per forward (decode.Batch); None: the
        group's default."""
        self.send(messages.Ask(question, tuple((q, a) for q, a in history), max_new_tokens,
                               beyond_window, draft_tokens))
        for event in self.events():
            if isinstance(event, messages.Failed):
                raise event.error()
            if isinstance(event, (messages.Piece, messages.Progress, messages.Finished)):
                yield event
            if isinstance(event, messages.Finished):
                return

    def cancel(self) -> None:
        self.send(messages.Cancel())

    def ping(self) -> messages.GroupStatus:
        self.send(messages.Ping())
        return next(e for e in self.events() if isinstance(e, messages.GroupStatus))

    def stop(self) -> None:
        self.send(messages.Stop())
        next(e for e in self.events() if isinstance(e, messages.Stopping))

    def close(self) -> None:
        self.reader.close()
        self.sock.close()
