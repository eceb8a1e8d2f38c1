"""An answer as it is generated: `Stream` runs the answering in a thread of its own and
hands its text out piece by piece, then the whole `Answer`.

The thread (the producer) and the reader share a `Channel`: a queue of pieces (and reports
of the question's prefill, `Progress`, read by `next_event`), then one answer or one error; and two flags the producer reads at every token: `closed` (the reader
left: stop as soon as you can, nobody reads the answer) and `ending` (a stop string
appeared, or the reader cancelled: end the answer now and report it). Stop strings are
found on the reader's side, across pieces: text that could be the start of one is held
back until it is known not to be.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from starqa.api.errors import Stopped
from starqa.core.progress import UI
from starqa.phase2.answer import Answer, Progress


class Channel:
    """Between the producer and the reader of one answer."""

    def __init__(self):
        # ("piece" | "progress" | "done" | "error", _)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()
        self.ending = threading.Event()
        self.cancelled = threading.Event()  # the reader cancelled (a kind of `ending`)

    def piece(self, text: str) -> None:
        self.queue.put(("piece", text))

    def progress(self, step: Progress) -> None:
        self.queue.put(("progress", step))

    @property
    def stop_wanted(self) -> bool:
        return self.closed.is_set() or self.ending.is_set()


class ChannelUI(UI):
    """The engine's progress callbacks into a channel: each token a piece; a token once the
    reader has left or cancelled raises `Stopped`, which unwinds a cold answer (its worker
    group is taken down). Once a stop string has appeared (`stop_wanted`), a warm group is
    told to cancel and still sends its record, a cold answer in this process ends at its
    next token, and one on a worker group runs to its end with its pieces dropped: the
    reader cuts the record's text at the stop string."""

    def __init__(self, channel: Channel):
        self.channel = channel

    def token(self, text: str) -> None:
        if self.channel.closed.is_set() or self.channel.cancelled.is_set():
            raise Stopped("The answer was stopped.")
        if not self.channel.ending.is_set():  # a stop string: the rest is cut from it
            self.channel.piece(text)

    def stop_wanted(self) -> bool:
        return self.channel.stop_wanted


class StopScan:
    """Finds the first of `stops` in text that arrives in pieces."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # the end of the text so far that may begin a stop string
        self.hit = False

    def feed(self, piece: str) -> str:
        """The text that can be passed on now (all of it before a stop string)."""
        if not self.stops or self.hit:
            return "" if self.hit else piece
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[:min(found)]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What is held back, once the text has ended without a stop string."""
        out, self.held = self.held, ""
        return out


def _produce(produce: Callable[[Channel], Answer], channel: Channel) -> None:
    try:
        channel.queue.put(("done", produce(channel)))
    except BaseException as error:  # the reader raises it (a thread has nobody else to tell)
        channel.queue.put(("error", error))


class Stream(Iterator[str]):
    """Iterate for the answer's text, piece by piece; `result()` for the `Answer` (it waits
    for the rest). Leaving early stops the answer: `close()`, or a `with` block, or dropping
    the stream (CPython frees it at once). Errors (a `StarqaError`) are raised by the
    iteration, or by `result()` when nothing iterated."""

    def __init__(self, produce: Callable[[Channel], Answer], stop: Sequence[str] = (),
                 on_answer: Callable[[Answer], None] | None = None):
        self._channel = Channel()
        self._scan = StopScan(stop)
        self._text: list[str] = []
        self._answer: Answer | None = None
        self._error: BaseException | None = None
        self._on_answer = on_answer
        # the thread runs in this one's context: a cache root chosen by `Client(home=...)`
        threading.Thread(target=contextvars.copy_context().run,
                         args=(_produce, produce, self._channel), daemon=True,
                         name="starqa-answer").start()

    def __next__(self) -> str:
        while True:
            if isinstance(item := self.next_event(), str):
                return item

    def next_event(self) -> str | Progress:
        """The next piece of text, or report of the question's prefill (a warm group's
        answer sends one after each part of it); StopIteration at the end."""
        while self._answer is None and self._error is None:
            if self._channel.closed.is_set():
                self._error = Stopped("The stream was closed before its answer was complete.")
                break
            kind, value = self._channel.queue.get()
            if kind == "progress":
                return value
            if kind == "piece":
                if out := self._take(value):
                    return out
            elif kind == "done":
                if tail := self._finish(value):
                    return tail
            else:
                self._error = value
                raise value
        raise StopIteration

    def _take(self, piece: str) -> str:
        out = self._scan.feed(piece)
        if self._scan.hit:
            self._channel.ending.set()  # the producer ends the answer and reports it
        if out:
            self._text.append(out)
        return out

    def _finish(self, answer: Answer) -> str:
        tail = self._scan.flush()
        if tail:
            self._text.append(tail)
        if self._scan.hit:
            answer = answer.stopped_at(self.text)
        self._answer = answer
        if self._on_answer is not None:
            self._on_answer(answer)
        return tail

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return "".join(self._text)

    def result(self) -> Answer:
        """The whole answer, once generated (the pieces not yet read are read now)."""
        for _ in self:
            pass
        if self._error is not None:
            raise self._error
        return self._answer

    def cancel(self) -> None:
        """End the answer early and keep it: a warm group stops at its next token and the
        answer completes with what came until then (`finish` "cancelled"; its record read
        to the end, sources and timings included). A cold answer cannot give its record
        early: it ends with `Stopped`. Safe from a signal handler (it sets a flag)."""
        self._channel.cancelled.set()
        self._channel.ending.set()

    def close(self) -> None:
        """Stop the answer if it is still being generated (its thread ends soon after);
        nothing once it is complete."""
        if self._answer is None and self._error is None:
            self._channel.closed.set()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
