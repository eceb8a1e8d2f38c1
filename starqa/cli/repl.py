"""`starqa chat`: an interactive REPL over a cached context, answered by a warm worker group.

History (up-arrow, Ctrl-R) persists in `$STARQA_HOME/chat_history`; Enter sends, Esc then
Enter (or Alt-Enter) adds a line; Ctrl-C stops the current answer and keeps the session;
Ctrl-D or /exit leaves (the workers stay warm until their keep-alive runs out).
"""

from __future__ import annotations

import contextlib
import signal
import sys

from starqa.workers import client
from starqa.core import paths
from starqa.cache import store
from starqa.core.errors import StarqaError

HELP = """\
/help            this help
/sources         files and lines the last answer attended to most
/stats           timings of the last answer and the worker group's state
/context NAME    switch to another ingested context
/clear           forget the conversation so far (each question stands alone again)
/exit            leave (Ctrl-D too); workers stay warm until their keep-alive ends
Enter sends; Esc then Enter adds a new line; Ctrl-C stops an answer."""


class Chat:
    def __init__(self, context: str | None, workers: int | None, keepalive: float,
                 max_new_tokens: int, topk=None):
        from starqa.cli.ui import err

        self.console = err
        self.topk = topk  # indexes.TopK: the warm group answers with top-k attention
        self.workers = workers
        self.keepalive = keepalive
        self.max_new_tokens = max_new_tokens
        self.history: list[tuple[str, str]] = []
        self.last: dict | None = None
        self.failed = False  # a question or command failed: a script's chat exits 1
        self.conn: client.Client | None = None
        self.connect(context)

    def connect(self, name: str | None) -> None:
        manifest = store.find_context(paths.contexts_dir(), name)
        group = client.find(manifest.key)
        wanted = self.topk.as_dict() if self.topk else None
        if group is not None and group.get("topk") != wanted:
            running = "exact" if not group.get("topk") else "top-k"
            raise StarqaError(f"A warm group already serves {manifest.name} with {running} "
                              "attention; one group serves a context at a time.",
                              hint=f"stop it first (starqa stop {manifest.key}), or chat "
                                   "with the attention it has")
        if self.conn is not None and self.owns_group and (
                group is None or group.get("key") != self.group.get("key")):
            self.conn.stop()  # the group this chat started for its own length only: left
        self.owns_group = group is None and self.keepalive == 0
        from starqa.cli.ui import safe

        if group is None:
            if self.topk is not None:
                from starqa.topk import indexes

                with self.console.status(f"Checking {self.topk.index} indexes"):
                    manifest = indexes.ensure(manifest, self.topk.index)
            with self.console.status(f"Starting workers for {safe(manifest.name)} "
                                     "(loading model and shards)"):
                # keep-alive 0: no group outlives the chat; it is stopped when the chat ends
                group = client.start(manifest.key, self.workers,
                                     -1 if self.keepalive == 0 else self.keepalive,
                                     attention=self.topk.cli_args() if self.topk else ())
        if self.conn is not None:
            self.conn.close()
        self.conn = client.Client(group)
        self.group, self.manifest = group, manifest
        self.history.clear()
        self.console.print(
            f"[bold]{safe(manifest.name)}[/] · {manifest.n_tokens:,} tokens · "
            f"{safe(manifest.method.name)} · {group['workers']} warm worker"
            f"{'s' * (group['workers'] > 1)} · /help for commands")

    def run(self) -> int:
        """Answer what is typed until /exit or Ctrl-D; from a pipe or a file (`echo q |
        starqa chat`), every non-empty line is one question or command. Returns the exit
        code: 1 when not at a terminal and any question or command failed, else 0."""
        interactive = sys.stdin.isatty()
        typed = self._prompts() if interactive else (line.strip() for line in sys.stdin)
        from starqa.cli.ui import as_text

        for text in map(as_text, typed):
            if not text:
                continue
            try:
                if text.startswith("/"):
                    if not self.command(text):
                        break
                else:
                    self.ask(text)
            except StarqaError as error:
                from starqa.cli.ui import print_error

                self.failed = True
                print_error(error)
        if self.conn is not None:
            if self.owns_group:
                self.conn.stop()
            self.conn.close()
        return 1 if self.failed and not interactive else 0

    def _prompts(self):
        """What is typed at the prompt (Enter sends, Alt-Enter adds a line), until Ctrl-D."""
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event):
            event.current_buffer.insert_text("\n")

        @keys.add("enter")
        def _submit(event):
            event.current_buffer.validate_and_handle()

        class History(FileHistory):
            def store_string(self, string: str) -> None:
                with contextlib.suppress(OSError):  # a read-only cache: this session's only
                    super().store_string(string)

        session = PromptSession(history=History(str(paths.home() / "chat_history")),
                                key_bindings=keys, multiline=True)
        while True:
            try:
                yield session.prompt("› ").strip()
            except KeyboardInterrupt:
                continue
            except EOFError:
                return

    def command(self, text: str) -> bool:
        """Run a slash command; False ends the session."""
        from starqa.cli.ui import print_sources, safe

        name, _, arg = text.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.console.print(HELP, markup=False)
        elif name == "/sources":
            if self.last is None:
                self.console.print("No answer yet.")
            else:
                print_sources(self.last.get("sources"), limit=10)
        elif name == "/stats":
            self.print_stats()
        elif name == "/clear":
            self.history.clear()
            self.console.print("Conversation cleared.")
        elif name == "/context":
            if not arg.strip():
                self.failed = True
                self.console.print("usage: /context NAME (starqa list shows them)")
            else:
                self.connect(arg.strip())
        else:
            self.failed = True
            self.console.print(f"Unknown command {safe(name)}; /help lists them.")
        return True

    def follow_reingest(self) -> None:
        """The context was re-ingested since the last question (its name now means a newer
        version: `ingest --watch`, or another `ingest`): switch to it, keeping the
        conversation; its group is the one `client.follow` started, or a new one."""
        try:
            latest = store.find_context(paths.contexts_dir(), self.manifest.name)
        except StarqaError:
            return  # renamed, removed or now ambiguous: stay with what is connected
        if latest.key != self.manifest.key and latest.name == self.manifest.name:
            from starqa.cli.ui import safe

            history = list(self.history)
            self.console.print(f"[dim]{safe(latest.name)} was re-ingested; answering from "
                               f"the new version ({latest.key[:8]})[/]")
            self.connect(latest.key)
            self.history[:] = history

    def rejoin(self) -> None:
        """The group went away since the last question (its keep-alive ran out while the
        chat sat idle, `starqa stop` elsewhere, or it died): start it again (or join the
        one now running), keeping the conversation. A few file reads per question."""
        group = client.find(self.manifest.key)
        if group is not None and group.get("pid") == self.group.get("pid"):
            return
        history = list(self.history)
        self.console.print("[dim](the warm group had stopped; starting it again)[/]")
        self.conn.close()
        self.conn = None  # gone: nothing to stop in `connect`
        self.connect(self.manifest.key)
        self.history[:] = history

    def ask(self, question: str) -> None:
        from starqa.cli.ui import print_sources, stream_writer

        self.follow_reingest()
        self.rejoin()
        write = stream_writer()
        conn = self.conn
        # Ctrl-C while the answer streams asks the group to stop and the answer ends as
        # usual. The handler raises nothing: a KeyboardInterrupt raised inside the socket
        # read could drop a half-read event line, and with it the stream's framing.
        # A Ctrl-C before the question is sent cancels it right after (a cancel that
        # arrived first would be ignored as late, and the whole answer would run).
        interrupted: list[bool] = []
        sent: list[bool] = []

        def on_interrupt(signum, frame):
            if not interrupted:
                interrupted.append(True)
                if sent:
                    with contextlib.suppress(OSError):
                        conn.cancel()

        previous = signal.signal(signal.SIGINT, on_interrupt)
        done = None
        try:
            conn.send({"op": "ask", "question": question, "max_new_tokens": self.max_new_tokens,
                       "history": [list(t) for t in self.history]})
            sent.append(True)
            if interrupted:
                conn.cancel()
            for event in conn.events():
                if event["event"] == "token":
                    write(event["text"])
                elif event["event"] == "error":
                    write(None)
                    raise StarqaError(event["message"])
                elif event["event"] == "done":
                    done = event
                    break
        finally:
            signal.signal(signal.SIGINT, previous)
        cancelled = bool(interrupted)
        write(None)
        if cancelled or done.get("cancelled"):
            self.console.print("[dim](stopped)[/]")
        self.last = done
        self.history.append((question, done["text"]))
        self.console.print(_stats_line(done))
        print_sources(done.get("sources"), limit=3)

    def print_stats(self) -> None:
        status = self.conn.ping()
        self.console.print(
            f"group: {status['workers']} workers · {status['answered']} answered · query host "
            f"RSS {status['rss_bytes'] / 2**20:,.0f} MB · conversation: {len(self.history)} turns")
        if self.last:
            self.console.print(_stats_line(self.last))


def _stats_line(done: dict) -> str:
    n = len(done["token_ids"])
    ttft = done.get("first_token_s")
    rate = (n - 1) / done["decode_s"] if n > 1 and done["decode_s"] else 0.0
    prefill = done["question_tokens"] / ttft if ttft else 0.0
    first = f"first token {ttft:.2f} s" if ttft is not None else "no tokens"
    return (f"[dim]{first} · prefill {prefill:,.0f} tok/s · decode {rate:.1f} tok/s · "
            f"{n} tokens[/]")
