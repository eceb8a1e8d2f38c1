"""Questions through the Python API, as `starqa ask` and `starqa chat` answer them: `ask` and
`stream` call `starqa.engine.ask` (a warm group's answer when one runs, else a cold one that
leaves a group warm for `keepalive` seconds); `Chat` keeps the conversation and asks the
context's warm group, started on its first question when none runs."""

from __future__ import annotations

from collections.abc import Sequence

from starqa import engine
import starqa.api.answers as answers
import starqa.api.catalog as catalog
from starqa.api.answers import DEFAULT_MAX_NEW_TOKENS, Answer, Question
from starqa.api.catalog import Context
from starqa.api.errors import StarqaError
from starqa.api.groups import GroupSettings, ask_group, classified
from starqa.api.streams import Channel, ChannelUI, Stream


def stream(question: str, context: Context | str | None = None, *,
           max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, workers: int | None = None,
           keepalive: float = engine.DEFAULT_KEEPALIVE, beyond_window: bool = False,
           device: str = "auto") -> Stream:
    """The answer to `question` as it is generated: iterate for its text, then `result()`
    for the `Answer`. `context`: a Context, a name, key or key prefix; None: the one used
    last. The rest as `starqa ask`'s options (keepalive 0: no warm group is left)."""
    ctx = catalog.context(context)
    asked = Question(question, ctx.key, max_new_tokens=max_new_tokens,
                     beyond_window=beyond_window)
    opts = engine.AskOptions(question=question, context=ctx.key, workers=workers,
                             max_new_tokens=max_new_tokens, beyond_window=beyond_window,
                             device=device, keepalive=keepalive)

    def produce(channel: Channel) -> Answer:
        try:
            answer = engine.ask(opts, ChannelUI(channel))
        except StarqaError as error:
            raise classified(error, catalog.find(ctx.key), asked) from None
        return answers.of_engine(answer, ctx, max_new_tokens)

    return Stream(produce)


def ask(question: str, context: Context | str | None = None, *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, workers: int | None = None,
        keepalive: float = engine.DEFAULT_KEEPALIVE, beyond_window: bool = False,
        device: str = "auto") -> Answer:
    """The answer to `question` (see `stream`), once it is complete."""
    with stream(question, context, max_new_tokens=max_new_tokens, workers=workers,
                keepalive=keepalive, beyond_window=beyond_window, device=device) as answer:
        return answer.result()


class Chat:
    """A conversation about one context: each question is asked with the turns before it
    (as many as fit the window, the oldest dropped first), on the context's warm group.
    The group is started on the first question when none runs, and exits `keepalive` idle
    seconds after the last one (as `starqa chat`'s)."""

    def __init__(self, context: Context | str | None = None, *,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, workers: int | None = None,
                 keepalive: float = engine.DEFAULT_KEEPALIVE):
        self.context = catalog.context(context)
        self.max_new_tokens = max_new_tokens
        self._settings = GroupSettings(workers, keepalive)
        self._history: list[tuple[str, str]] = []

    @property
    def history(self) -> tuple[tuple[str, str], ...]:
        """The (question, answer) turns so far, the oldest first."""
        return tuple(self._history)

    def stream(self, question: str, stop: Sequence[str] = ()) -> Stream:
        """The next answer as it is generated; the turn joins the history once complete
        (not when the stream is closed before)."""
        asked = Question(question, self.context.key, self.history, self.max_new_tokens,
                         tuple(stop))
        return Stream(lambda channel: ask_group(asked, self.context, self._settings, channel),
                      asked.stop, on_answer=lambda a: self._history.append((question, a.text)))

    def ask(self, question: str, stop: Sequence[str] = ()) -> Answer:
        """The next answer, once complete."""
        with self.stream(question, stop) as answer:
            return answer.result()

    def clear(self) -> None:
        """Forget the conversation: the next question stands alone."""
        self._history.clear()
