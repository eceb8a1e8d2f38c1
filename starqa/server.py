"""The warm worker group's front door: a Unix socket served by the query host.

Runs inside the query-host worker of a `serve` group. Requests and events are JSON lines:

    → {"op": "ask", "question": "...", "history": [[q, a], ...], "max_new_tokens": 256}
    ← {"event": "token", "text": "..."} ...  {"event": "done", "sources": [...], ...}
    → {"op": "cancel"}   (while an answer streams: stop it, keep the session)
    → {"op": "ping"}     ← {"event": "pong", ...}        → {"op": "stop"}: end the group

The socket lives in `$STARQA_HOME/run/` (mode 0700), itself mode 0600: only the user who
started the group can connect, and only from this machine. The query host tokenises the
question and picks each token; the other workers receive the request by broadcast.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from pathlib import Path

HEARTBEAT_S = 20.0  # the other workers wait in a collective; never longer than this


class Server:
    def __init__(self, job: dict, ctx):
        from starqa import engine
        from starqa.models import load_tokenizer

        self.ctx = ctx
        self.path = Path(job["socket"])
        self.keepalive = float(job["keepalive"])
        self.tokenizer = load_tokenizer(job["model_path"])
        self.stop_ids = sorted(engine.stop_ids(self.tokenizer, Path(job["model_path"])))
        self.window = ctx.manifest["model"]["window"]
        self.path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self.listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self.listener.listen(4)
        self.conn: socket.socket | None = None
        self.buffer = b""
        self.last_activity = time.monotonic()
        self.answered = 0
        self.cancel_seen = False

    # -- requests ---------------------------------------------------------------------

    def next_request(self) -> dict:
        """The next request for every worker: ask / stop, or a heartbeat no-op."""
        deadline = time.monotonic() + HEARTBEAT_S
        while time.monotonic() < deadline:
            if self.keepalive and time.monotonic() - self.last_activity > self.keepalive:
                return {"op": "stop"}
            message = self._read(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                continue
            self.last_activity = time.monotonic()
            op = message.get("op")
            if op == "ping":
                self._send({"event": "pong", **self.status()})
            elif op == "stop":
                self._send({"event": "stopping"})
                return {"op": "stop"}
            elif op == "ask":
                request = self._prepare(message)
                if request is not None:
                    return request
            elif op != "cancel":  # a late cancel after the answer ended is harmless
                self._send({"event": "error", "message": f"unknown op {op!r}"})
        return {"op": "noop"}

    def _prepare(self, message: dict) -> dict | None:
        """Tokenise the question with as many earlier turns as fit the window."""
        from starqa import prompt

        question = str(message.get("question", "")).strip()
        max_new = int(message.get("max_new_tokens", 256))
        if not question:
            self._send({"event": "error", "message": "The question is empty."})
            return None
        history = [tuple(turn) for turn in message.get("history", [])]
        n = self.ctx.manifest["n_tokens"]
        while True:
            ids = prompt.tokenize_query(self.tokenizer, question, history)
            if n + len(ids) + max_new <= self.window or message.get("beyond_window"):
                break
            if not history:
                self._send({"event": "error", "message":
                            f"Context {n:,} + question {len(ids):,} + up to {max_new:,} answer "
                            f"tokens > {self.window:,} the model was trained on."})
                return None
            history.pop(0)  # oldest turn first
        return {"op": "ask", "query_ids": ids, "max_new_tokens": max_new,
                "stop_ids": self.stop_ids, "turns_used": len(history)}

    def answer(self, request: dict) -> None:
        started = time.perf_counter()
        first: list[float] = []
        generated: list[int] = []
        shown = [""]

        def on_token(token: int) -> None:
            first or first.append(time.perf_counter())
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                self._send({"event": "token", "text": text[len(shown[0]):]})
                shown[0] = text

        tokens, top = self.ctx.answer(request["query_ids"], request["max_new_tokens"],
                                      request["stop_ids"], on_token, self._cancelled)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text != shown[0]:
            self._send({"event": "token", "text": text[len(shown[0]):]})
        end = time.perf_counter()
        self.answered += 1
        self.last_activity = time.monotonic()
        self._send({"event": "done", "text": text.strip(), "token_ids": tokens,
                    "question_tokens": len(request["query_ids"]),
                    "turns_used": request["turns_used"], "sources": top,
                    "cancelled": self.cancel_seen,
                    "first_token_s": (first[0] - started) if first else None,
                    "decode_s": (end - first[0]) if first else 0.0, "total_s": end - started,
                    "rss_bytes": _rss()})
        self.cancel_seen = False

    def _cancelled(self) -> bool:
        """Polled once per generated token: a cancel request, or the client went away."""
        if self.conn is None:
            return True
        ready, _, _ = select.select([self.conn], [], [], 0)
        if ready:
            message = self._read(timeout=0)
            if message is None and self.conn is None:  # disconnected
                self.cancel_seen = True
            elif message is not None and message.get("op") == "cancel":
                self.cancel_seen = True
        return self.cancel_seen

    def status(self) -> dict:
        m = self.ctx.manifest
        return {"context": m["name"], "key": m["key"], "workers": self.ctx.info.world_size,
                "tokens": m["n_tokens"], "method": m["method"]["name"],
                "answered": self.answered, "rss_bytes": _rss(), "pid": os.getpid()}

    # -- socket plumbing ----------------------------------------------------------------

    def _read(self, timeout: float) -> dict | None:
        """One JSON line from the current client (accepting one if none), or None."""
        if b"\n" not in self.buffer:
            if self.conn is None:
                ready, _, _ = select.select([self.listener], [], [], timeout)
                if not ready:
                    return None
                self.conn, _ = self.listener.accept()
                self.buffer = b""
                timeout = max(timeout, 0.05)
            ready, _, _ = select.select([self.conn], [], [], timeout)
            if not ready:
                return None
            chunk = self.conn.recv(65536)
            if not chunk:
                self._drop()
                return None
            self.buffer += chunk
            if b"\n" not in self.buffer:
                return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._send({"event": "error", "message": "bad request (not JSON)"})
            return None

    def _send(self, event: dict) -> None:
        if self.conn is None:
            return
        try:
            self.conn.sendall((json.dumps(event) + "\n").encode())
        except OSError:
            self._drop()

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.buffer = b""

    def close(self) -> None:
        self._drop()
        self.listener.close()
        self.path.unlink(missing_ok=True)


def _rss() -> int:
    """Current resident memory of this process in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
