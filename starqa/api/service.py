"""What a door that serves many clients at once holds (the HTTP and MCP servers): the
settings of the warm groups it starts, one group per context, kept warm while questions
come; the questions for each context asked together, as many as its group answers at once
(more queued, first come first served); and a tally of what it answered, for its health report."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import starqa.api.catalog as catalog
from starqa.api.errors import Stopped
from starqa.api.groups import GroupSettings, Turns, ask_group
from starqa.api.settings import IngestSettings
from starqa.api.streams import Channel, Stream
from starqa.cache.context import Context
from starqa.core.progress import UI
from starqa.phase2.answer import Answer, Question


class Tally:
    """Answers given, answers cancelled by a reader that left, questions that failed."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {"answered": 0, "cancelled": 0, "failed": 0}

    def add(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Service:
    """Contexts and their answers for a long-running door: every question is answered by
    its context's warm group (started with `settings` when none runs, so it stays warm
    while the questions come), together with the other questions for that context (its
    group decodes them in one batch, `phase2.decode.Batch`)."""

    def __init__(self, settings: GroupSettings = GroupSettings()):
        self.settings = settings
        self._turns = Turns()
        self._tally = Tally()

    def contexts(self) -> list[Context]:
        return catalog.contexts()

    def context(self, ref: str | None) -> Context:
        return catalog.context(ref)

    def ingest(self, paths: str | Sequence[str], *, name: str | None = None,
               model: str | None = None, method: str | None = None,
               options: IngestSettings = IngestSettings(), ui: UI = UI()) -> Context:
        """As `starqa.api.ingest`, with this door's worker count unless given; its progress
        on `ui`."""
        if self.settings.workers is not None and options.workers is None:
            options = dataclasses.replace(options, workers=self.settings.workers)
        return catalog.ingest(paths, name=name, model=model, method=method, options=options,
                              ui=ui)

    def stream(self, question: Question, context: Context | None = None) -> Stream:
        """The answer to `question` as it is generated (`context`: the one the question
        names, when the caller has found it already)."""
        context = context or catalog.context(question.context)

        def produce(channel: Channel) -> Answer:
            try:
                answer = ask_group(question, context, self.settings, channel, self._turns)
            except Stopped:
                raise  # withdrawn while it waited: neither answered nor failed
            except BaseException:
                self._tally.add("failed")
                raise
            left = answer.finish == "cancelled" and channel.closed.is_set()
            self._tally.add("cancelled" if left else "answered")
            return answer

        return Stream(produce, question.stop)

    def ask(self, question: Question, context: Context | None = None) -> Answer:
        with self.stream(question, context) as answer:
            return answer.result()

    def health(self) -> dict:
        """Questions waiting and being answered now, and the tally so far."""
        return {"waiting": self._turns.waiting(), "answering": self._turns.answering(),
                **self._tally.snapshot()}
