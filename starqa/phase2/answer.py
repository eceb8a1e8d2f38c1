"""A question and its answer: the records every path and every door shares. The answer is
built where it is made (a warm group's record in `starqa.workers.client`, a cold one in
`starqa.launchers.ask`), returned by the Python API, printed by `starqa ask --json` as
`Answer.as_dict()`, carried by the HTTP door (in its `starqa` field) and the MCP door.
Imports nothing heavy: a warm `ask` builds it without torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from starqa.cache.context import Context
from starqa.core.errors import StarqaError

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
class Progress:
    """A question's prefill so far, as its answer's first token is awaited: `processed` of
    the prompt's `total` tokens (the context's `cached` ones, and the question's done so
    far), `elapsed_s` since the question was taken up. A warm group sends it on its socket
    (`EVENT`) after each part of a question's prefill; the doors pass it on (HTTP's
    `prompt_progress`, MCP's progress notifications)."""

    EVENT: ClassVar[str] = "progress"
    processed: int
    total: int
    cached: int
    elapsed_s: float

    def as_dict(self) -> dict:
        return {"processed": self.processed, "total": self.total, "cached": self.cached,
                "elapsed_s": self.elapsed_s}


@dataclass(frozen=True)
class Source:
    """A file the answer copied from: its share of the attention traced to the documents
    and the lines around its peak (first and last, 1-based)."""

    path: str
    share: float
    lines: tuple[int, int]

    def as_dict(self) -> dict:
        return {"path": self.path, "share": self.share, "lines": list(self.lines)}


def sources_of(found: Sequence[dict] | None, traced: bool = True) -> tuple[Source, ...] | None:
    """Phase 2's sources (`starqa.phase2.sources.top_sources`) as `Source`s; None where
    attention traced none (`traced` False: top-k)."""
    if not traced:
        return None
    return tuple(Source(path=s["path"], share=float(s["share"]),
                        lines=(int(s["lines"][0]), int(s["lines"][-1]))) for s in found or ())


@dataclass(frozen=True)
class Timings:
    """Seconds from when the question was asked: to the whole answer and to its first
    token (None: no token came); the workers' prefill of the question, up to the first token
    (None: not known); the decode after the first token; `wait_s`, the part of the total
    spent before the question reached its workers (its turn in a queue, a group starting).
    `first_token_before_torch`: a cold ask's first token came before this process imported
    torch (`starqa.coldstart.firsttoken`)."""

    total_s: float
    first_token_s: float | None
    prefill_s: float | None
    decode_s: float
    wait_s: float = 0.0
    first_token_before_torch: bool = False

    def as_dict(self) -> dict:
        return {"total_s": self.total_s, "first_token_s": self.first_token_s,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "wait_s": self.wait_s,
                "first_token_before_torch": self.first_token_before_torch}

    @classmethod
    def since(cls, asked: float, first: float | None, end: float, prefill_s: float | None,
              decode_s: float, sent: float | None = None, before_torch: bool = False) -> Timings:
        """The timings of an answer asked at `asked`, whose first token came at `first`
        (None: none did) and that ended at `end`; sent to its workers at `sent` (default:
        when asked). Times are `time.perf_counter()`'s."""
        return cls(total_s=end - asked, first_token_s=(first - asked) if first else None,
                   prefill_s=prefill_s, decode_s=decode_s,
                   wait_s=max(0.0, (sent if sent is not None else asked) - asked),
                   first_token_before_torch=before_torch)


@dataclass(frozen=True)
class Answer:
    """An answer with its sources and timings. `sources` is None where the attention was
    top-k (it traces nothing); `finish`: "stop" (the model ended it, or a stop string),
    "length" (max_new_tokens reached) or "cancelled" (stopped while it was generated);
    `attention`: "exact" or the top-k settings (`TopK.describe`); `weights`: Phase 2's
    weight format, where known. `query_host` is False on the machines of a group across
    machines that do not hold the last block (the answer streams on the one that does);
    `peak_bytes` and `measures` are each worker's, for `starqa bench`."""

    text: str
    context: Context
    token_ids: tuple[int, ...]
    question_tokens: int
    sources: tuple[Source, ...] | None
    timings: Timings
    finish: str
    warm: bool  # answered by a warm worker group
    workers: int
    weights: str | None = None
    attention: str = "exact"
    query_host: bool = True
    peak_bytes: tuple[int, ...] = ()
    measures: tuple[dict, ...] = field(default=(), compare=False)

    @property
    def answer_tokens(self) -> int:
        return len(self.token_ids)

    def as_dict(self) -> dict:
        """JSON-ready: the answer, its context, token counts, sources and timings."""
        ctx = self.context
        return {"answer": self.text, "context": ctx.name, "key": ctx.key, "model": ctx.model,
                "method": ctx.method, "finish": self.finish, "warm": self.warm,
                "workers": self.workers, "weights": self.weights, "attention": self.attention,
                "tokens": {"context": ctx.tokens, "question": self.question_tokens,
                           "answer": self.answer_tokens},
                "sources": None if self.sources is None else [s.as_dict() for s in self.sources],
                "timings": self.timings.as_dict()}

    def stopped_at(self, text: str) -> Answer:
        """This answer cut where a stop string appeared: `text` is what came before it."""
        return replace(self, text=text.strip(), finish="stop")


def finish_of(token_ids: Sequence[int], max_new_tokens: int, cancelled: bool = False) -> str:
    """Why an answer of `token_ids` ended (`Answer.finish`)."""
    return "cancelled" if cancelled else "length" if len(token_ids) >= max_new_tokens else "stop"
