"""The Python API's typed settings: how an ingest runs (`IngestSettings`) and how an answer
is made (`AskSettings`), beside the arguments every call takes. Each field is the
`starqa ingest` or `starqa ask` option of the same name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starqa.core import DEFAULT_KEEPALIVE
from starqa.engine import AskOptions, IngestOptions
from starqa.topk.indexes import TopK


def _patterns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class IngestSettings:
    """How `ingest` packs and encodes: tokens per block and anchor (None: the method's
    default), the workers (None: as many as pay), the cache's dtype, the files taken
    (`include`/`exclude`: gitignore-style patterns, a string or several), the tokens kept
    free to ask (`reserve`), a fresh encoding even when cached (`force`), a context past the
    model's window (`beyond_window`), the device, the largest file read, the top-k
    indexes to build too (`index`) and the KV's precision (`kv`: "float", the cache's
    dtype, or "int8": rows with fp32 scales, about half the bytes; None: float, or int8
    where float would take more than half the memory)."""

    block_size: int | None = None
    anchor_size: int | None = None
    workers: int | None = None
    dtype: str | None = None
    include: str | Sequence[str] = ()
    exclude: str | Sequence[str] = ()
    reserve: int | None = None
    force: bool = False
    beyond_window: bool = False
    device: str = "auto"
    max_file_bytes: int = 1_000_000
    index: str | None = None
    kv: str | None = None

    def ingest_options(self, paths: tuple[str, ...], name: str | None,
                       model: str | None) -> IngestOptions:
        """The engine's options for an ingest of `paths` with these settings."""
        return IngestOptions(paths=paths, name=name, model=model, block_size=self.block_size,
                             anchor_size=self.anchor_size, workers=self.workers,
                             dtype=self.dtype, include=_patterns(self.include),
                             exclude=_patterns(self.exclude), reserve=self.reserve,
                             force=self.force, beyond_window=self.beyond_window,
                             device=self.device, max_file_bytes=self.max_file_bytes,
                             index=self.index, kv=self.kv)


@dataclass(frozen=True)
class AskSettings:
    """How `ask` and `stream` answer: the model named (None: the context's own; another one
    is an error), the workers of a cold answer (None: as starqa chooses), the seconds the
    warm group it leaves stays (0: none), the device and Phase 2's weights (None: the
    default for the device)."""

    model: str | None = None
    workers: int | None = None
    keepalive: float = DEFAULT_KEEPALIVE
    device: str = "auto"
    weights: str | None = None

    def ask_options(self, text: str, context: str, max_new_tokens: int, beyond_window: bool,
                    attention: TopK | None) -> AskOptions:
        """The engine's options for asking `text` about `context` with these settings."""
        return AskOptions(question=text, context=context, model=self.model,
                          workers=self.workers, max_new_tokens=max_new_tokens,
                          beyond_window=beyond_window, device=self.device,
                          weights=self.weights, keepalive=self.keepalive, topk=attention)
