"""`starqa chat`: an interactive REPL over a cached context, answered by a warm worker group
(`starqa.api.Chat`: the conversation, the group joined, started or left; this module only
reads what is typed and draws the answers).

History (up-arrow, Ctrl-R) persists in `$STARQA_HOME/chat_history`; Enter sends, Esc then
Enter (or Alt-Enter) adds a line; Ctrl-C stops the current answer and keeps the session;
Ctrl-D or /exit leaves (the workers stay warm until their keep-alive runs out).
"""

from __future__ import annotations

import contextlib
import signal
import sys

from starqa import api
from starqa.core import paths
from starqa.core.errors import StarqaError

HELP = """\
/help            this help
/sources         files and lines the last answer attended to most
/stats           timings of the last answer and the worker group's state
/context NAME    switch to another ingested context
/clear           forget the conversation so far (each question stands alone again)
/exit            leave (Ctrl-D too); workers stay warm until their keep-alive ends
Enter sends; Esc then Enter adds a new line; Ctrl-C stops an answer."""


class Repl:
    """`starqa chat`'s loop: what is typed, asked of an `api.Chat`, its answers drawn."""

    def __init__(self, context: str | None, workers: int | None, keepalive: float,
                 max_new_tokens: int, attention: api.TopK | None = None):
        from starqa.cli.ui import RichUI, err

        self.console = err
        self.ui = RichUI(stream=False)  # the spinners of a group starting (never entered)
        # keep-alive 0: no group outlives the chat; the one it starts is stopped with it
        self.options = dict(max_new_tokens=max_new_tokens, workers=workers,
                            keepalive=keepalive, attention=attention)
        self.chat: api.Chat | None = None  # the conversation, once connected
        self.last: api.Answer | None = None
        self.failed = False  # a question or command failed: a script's chat exits 1
        self.connect(context)

    def connect(self, name: str | None) -> None:
        """Chat about context `name` (None: the one used last), on its warm group, joined
        now (started when none runs); the conversation starts afresh. Nothing changes when
        `name` is not found."""
        if self.chat is None:
            self.chat = api.Chat(name, **self.options)
            group = self.chat.join(self.ui)
        else:
            group = self.chat.switch(name, self.ui)
        self.joined(group)

    @property
    def history(self) -> tuple[tuple[str, str], ...]:
        """The (question, answer) turns so far, the oldest first."""
        return self.chat.history

    def joined(self, group: api.Group) -> None:
        """The line that says which context the chat is about, and on what group."""
        from starqa.cli.ui import safe

        ctx = self.chat.context
        self.console.print(
            f"[bold]{safe(ctx.name)}[/] · {ctx.tokens:,} tokens · {safe(ctx.method)} · "
            f"{group.workers} warm worker{'s' * (group.workers > 1)} · /help for commands")

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
        if self.chat is not None:
            self.chat.close()
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
                print_sources(self.last.sources, limit=10)
        elif name == "/stats":
            self.print_stats()
        elif name == "/clear":
            self.chat.clear()
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
        conversation; its group is the one the ingest's hand-over started, or a new one."""
        latest = self.chat.reingested()
        if latest is not None:
            from starqa.cli.ui import safe

            self.console.print(f"[dim]{safe(latest.name)} was re-ingested; answering from "
                               f"the new version ({latest.key[:8]})[/]")
            self.joined(self.chat.switch(latest, self.ui, keep_history=True))

    def rejoin(self) -> None:
        """The group went away since the last question (its keep-alive ran out while the
        chat sat idle, `starqa stop` elsewhere, or it died): start it again (or join the
        one now running), keeping the conversation. A few file reads per question."""
        if self.chat.group_gone():
            self.console.print("[dim](the warm group had stopped; starting it again)[/]")
            self.joined(self.chat.join(self.ui))

    def ask(self, question: str) -> None:
        from starqa.cli.ui import print_sources, stream_writer

        self.follow_reingest()
        self.rejoin()
        write = stream_writer()
        answer = self.chat.stream(question)
        # Ctrl-C while the answer streams asks the group to stop and the answer ends as
        # usual, with its record. The handler raises nothing (it sets a flag the answer's
        # thread reads at each event): a KeyboardInterrupt raised in the middle of drawing
        # could leave the display half drawn.
        interrupted: list[bool] = []

        def on_interrupt(signum, frame):
            interrupted.append(True)
            answer.cancel()

        previous = signal.signal(signal.SIGINT, on_interrupt)
        try:
            for piece in answer:
                write(piece)
            done = answer.result()
        finally:
            signal.signal(signal.SIGINT, previous)
            write(None)
        if interrupted or done.finish == "cancelled":
            self.console.print("[dim](stopped)[/]")
        self.last = done
        self.console.print(_stats_line(done))
        print_sources(done.sources, limit=3)

    def print_stats(self) -> None:
        status = self.chat.status()
        self.console.print(
            f"group: {status.workers} workers · {status.answered} answered · query host "
            f"RSS {status.rss_bytes / 2**20:,.0f} MB · conversation: {len(self.history)} turns")
        if self.last:
            self.console.print(_stats_line(self.last))


def _stats_line(answer: api.Answer) -> str:
    n, ttft, decode = answer.answer_tokens, answer.timings.prefill_s, answer.timings.decode_s
    rate = (n - 1) / decode if n > 1 and decode else 0.0
    prefill = answer.question_tokens / ttft if ttft else 0.0
    first = f"first token {ttft:.2f} s" if ttft is not None else "no tokens"
    return (f"[dim]{first} · prefill {prefill:,.0f} tok/s · decode {rate:.1f} tok/s · "
            f"{n} tokens[/]")
