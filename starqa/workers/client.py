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
from collections.abc import Iterator, Sequence
from pathlib import Path

from starqa.core import paths
from starqa.cache import store
from starqa.core.errors import StarqaError, WorkerError
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
                                    env={**os.environ,
                                         CLAIM_ENV: f"{key}:{held.fileno()}"})


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


def stop(group: RunInfo) -> bool:
    """Stop `group` (its run info, with a socket on this machine); False when it had died
    without cleaning up (kill -9), in which case its run file and socket are removed."""
    try:
        conn = Client(group, timeout=30)
    except Unreachable:  # it died without cleaning up: nothing left to stop
        forget(group)
        return False
    try:
        conn.stop()
    finally:
        conn.close()
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
            ) -> Iterator[messages.Piece | messages.Finished]:
        """Stream one answer: its pieces of text, then its record (`Finished`); a `Failed`
        is raised as a StarqaError. draft_tokens: per forward (decode.generate); None: the
        group's default."""
        self.send(messages.Ask(question, tuple((q, a) for q, a in history), max_new_tokens,
                               beyond_window, draft_tokens))
        for event in self.events():
            if isinstance(event, messages.Failed):
                raise StarqaError(event.message, hint=event.hint)
            if isinstance(event, (messages.Piece, messages.Finished)):
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
