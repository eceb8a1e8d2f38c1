"""Phase 1's settings and results, as `starqa ingest` and `starqa bench` pass them: the options
of an ingest (`IngestOptions`, `TokenIngestOptions`), what it returns (`IngestResult`), and
what the launcher hands Phase 1's steps (`Prepared`, `Mode`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from starqa import corpus as corpus_mod
from starqa import methods
from starqa.cache.manifest import Manifest, ModelIdentity
from starqa.corpus import prompt
from starqa.methods import MethodConfig
from starqa.reingest.reuse import Reuse


@dataclass(frozen=True)
class IngestOptions:
    paths: tuple[str, ...]
    model: str | None = None
    method: str = methods.DEFAULT
    block_size: int | None = None
    anchor_size: int | None = None
    workers: int | None = None
    name: str | None = None
    dtype: str | None = None
    max_file_bytes: int = 1_000_000
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    beyond_window: bool = False
    reserve: int | None = None  # tokens kept free to ask (None: default_reserve(window))
    force: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    device: str = "auto"
    command: str | None = None  # how the user ran it, recorded for "re-ingest with" hints
    method_params: dict | None = None  # method-specific settings given (methods.OPTIONS)
    index: str | None = None  # top-k attention's indexes to build too (indexes.KINDS)
    # Where the blocks are encoded: "auto" (in this process where a group would not pay
    # for its start: a group of one worker on the CPU; an incremental ingest's blocks on
    # the CPU, or one block, or a sequential method's), "process" or "group".
    encode_in: str = "auto"
    # Start the --workers asked for even past this machine's CPU cores or memory
    # (`check_workers`).
    oversubscribe: bool = False
    # The KV's precision on disk and in Phase 2 (`cache.manifest.KV_KINDS`): "float", in the
    # cache's dtype, or "int8", rows with fp32 scales (about half the bytes)
    # the KV's precision (`cache.manifest.KV_KINDS`); None: the planner's choice (float,
    # or int8 where float would take more than half the machine's memory)
    kv: str | None = None


@dataclass
class IngestResult:
    manifest: Manifest | None  # None on machines other than node 0 of a shared cache
    corpus: corpus_mod.Corpus
    cache_hit: bool
    seconds: float
    workers: int = 0
    encode_seconds: float = 0.0
    peak_bytes: list[int] = field(default_factory=list)  # per worker
    measures: list[dict] = field(default_factory=list)  # per worker, when measured (bench)
    reuse: Reuse | None = None  # what an ingest of a previously ingested source reused
    prepare_seconds: float = 0.0  # Phase 2's weights prepared for the first ask (in `seconds`)


@dataclass(frozen=True)
class TokenIngestOptions:
    """`ingest_tokens`' settings: the model (None: $STARQA_MODEL, else the default), the
    method, workers, dtype and device as for `ingest`; `name`, the context's and its
    stand-in file's. measure: the workers report time, FLOPs and bytes communicated
    (IngestResult.measures). allow_over_window: a context longer than the model's window is
    encoded anyway, for timing only, where answers do not matter; `ingest` never passes it
    (users have --beyond-window, which says what it does)."""

    model: str | None = None
    method: str = methods.DEFAULT
    workers: int | None = None
    dtype: str | None = None
    name: str = "tokens"
    measure: bool = False
    allow_over_window: bool = False
    device: str = "auto"


@dataclass(frozen=True)
class Prepared:
    """What an ingest encodes, as the launcher prepared it: its cache key, the token ids
    (with each file's token span and line starts), the corpus they came from and its packed
    spans, the model and the cache's dtype, the method's settings, the content's hash, the
    query template the manifest records, the block plan (None: fixed-size blocks) and the
    KV's precision."""

    key: str
    tokens: prompt.ContextTokens
    corpus: corpus_mod.Corpus
    spans: Sequence[corpus_mod.FileSpan]
    model: ModelIdentity
    dtype: str
    method: MethodConfig
    content: str
    query_template: dict | None = None
    blocks: Sequence[tuple[int, int]] | None = None
    kv: str = "float"  # the KV's precision (`cache.manifest.KV_KINDS`)


@dataclass(frozen=True)
class Mode:
    """How `steps.run_phase1` runs. measure: the workers report their numbers (bench);
    incremental: the blocks the content-addressed store holds are linked in (or re-rotated)
    and only the others encoded, in this process where a group would not pay for its start,
    and every block then joins the store; lock_held: the caller holds the context's lock;
    hit_here: across machines, this machine holds the context already."""

    measure: bool = False
    incremental: bool = False
    lock_held: bool = False
    hit_here: bool = False
