"""What goes into a question and what comes back, as frozen data every door shares: the
Python API returns `Answer`, the HTTP door puts `Answer.as_dict()` (less the text) in its
`starqa` field, the MCP door returns it whole. Built from the engine's answer (`of_engine`)
or from a warm group's last event (`of_group`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from starqa.api.catalog import Context
from starqa.api.errors import StarqaError
from starqa.workers.messages import Finished
from starqa.workers.runfile import RunInfo

DEFAULT_MAX_NEW_TOKENS = 256  # as `starqa ask`


@dataclass(frozen=True)
class Question:
    """One question about a context. `history`: earlier (question, answer) turns, the
    oldest first (a warm group keeps as many as fit the window); `stop`: strings that end
    the answer where they first appear (left out of it)."""

    text: str
    context: str | None = None  # a name, key or key prefix; None: the context used last
    history: tuple[tuple[str, str], ...] = ()
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    beyond_window: bool = False

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise StarqaError("The question is empty.")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise StarqaError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens}).")


@dataclass(frozen=True)
class Source:
    """A file the answer copied from: its share of the attention traced to the documents
    and the lines around its peak (first and last, 1-based)."""

    path: str
    share: float
    lines: tuple[int, int]

    def as_dict(self) -> dict:
        return {"path": self.path, "share": self.share, "lines": list(self.lines)}


@dataclass(frozen=True)
class Timings:
    """Seconds: the whole answer, to its first token, the question's prefill on the workers
    and the decode after the first token; `wait_s`: before the question was sent (its turn
    in a queue, a warm group starting)."""

    total_s: float
    first_token_s: float | None
    prefill_s: float | None
    decode_s: float
    wait_s: float = 0.0

    def as_dict(self) -> dict:
        return {"total_s": self.total_s, "first_token_s": self.first_token_s,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "wait_s": self.wait_s}


@dataclass(frozen=True)
class Answer:
    """An answer with its sources and timings. `sources` is None where the attention was
    top-k (it traces nothing); `finish`: "stop" (the model ended it, or a stop string),
    "length" (max_new_tokens reached) or "cancelled" (stopped while it was generated)."""

    text: str
    context: Context
    question_tokens: int
    answer_tokens: int
    sources: tuple[Source, ...] | None
    timings: Timings
    finish: str
    warm: bool  # answered by a warm worker group
    workers: int

    def as_dict(self) -> dict:
        """JSON-ready: the answer, its context, token counts, sources and timings."""
        ctx = self.context
        return {"answer": self.text, "context": ctx.name, "key": ctx.key, "model": ctx.model,
                "method": ctx.method, "finish": self.finish, "warm": self.warm,
                "workers": self.workers,
                "tokens": {"context": ctx.tokens, "question": self.question_tokens,
                           "answer": self.answer_tokens},
                "sources": None if self.sources is None else [s.as_dict() for s in self.sources],
                "timings": self.timings.as_dict()}

    def stopped_at(self, text: str) -> Answer:
        """This answer cut where a stop string appeared: `text` is what came before it."""
        return replace(self, text=text.strip(), finish="stop")


def sources_of(found: Sequence[dict] | None, traced: bool = True) -> tuple[Source, ...] | None:
    """Phase 2's sources (`starqa.phase2.sources.top_sources`) as `Source`s; None where
    attention traced none (top-k)."""
    if not traced:
        return None
    return tuple(Source(path=s["path"], share=float(s["share"]),
                        lines=(int(s["lines"][0]), int(s["lines"][-1]))) for s in found or ())


def of_engine(answer, context: Context, max_new_tokens: int) -> Answer:
    """An `starqa.engine.Answer` (cold or warm, from `engine.ask`) as an API answer."""
    n = len(answer.token_ids)
    return Answer(text=answer.text, context=context, question_tokens=answer.query_tokens,
                  answer_tokens=n, sources=sources_of(answer.sources, answer.attention == "exact"),
                  timings=Timings(total_s=answer.seconds,
                                  first_token_s=answer.first_token_seconds,
                                  prefill_s=answer.prefill_seconds,
                                  decode_s=answer.decode_seconds),
                  finish="length" if n >= max_new_tokens else "stop", warm=answer.warm,
                  workers=answer.workers)


def of_group(done: Finished, context: Context, group: RunInfo, timings: Timings,
             max_new_tokens: int) -> Answer:
    """A warm group's record of its answer (`starqa.workers.messages`) as an API answer."""
    n = len(done.token_ids)
    finish = "cancelled" if done.cancelled else "length" if n >= max_new_tokens else "stop"
    return Answer(text=done.text, context=context, question_tokens=done.question_tokens,
                  answer_tokens=n, sources=sources_of(done.sources, not group.topk),
                  timings=timings, finish=finish, warm=True, workers=group.workers)
