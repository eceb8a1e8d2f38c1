"""Talking to warm worker groups (`starqa serve`) from the CLI: finding them, starting one
in the background, asking, cancelling, stopping. Imports nothing heavy, so a warm `ask` pays
for no torch or transformers import.

A running group is described by `$STARQA_HOME/run/<key>.json` (written by the launcher once
every worker is ready) next to its socket `<key>.sock`. A group across machines has a run
file on each; only the query host's names a socket, the others' say which node they are
(`node`, `nodes`) and where the query host is (`query`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from starqa import paths, store
from starqa.errors import StarqaError, WorkerError


def run_dir() -> Path:
    folder = paths.home() / "run"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def running() -> list[dict]:
    """Live groups, and this machine's parts of groups served from another machine (no
    socket here). Stale run files of dead launchers are removed."""
    found = []
    for file in sorted(run_dir().glob("*.json")):
        try:
            info = json.loads(file.read_text())
            alive = store.process_alive(info["pid"]) and (info["socket"] is None
                                                          or Path(info["socket"]).exists())
        except (OSError, ValueError, KeyError, TypeError):  # not a run file starqa wrote
            continue
        if alive:
            found.append(info)
        else:
            file.unlink(missing_ok=True)
    return found


def find(key: str) -> dict | None:
    """The group serving `key` from this machine (one whose socket is here), or None."""
    return next((info for info in running() if info["key"] == key and info["socket"]), None)


def part(key: str) -> dict | None:
    """This machine's part of a group serving `key` from another machine, or None."""
    return next((info for info in running() if info["key"] == key and not info["socket"]),
                None)


def elsewhere(group: dict) -> StarqaError:
    """The error for asking or stopping on a machine that only runs part of `group`."""
    return StarqaError(
        f"This machine runs node {group['node']} of the warm group of {group['name']}; "
        f"its socket is on the query host, {group['query']}.",
        hint=f"run it on that machine (there: starqa ps; starqa stop {group['name']})")


def claim(key: str):
    """An exclusive hold on context `key`'s group slot (an open file with a lock that the
    kernel drops when the process ends, however it ends), or None when another process holds
    it. Use as a context manager; the holder is the group's launcher."""
    import fcntl

    fh = open(run_dir() / f"{key}.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh


def spawn(key: str, workers: int | None, keepalive: float,
          weights: str | None = None, attention: Sequence[str] = ()) -> subprocess.Popen:
    """Start `starqa serve` for context `key` in the background, its output in the run
    folder's `<key>.log`; returns at once."""
    log = run_dir() / f"{key}.log"
    cmd = [sys.executable, "-m", "starqa", "serve", key, "--keep-alive", str(keepalive)]
    cmd += (["--workers", str(workers)] if workers else []) + \
           (["--weights", weights] if weights else []) + list(attention)
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                                start_new_session=True)


def start(key: str, workers: int | None, keepalive: float, wait_s: float = 300,
          weights: str | None = None, attention: Sequence[str] = ()) -> dict:
    """Start `starqa serve` for context `key` in the background; returns its run info once
    every worker is ready (or raises with the tail of its log)."""
    log = run_dir() / f"{key}.log"
    proc = spawn(key, workers, keepalive, weights, attention)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (info := find(key)) is not None:
            return info
        if proc.poll() is not None:
            if (holder := claim(key)) is None:  # another launcher is starting it (follow)
                time.sleep(0.2)
                continue
            holder.close()
            if (info := find(key)) is not None:
                return info
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise WorkerError(f"The worker group for {key} exited while starting:\n{tail}")
        time.sleep(0.2)
    proc.terminate()
    raise WorkerError(f"The worker group for {key} did not become ready in {wait_s:.0f} s "
                      f"(log: {log}).")


def stop_group(key: str) -> bool:
    """Stop the warm group serving context `key`, if one runs; True when one was stopped."""
    group = find(key)
    if group is None:
        return False
    conn = Client(group, timeout=30)
    try:
        conn.stop()
    finally:
        conn.close()
    return True


def follow(name: str, key: str) -> list[dict]:
    """Hand warm groups over to a new ingest of context `name` (its new `key`): a group
    serving an earlier version (the same name, another key) is stopped, and one for `key`
    started in the background with the same settings (workers, keep-alive, weights,
    attention), so the next `ask` or chat question is answered from the new shards without
    a restart by hand. Returns the replaced groups' run info."""
    replaced = []
    for group in running():
        if group.get("name") != name or group["key"] == key:
            continue
        try:
            stop_group(group["key"])
        except (StarqaError, OSError):
            continue  # it went away meanwhile, or cannot be reached: nothing to hand over
        replaced.append(group)
        spawn(key, group.get("requested_workers"), group.get("keepalive", 300),
              group.get("weights"), group.get("attention_args", ()))
    return replaced


class Client:
    """One connection to a group's query host."""

    def __init__(self, info: dict, timeout: float = 600):
        self.info = info
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(info["socket"])
        except OSError as err:
            raise StarqaError(f"Cannot reach the worker group of {info['name']} ({err}).",
                              hint="starqa ps shows running groups; starqa stop ends them") from None
        self.reader = self.sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall((json.dumps(message) + "\n").encode())

    def events(self) -> Iterator[dict]:
        for line in self.reader:
            yield json.loads(line)
        raise WorkerError("The worker group closed the connection (did a worker die? "
                          f"see {run_dir() / (self.info['key'] + '.log')}).")

    def ask(self, question: str, history=(), max_new_tokens: int = 256,
            beyond_window: bool = False, draft_tokens: int | None = None) -> Iterator[dict]:
        """Stream events for one question: token events, then done (or error).
        draft_tokens: per forward (phase2.generate); None: the group's default."""
        self.send({"op": "ask", "question": question, "history": [list(t) for t in history],
                   "max_new_tokens": max_new_tokens, "beyond_window": beyond_window,
                   **({} if draft_tokens is None else {"draft_tokens": draft_tokens})})
        for event in self.events():
            if event["event"] == "error":
                raise StarqaError(event["message"], hint=event.get("hint"))
            yield event
            if event["event"] == "done":
                return

    def cancel(self) -> None:
        self.send({"op": "cancel"})

    def ping(self) -> dict:
        self.send({"op": "ping"})
        return next(e for e in self.events() if e["event"] == "pong")

    def stop(self) -> None:
        self.send({"op": "stop"})
        next(e for e in self.events() if e["event"] == "stopping")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()
