"""Questions through the Python API, as `starqa ask` and `starqa chat` answer them: `ask` and
`stream` call `ask_with`, which is `starqa ask` itself (a warm group's answer when one runs,
else a cold one that leaves a group warm for `keepalive` seconds); `Chat` keeps the
conversation and asks the context's warm group, started on its first question (or when
joined) when none runs, as the REPL of `starqa chat` does. Every path returns the one
`Answer` record (`starqa.phase2.answer`). `ask_all` asks several questions at once, which
the warm group answers together (`starqa ask --questions FILE`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from starqa import engine
import starqa.api.catalog as catalog
from starqa.api.errors import StarqaError
from starqa.api.groups import Group, GroupSettings, ask_group, start
from starqa.api.settings import AskSettings
from starqa.api.streams import Channel, ChannelUI, Stream
from starqa.cache.context import Context
from starqa.core.progress import UI
from starqa.phase2.answer import DEFAULT_MAX_NEW_TOKENS, Answer, Question
from starqa.topk.indexes import TopK
from starqa.workers import client
from starqa.workers.messages import GroupStatus
from starqa.workers.runfile import RunInfo


def ask_with(opts: engine.AskOptions, ui: UI = UI()) -> Answer:
    """`starqa ask` itself: every option (`AskOptions`), the answer's text streamed to
    `ui.token` and the steps before it on `ui`, and its `Answer`. A cold answer on this
    machine runs on the head start that `starqa` forked as it began
    (`starqa.coldstart.headstart`), where this process has one."""
    from starqa.coldstart import headstart

    return engine.ask(opts, ui, headstart.take())


def stream(question: str, context: Context | str | None = None, *,
           max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Sequence[str] = (),
           attention: TopK | None = None, beyond_window: bool = False,
           options: AskSettings = AskSettings()) -> Stream:
    """The answer to `question` as it is generated: iterate for its text, then `result()`
    for the `Answer`. `context`: a Context, a name, key or key prefix; None: the one used
    last. `stop`: strings that end the answer where they first appear (left out of it);
    `attention`: top-k attention (`topk_settings`; None: exact); `beyond_window` as
    `starqa ask --beyond-window`; the rest in `options` (`keepalive` 0: no warm group is
    left)."""
    ctx = catalog.context(context)
    asked = Question(question, ctx.key, max_new_tokens=max_new_tokens, stop=tuple(stop),
                     beyond_window=beyond_window)
    opts = options.ask_options(question, ctx.key, max_new_tokens, beyond_window, attention)

    def produce(channel: Channel) -> Answer:
        return dataclasses.replace(ask_with(opts, ChannelUI(channel)), context=ctx)

    return Stream(produce, asked.stop)


def ask(question: str, context: Context | str | None = None, *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Sequence[str] = (),
        attention: TopK | None = None, beyond_window: bool = False,
        options: AskSettings = AskSettings()) -> Answer:
    """The answer to `question` (see `stream`), once it is complete."""
    with stream(question, context, max_new_tokens=max_new_tokens, stop=stop,
                attention=attention, beyond_window=beyond_window, options=options) as answer:
        return answer.result()


def ask_all(questions: Sequence[str], context: Context | str | None = None, *,
            max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, attention: TopK | None = None,
            workers: int | None = None, keepalive: float = engine.DEFAULT_KEEPALIVE
            ) -> list[Stream]:
    """Several questions about one context, answered together: the context's warm group
    (started if none runs, with `workers` and `attention`; it exits `keepalive` idle
    seconds after the last question, never for 0: `stop` ends it) decodes them in one
    batch, each answer the one it gets alone. Returns a `Stream` per question, in their
    order, every one under way."""
    from starqa.api.service import Service

    ctx = catalog.context(context)
    asked = [Question(q, ctx.key, max_new_tokens=max_new_tokens) for q in questions]
    settings = GroupSettings(workers, keepalive, attention)
    running = client.find(ctx.key)
    check_attention(running, ctx, attention, "ask")
    if running is None:  # one start, before the questions go
        start(catalog.find(ctx.key), settings)
    service = Service(settings)
    return [service.stream(question, ctx) for question in asked]


class Chat:
    """A conversation about one context: each question is asked with the turns before it
    (as many as fit the window, the oldest dropped first), on the context's warm group.
    The group is started on the first question (or by `join`) when none runs, and exits
    `keepalive` idle seconds after the last one (as `starqa chat`'s); with keepalive 0, a
    group this chat started is its own: `close` stops it. `attention`: the group answers
    with top-k attention (`topk_settings`), and one running with other attention is an
    error."""

    def __init__(self, context: Context | str | None = None, *,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, workers: int | None = None,
                 keepalive: float = engine.DEFAULT_KEEPALIVE, attention: TopK | None = None):
        self.context = catalog.context(context)
        self.max_new_tokens = max_new_tokens
        # keep-alive 0: no group outlives the chat; the one it starts never idles out
        self._settings = GroupSettings(workers, -1 if keepalive == 0 else keepalive, attention)
        self._only_while_open = keepalive == 0
        self._history: list[tuple[str, str]] = []
        self._group: RunInfo | None = None  # the run info of the group joined last
        self._owns_group = False  # that group is this chat's to stop (`close`)

    @property
    def history(self) -> tuple[tuple[str, str], ...]:
        """The (question, answer) turns so far, the oldest first."""
        return tuple(self._history)

    def join(self, ui: UI = UI()) -> Group:
        """The context's warm group, joined now: the one running, else one started (its
        steps shown on `ui`; this waits until its workers are ready)."""
        return self.switch(self.context, ui, keep_history=True)

    def switch(self, context: Context | str, ui: UI = UI(), keep_history: bool = False) -> Group:
        """Go on about `context` (another one, or a newer version of this one), on its warm
        group, joined as `join` does; the conversation starts afresh unless
        `keep_history`. A group this chat started for itself (keepalive 0) that serves
        another context is stopped. Nothing changes when `context` cannot be found or a
        group with other attention serves it."""
        ctx = catalog.context(context)
        found = client.find(ctx.key)
        check_attention(found, ctx, self._settings.topk, "chat")
        if self._owns_group and (found is None or found.key != self._group.key):
            client.stop_group(self._group.key)
        self._owns_group = found is None and self._only_while_open
        self._group = found or start(catalog.find(ctx.key), self._settings, ui)
        self.context = ctx
        if not keep_history:
            self._history.clear()
        return Group.of(self._group)

    def group_gone(self) -> bool:
        """Whether the group joined last has gone since (its keep-alive ran out while the
        chat sat idle, `starqa stop` elsewhere, it died): `join` again to go on, the
        conversation kept. False before any is joined. A few file reads."""
        if self._group is None:
            return False
        group = client.find(self.context.key)
        return group is None or group.pid != self._group.pid

    def reingested(self) -> Context | None:
        """The context this chat's context's name means now, where that is a newer version
        (re-ingested by `ingest --watch` or another ingest since): `switch` to it to go on
        from the new shards. None where the name still means this one, or no longer means
        one context (renamed, removed, ambiguous)."""
        try:
            latest = catalog.context(self.context.name)
        except StarqaError:
            return None
        return latest if latest.key != self.context.key and \
            latest.name == self.context.name else None

    def status(self) -> GroupStatus:
        """What the group joined last says of itself (`starqa ps`'s columns: `workers`,
        `answered`, `rss_bytes` of the query host, ...); it is joined first where none is."""
        if self._group is None:
            self.join()
        conn = client.Client(self._group)
        try:
            return conn.ping()
        finally:
            conn.close()

    def stream(self, question: str, stop: Sequence[str] = ()) -> Stream:
        """The next answer as it is generated; the turn joins the history once complete
        (not when the stream is closed before; a stream cancelled with `cancel` completes,
        with what came until then)."""
        asked = Question(question, self.context.key, self.history, self.max_new_tokens,
                         tuple(stop))

        def produce(channel: Channel) -> Answer:
            if self._group is None or self.group_gone():
                self.join()  # so that a group it starts is known (and its to stop)
            return ask_group(asked, self.context, self._settings, channel)

        return Stream(produce, asked.stop,
                      on_answer=lambda a: self._history.append((question, a.text)))

    def ask(self, question: str, stop: Sequence[str] = ()) -> Answer:
        """The next answer, once complete."""
        with self.stream(question, stop) as answer:
            return answer.result()

    def clear(self) -> None:
        """Forget the conversation: the next question stands alone."""
        self._history.clear()

    def close(self) -> None:
        """End the chat: a group it started for itself (keepalive 0) is stopped; any
        other stays warm for its keep-alive."""
        if self._owns_group:
            client.stop_group(self._group.key)
            self._owns_group = False

    def __enter__(self) -> Chat:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_attention(group: RunInfo | None, ctx: Context, topk: TopK | None, verb: str
                    ) -> None:
    """A group already serving `ctx` with other attention than asked for (`topk`; None:
    exact) is an error: one group serves a context at a time."""
    wanted = topk.as_dict() if topk else None
    if group is not None and group.topk != wanted:
        running = "exact" if not group.topk else "top-k"
        raise StarqaError(f"A warm group already serves {ctx.name} with {running} "
                          "attention; one group serves a context at a time.",
                          hint=f"stop it first (starqa stop {ctx.key}), or {verb} "
                               "with the attention it has")
