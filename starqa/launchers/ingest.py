"""Phase 1's launcher, `starqa ingest`: folder → corpus → packed prompt → token ids → block
plan → cache key → torchrun workers (each encodes its blocks, `starqa.workers.worker`) → shards →
manifest, committed whole or not at all.

Runs in the launcher process, never in a worker: it tokenises (workers get token ids),
checks the window, decides the cache key, starts the group and commits the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starqa import corpus as corpus_mod
from starqa import methods
from starqa.cache import blockstore, shards, store
from starqa.cache.manifest import (FORMAT, IngestRun, Manifest, ModelIdentity, Placement,
    Skipped, SourceFile, block_file, read_manifest)
from starqa.core import paths, tensorfile
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.methods import MethodConfig, method_config, plan_blocks, plan_file_blocks
from starqa.reingest import packorder, reuse
from starqa.reingest.incremental import adopt as adopt_blocks
from starqa.reingest.incremental import keep as keep_blocks
from starqa.reingest.incremental import rope
from starqa.reingest.reuse import Reuse
from starqa.runtime.launch import PerRank, default_workers, launch_of, run_workers
from starqa.runtime.protocol import (Block, Event, Hit, IndexBuilt, IndexJob, IngestJob, Placed,
    Ready)
from starqa.topk import indexes

ENCODE_IN = ("auto", "process", "group")
PLAN = "files-1"  # the block plan of `ingest` (methods.plan_file_blocks), in its cache key
# How documents become ids, in every cache key: "data-1" tokenises them as data (no control
# tokens, prompt.Encoder) and escapes their boundaries (corpus.pack).
TEXT = "data-1"


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
    # Where the blocks an incremental ingest must encode are encoded: "auto" (in this
    # process when blocks are reused and a group would not pay for its start: on the CPU,
    # or one block, or a sequential method), "process" or "group".
    encode_in: str = "auto"
    # Start the --workers asked for even past this machine's CPU cores or memory
    # (`check_workers`).
    oversubscribe: bool = False


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
class Source:
    """What an ingest encodes, as the launcher prepared it: its cache key, the token ids
    (with each file's token span and line starts), the corpus they came from and its packed
    spans, the model and the cache's dtype, the method's settings, the content's hash, the
    query template the manifest records, and the block plan (None: fixed-size blocks)."""

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


@dataclass(frozen=True)
class Mode:
    """How `_encode` runs. measure: the workers report their numbers (bench); incremental:
    the blocks the content-addressed store holds are linked in (or re-rotated) and only the
    others encoded, in this process where a group would not pay for its start, and every
    block then joins the store; lock_held: the caller holds the context's lock; hit_here:
    across machines, this machine holds the context already."""

    measure: bool = False
    incremental: bool = False
    lock_held: bool = False
    hit_here: bool = False


@dataclass(frozen=True)
class Phase1Plan:
    """What Phase 1 will do for one ingest, decided before anything is written: the blocks
    and the method's prepared data; which blocks the store holds (`stored`: linked in,
    re-rotated with `freqs`, or to encode); the previous version a re-ingest reports
    against; whether the blocks to encode are encoded in this process (`local`) or on a
    group of `workers` per machine; the staging folder; the top-k indexes to build."""

    opts: IngestOptions
    source: Source
    mode: Mode
    final: Path  # where the context is committed
    blocks: Sequence[tuple[int, int]]
    prepared: dict | None  # the method's `prepare` result (pulsar: the summaries)
    store: Path  # the content-addressed block store (blockstore.store_dir)
    freqs: Any  # RoPE frequencies for re-rotating stored blocks; None: no re-rotation
    stored: reuse.Plan
    previous: Manifest | None
    local: bool
    workers: int
    staging: Path
    index: IndexJob | None

    @property
    def todo(self) -> list[int]:
        return list(self.stored.todo)

    @property
    def todo_tokens(self) -> int:
        return sum(self.blocks[i][1] - self.blocks[i][0] for i in self.stored.todo)

    @property
    def multinode(self) -> bool:
        return self.opts.nnodes > 1


@dataclass
class _Heard:
    """What Phase 1's encoding reported: when it started (the first worker ready), each
    block's index seconds, each rank's own reports, and across machines where the blocks
    went (`Placed`), or that every machine held them already (`Hit`)."""

    started: float | None = None
    index_seconds: list[float] = field(default_factory=list)
    ranks: PerRank = field(default_factory=PerRank)
    placed: Placed | Hit | None = None


def ingest(opts: IngestOptions, ui: UI = UI()) -> IngestResult:
    """Phase 1 of `opts.paths`: a cache hit when the same context is cached already, else
    encoded (only the blocks the store does not hold, on a re-ingest) and committed."""
    started = time.perf_counter()
    if opts.max_file_bytes < 1:
        raise StarqaError(f"--max-file-size {opts.max_file_bytes} skips every file as too large.",
                          hint=f"leave it out for the default, or pass --max-file-size "
                               f"{IngestOptions.max_file_bytes} (bytes; any number above 0)")
    with ui.status("Reading files"):
        corpus = corpus_mod.collect(opts.paths, max_file_bytes=opts.max_file_bytes,
                                    include=opts.include, exclude=opts.exclude)
    with ui.status("Resolving model"):
        model, tokenizer = _model(opts.model, ui)
    dtype = _cache_dtype(opts.dtype, opts.device)
    root = paths.contexts_dir()
    corpus, tokens, spans = _tokenised(opts, root, corpus, tokenizer, ui)
    opts = _checked(opts, len(tokens.ids), model.window)
    method = _method(opts, root, model, dtype, tokens.ids, tokenizer)
    content = corpus_mod.content_hash(corpus.files)
    key = _cache_key(content, model.digest, method.as_dict(), dtype, PLAN)
    source = Source(key, tokens, corpus, spans, model, dtype, method, content)
    result = _cached_or_encoded(opts, root, source, tokenizer, ui, started)
    return _with_prepared_weights(result, opts, source, ui, started)


def _with_prepared_weights(result: IngestResult, opts: IngestOptions, source: Source, ui: UI,
                           started: float) -> IngestResult:
    """`result` once Phase 2's weights are prepared beside the model, in the format and
    dtype the first `ask` will use by default ($STARQA_WEIGHTS, else the model's default for
    this device; the cache's dtype): that ask then maps them instead of building them
    before its answer (~47 s for Qwen2.5-Coder-1.5B). Done once per model, format and
    dtype; later ingests find them. Its time is the result's `prepare_seconds`, and part of
    `seconds`. A model Phase 2 cannot prepare here (dense weights, a GPU, an architecture it
    does not run, a read-only folder) is left as it is: `ask` says what it must."""
    from starqa import models
    from starqa.runtime import dist

    device = str(dist.resolve_device(opts.device))
    weights = models.phase2_weights(os.environ.get("STARQA_WEIGHTS") or None,
                                    source.model.spec, device)
    if weights == "dense" or not device.startswith("cpu"):
        return result
    import torch

    from starqa.models.decoder import prepare_weights

    begun = time.perf_counter()
    message = (f"Preparing {weights} weights for the first question (once per model; "
               f"{source.model.name})")
    try:
        prepare_weights(Path(source.model.path), getattr(torch, source.dtype), weights,
                        on_build=lambda: ui.status(message))
    except (StarqaError, RuntimeError, MemoryError) as e:  # the context stands; ask will retry
        ui.note(f"Phase 2's {weights} weights were not prepared ({e}); the first ask "
                "prepares them")
    end = time.perf_counter()
    return replace(result, seconds=end - started, prepare_seconds=end - begun)


def _model(spec: str | None, ui: UI) -> tuple[ModelIdentity, Any]:
    """The model `spec` names (None: the default), resolved, and its tokenizer."""
    from starqa import models

    model_path = models.resolve_model(spec, ui)
    tokenizer = models.load_tokenizer(model_path)
    window = models.context_window(_config(model_path))
    return (ModelIdentity.of(model_path, models.recorded_spec(spec or models.DEFAULT_MODEL),
                             window, models.fingerprint(model_path)), tokenizer)


def _cache_dtype(dtype: str | None, device: str) -> str:
    """The cache's dtype (torch's name) for --dtype on `device`."""
    from starqa import models
    from starqa.runtime import dist

    return str(models.parse_dtype(dtype, dist.resolve_device(device))).removeprefix("torch.")


def _tokenised(opts: IngestOptions, root: Path, corpus: corpus_mod.Corpus, tokenizer,
               ui: UI) -> tuple[corpus_mod.Corpus, prompt.ContextTokens, list]:
    """(the corpus with its files in packing order, their token ids, their packed spans)."""
    # The files' order (starqa.reingest.packorder): the last context of these sources sets it,
    # whatever its method or model; across machines every launcher must pack alike, and
    # mtimes differ between copies: path order.
    layout = None if opts.nnodes > 1 else _previous(root, opts.paths)
    files = tuple(sorted(corpus.files, key=lambda f: f.path)) if opts.nnodes > 1 else \
        packorder.keeping(corpus.files, [f.path for f in layout.files]) if layout else \
        packorder.by_age(corpus.files)
    with ui.status("Tokenising"):
        packed, spans = corpus_mod.pack(files)
        tokens = prompt.tokenize_context(tokenizer, packed, spans)
        if layout is not None and not packorder.head_kept(layout, tokens.ids):
            files = packorder.by_age(corpus.files)  # all encoded again anyway: laid out afresh
            packed, spans = corpus_mod.pack(files)
            tokens = prompt.tokenize_context(tokenizer, packed, spans)
    return replace(corpus, files=files), tokens, spans


def _checked(opts: IngestOptions, n: int, window: int) -> IngestOptions:
    """`opts` with its reserve resolved, once the index asked for, the reserve and the
    context's `n` tokens are checked against the model's `window`."""
    if opts.index is not None and opts.index not in ("ivf", "hnsw"):
        raise StarqaError(f"--index {opts.index!r} is not an index to build.",
                          hint="choose ivf or hnsw (flat top-k searches the keys themselves "
                               "and needs none)")
    opts = replace(opts, reserve=default_reserve(window) if opts.reserve is None else opts.reserve)
    if opts.reserve < 0:
        raise StarqaError(f"--reserve must be 0 or more tokens (got {opts.reserve}).")
    if opts.reserve >= window:  # no context could ever leave it: not even --beyond-window
        raise StarqaError(
            f"--reserve {opts.reserve:,} is not less than the {window:,} tokens of the model's "
            "window: it keeps room for a question and an answer beside the context.",
            hint=f"pass --reserve {default_reserve(window):,} (the default here) or another "
                 f"number below {window:,}")
    if n + opts.reserve > window and not opts.beyond_window:
        raise _no_room(n, opts.reserve, window)
    return opts


def _method(opts: IngestOptions, root: Path, model: ModelIdentity, dtype: str, ids: list[int],
            tokenizer) -> MethodConfig:
    """The method's settings for this context, checked usable (apb: with the question's
    ids, which join every block's anchor)."""
    n = len(ids)
    methods.check_block_size(opts.block_size, n)
    method = method_config(opts.method, n, _block_size(opts, root, model, dtype, n),
                           opts.anchor_size, opts.method_params)
    methods.get(method.name).check_usable(method)
    if method.params.get("question"):  # apb: the question joins every block's anchor
        question_ids = prompt.encoder(tokenizer).text(method.params["question"])
        method = replace(method, params={**method.params, "question_ids": question_ids})
    if opts.encode_in not in ENCODE_IN:
        raise StarqaError(f"Unknown --encode-in {opts.encode_in!r}.",
                          hint=f"choose one of: {', '.join(ENCODE_IN)}")
    return method


def _cached_or_encoded(opts: IngestOptions, root: Path, source: Source, tokenizer, ui: UI,
                       started: float) -> IngestResult:
    """The context cached already (a hit), or encoded now, under the context's lock."""
    final = root / source.key
    # One ingest of a key at a time, from the cache check through the commit: a second
    # ingest of the same input waits, then is a cache hit (issue #11, item 9). Only node 0
    # locks: the other machines' launchers must join its torchrun group, never wait on it.
    lock = (store.context_lock(root, source.key, on_wait=lambda: ui.waiting(
                "Waiting for another ingest of the same context")) if opts.node_rank == 0
            else contextlib.nullcontext())
    with lock:
        hit = not opts.force and _reusable(final, PLAN) and _placed_alike(final, opts)
        if not hit or opts.nnodes != 1:
            files = [(f.path, a, b) for f, (a, b) in zip(source.corpus.files,
                                                         source.tokens.file_tokens)]
            source = replace(source, query_template=prompt.query_template(tokenizer),
                             blocks=plan_file_blocks(len(source.tokens.ids),
                                                     source.method.block_size, files))
            # Across machines every machine starts the group, even with the context here:
            # it is a cache hit only where every machine holds it (the workers agree).
            return _encode(opts, root, source, started, ui,
                           Mode(incremental=opts.nnodes == 1, lock_held=True, hit_here=hit))
        manifest = read_manifest(final)
        if opts.name and opts.name != manifest.name:  # --name applies to a hit too
            manifest = store.rename_context(manifest, opts.name)
        store.touch(manifest)
    if opts.index:  # a hit without the indexes asked for: built now (they take the lock)
        manifest = indexes.ensure(manifest, opts.index, on_build=ui.waiting)
    return IngestResult(manifest, source.corpus, True, time.perf_counter() - started)


def default_reserve(window: int) -> int:
    """Tokens `ingest` keeps free for a question and its answer: 512 (a question and a short
    answer), but never more than a quarter of a small window."""
    return min(512, window // 4)


MIN_ROOM = 64  # tokens: the least room worth offering for a question and its answer


def _no_room(n: int, reserve: int, window: int) -> StarqaError:
    """The over-window error of `ingest`: a context that fills the window leaves no room to
    ask (issue #11, item 13), so the numbers include the reserve, and the way out names an
    embedded model whose window would hold it."""
    from starqa.models import EMBEDDED

    need = f"{n:,} tokens" + (f" + {reserve:,} reserved for a question and an answer = "
                              f"{n + reserve:,} tokens" if reserve else "")
    fixes = ["ingest fewer files (--exclude, a sub-folder)"]
    if reserve and window - n >= MIN_ROOM:  # less room than that holds no real question
        fixes.append(f"reserve less (--reserve {window - n:,} or lower; now {reserve:,})")
    if longer := [f"--model {m.name}: {m.window:,} tokens" for m in EMBEDDED
                  if m.window >= n + reserve]:
        fixes.append(f"use a model with a longer window ({' or '.join(longer)})")
    fixes.append("pass --beyond-window to go on anyway")
    return StarqaError(f"The context is {need} > {window:,} the model was trained on.",
                       hint=", ".join(fixes[:-1]) + ", or " + fixes[-1])


def ingest_tokens(ids: list[int], root: Path, opts: TokenIngestOptions = TokenIngestOptions(),
                  ui: UI = UI()) -> IngestResult:
    """Phase 1 over token ids given directly, through the same torchrun workers as `ingest`:
    the way in for `starqa bench`'s synthetic contexts. One stand-in file named `opts.name`
    holds every token (so answers are attributed, as for ingested files); always encodes
    (no cache lookup); the context is committed under `root`."""
    from starqa import models

    started = time.perf_counter()
    spec = opts.model or os.environ.get("STARQA_MODEL") or models.DEFAULT_MODEL  # as resolved
    model_path = models.resolve_model(spec, ui)
    window = models.context_window(_config(model_path))
    identity = ModelIdentity.of(model_path, models.recorded_spec(spec), window,
                                models.fingerprint(model_path))
    if len(ids) > window and not opts.allow_over_window:
        raise StarqaError(f"The context is {len(ids):,} tokens > {window:,} the model was "
                          "trained on.", hint="use fewer tokens or a model with a longer window")
    config = method_config(opts.method, len(ids))
    dtype = _cache_dtype(opts.dtype, opts.device)
    content = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    key = _cache_key(content, identity.digest, config.as_dict(), dtype)
    name = opts.name
    ingest_opts = IngestOptions(paths=(), model=opts.model, method=opts.method,
                                workers=opts.workers, name=name, dtype=dtype, device=opts.device,
                                command=f"starqa bench ({name})")
    # One stand-in file over every token, a line per BENCH_LINE tokens, so that answers
    # are attributed (and `bench` measures what that costs) as for ingested files.
    n = len(ids)
    lines = list(range(0, n, BENCH_LINE))
    whole = corpus_mod.SourceFile(name, "", 0)
    source = Source(key, prompt.ContextTokens(list(ids), [(0, n)], [lines]),
                    corpus_mod.Corpus((), (whole,), ()),
                    [corpus_mod.FileSpan(name, 0, 0, 0, len(lines))], identity, dtype, config,
                    content)
    return _encode(ingest_opts, root, source, started, ui, Mode(measure=opts.measure))


BENCH_LINE = 64  # tokens per line of `ingest_tokens`' stand-in file


# ------------------------------------------------------------------ Phase 1: plan and steps


def _encode(opts: IngestOptions, root: Path, source: Source, started: float, ui: UI,
            mode: Mode = Mode()) -> IngestResult:
    """Run Phase 1 and commit the shards under `root / source.key`, all or nothing: plan
    it (`_plan`), link in what the store holds, encode the rest (`_phase1`), then commit
    (`_commit`). Across machines (`opts.nnodes` > 1) each machine stages and commits its own
    blocks (starqa.cache.hosts)."""
    plan = _plan(opts, root, source, mode)
    try:
        keep_blocks(plan.stored, plan.store, plan.staging, plan.blocks, plan.freqs,
                    source.method.name)
        heard = _phase1(plan, ui)
        encode_seconds = time.perf_counter() - (heard.started or started)
        for leftover in plan.staging.glob("tokens-node*.safetensors"):
            leftover.unlink()
        if isinstance(heard.placed, Hit):  # every machine holds it: nothing was encoded
            shutil.rmtree(plan.staging, ignore_errors=True)
            manifest = read_manifest(plan.final)
            store.touch(manifest)
            return IngestResult(manifest, source.corpus, True, time.perf_counter() - started)
        if plan.multinode and heard.placed is not None and heard.placed.shared \
                and opts.node_rank != 0:
            shutil.rmtree(plan.staging, ignore_errors=True)  # node 0 commits on the shared cache
            return IngestResult(None, source.corpus, False, time.perf_counter() - started,
                                plan.workers, encode_seconds,
                                peak_bytes=heard.ranks.peak_bytes(),
                                measures=heard.ranks.measure_rows())
        _commit(plan, heard, encode_seconds)
    except BaseException:  # every machine drops its own staging: no half-written context
        shutil.rmtree(plan.staging, ignore_errors=True)
        raise
    manifest = read_manifest(plan.final)
    store.touch(manifest)
    return IngestResult(manifest, source.corpus, False, time.perf_counter() - started,
                        plan.workers * opts.nnodes, encode_seconds,
                        peak_bytes=heard.ranks.peak_bytes(), measures=heard.ranks.measure_rows(),
                        reuse=_reuse_report(plan, manifest))


def _plan(opts: IngestOptions, root: Path, source: Source, mode: Mode) -> Phase1Plan:
    """What Phase 1 will do (`Phase1Plan`); makes the staging folder."""
    ids, method, model = source.tokens.ids, source.method, source.model
    blocks = source.blocks or plan_blocks(len(ids), method.block_size)
    encoder = methods.get(method.name)
    # computed once here, for every worker and the manifest (pulsar: the summaries)
    prepared = encoder.prepare(ids, method, blocks)
    bstore = blockstore.store_dir(root)
    freqs = rope(model.path) if mode.incremental and encoder.rotatable else None
    stored = reuse.plan(method, ids, blocks, prepared,
                        reuse.BlockStore(bstore, model.digest, source.dtype),
                        force=opts.force or not mode.incremental, rotate=freqs is not None)
    previous = _previous(root, opts.paths, method.name, model.digest, source.dtype) \
        if mode.incremental else None
    todo = list(stored.todo)
    local = mode.incremental and _in_process(opts, encoder, stored, mode.measure)
    # a group never has more workers than blocks to spread (apb runs every block)
    spread = max(len(encoder.share(todo, len(blocks), 1, 0)), 1)
    workers = 1 if local or not todo else _ingest_workers(opts, method.name, spread)
    if not local and todo:
        workers = check_workers(opts, workers, model.path, source.dtype)
    # Each machine's workers write into its own staging folder, and each machine commits
    # the blocks it keeps (on a shared cache, node 0 all of them: starqa.cache.hosts).
    multinode = opts.nnodes > 1
    if multinode and opts.index:
        raise StarqaError("--index is not built across machines yet.",
                          hint="ingest across machines without --index; top-k attention "
                               "needs every block on one machine (ingest there with --index)")
    staging = store.staging_dir(root, source.key, node=opts.node_rank if multinode else None)
    index = IndexJob(opts.index, indexes.new_folder(opts.index)) if opts.index else None
    return Phase1Plan(opts, source, mode, root / source.key, blocks, prepared, bstore, freqs,
                      stored, previous, local, workers, staging, index)


def _phase1(plan: Phase1Plan, ui: UI) -> _Heard:
    """Encode the plan's blocks to encode, in this process or on a group; what it reported."""
    heard = _Heard()
    if not plan.todo:
        pass
    elif plan.local:
        _encode_here(plan, ui, heard)
    else:
        _encode_on_group(plan, ui, heard)
    return heard


def _encode_here(plan: Phase1Plan, ui: UI, heard: _Heard) -> None:
    """The blocks to encode, encoded in this process (`_in_process` chose it)."""
    from starqa.workers.encoding import BlockSink, EncodeTask, encode_in_process

    def on_ready() -> None:
        heard.started = time.perf_counter()
        ui.start_encoding(plan.todo_tokens, 1)

    source = plan.source
    ui.waiting("Loading the model")
    encode_in_process(source.model.path, plan.opts.device, source.tokens.ids,
                      EncodeTask(source.method, plan.blocks, plan.todo, plan.prepared),
                      BlockSink(plan.staging, source.dtype, plan.index,
                                lambda index, tokens: ui.advance(tokens),
                                heard.index_seconds.append), on_ready)


def _encode_on_group(plan: Phase1Plan, ui: UI, heard: _Heard) -> None:
    """The blocks to encode, encoded on a torchrun group of `plan.workers` per machine."""
    from starqa.runtime import dist
    from starqa import models

    opts, source = plan.opts, plan.source
    tokens_file = _save_tokens(plan.staging, source.tokens.ids, opts.node_rank)
    job = IngestJob(model_path=source.model.path, dtype=source.dtype,
                    compute_dtype=models.phase1_dtype(source.dtype,
                                                      dist.resolve_device(opts.device),
                                                      source.model.path, plan.workers),
                    method=source.method.as_dict(), blocks=tuple(map(tuple, plan.blocks)),
                    todo=tuple(plan.todo), staging=str(plan.staging),
                    tokens_file=str(tokens_file), measure=plan.mode.measure,
                    prepared=plan.prepared, index=plan.index, across=plan.multinode,
                    hit=plan.mode.hit_here)

    def on_event(event: Event) -> None:
        if isinstance(event, Ready):
            if heard.started is None:
                heard.started = time.perf_counter()
                ui.start_encoding(plan.todo_tokens, plan.workers * opts.nnodes)
        elif isinstance(event, Block):
            ui.advance(event.tokens)
        elif isinstance(event, IndexBuilt):
            heard.index_seconds.append(event.seconds)
        elif isinstance(event, (Placed, Hit)):
            heard.placed = event
        else:
            heard.ranks.hear(event)

    workers = plan.workers
    ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading the model)")
    run_workers(job, launch_of(opts, workers), on_event)
    tokens_file.unlink(missing_ok=True)  # node 0 may have committed it away already


def _commit(plan: Phase1Plan, heard: _Heard, encode_seconds: float) -> None:
    """Commit the staging folder as the context: every block hashed (or listed, across
    machines), the indexes of the blocks linked in built, the manifest written."""
    if plan.multinode:  # every block's checksum, gathered from the machines that keep them
        hashed = shards.listed_blocks(plan.staging, plan.blocks, heard.placed.sums,
                                      heard.placed.held)
    elif plan.mode.incremental:  # into the store
        hashed = adopt_blocks(plan.stored, plan.store, plan.staging, plan.blocks)
    else:
        hashed = shards.hash_blocks(plan.staging, plan.blocks, known=plan.stored.known)
    built = ()
    if plan.index is not None:  # the blocks linked in, not encoded, get theirs here
        encoded = set(plan.todo)
        folder = plan.staging / plan.index.folder
        for i in (i for i in range(len(plan.blocks)) if i not in encoded):
            heard.index_seconds.append(indexes.write_block(
                folder, plan.index.kind, i,
                tensorfile.read_tensor(plan.staging / block_file(i), "k")))
        built = (indexes.hash_set(plan.staging, plan.index.folder, plan.index.kind,
                                  len(plan.blocks), sum(heard.index_seconds)),)
    store.commit(plan.staging, plan.final, _manifest(plan, hashed, built, heard.placed,
                                                      encode_seconds),
                 replace_existing=True, held=plan.mode.lock_held and plan.opts.node_rank == 0)


def _manifest(plan: Phase1Plan, hashed, built: tuple, placed: Placed | None,
              encode_seconds: float) -> Manifest:
    """The committed context's manifest."""
    opts, source = plan.opts, plan.source
    ids, tokens, corpus = source.tokens.ids, source.tokens, source.corpus
    sources = tuple(str(Path(p).resolve()) for p in opts.paths)
    return Manifest(
        key=source.key, name=opts.name or _default_name(opts.paths), created=time.time(),
        sources=sources, command=opts.command or "starqa ingest " + shlex.join(sources),
        model=source.model, reserve=opts.reserve, dtype=source.dtype, method=source.method,
        content_sha256=source.content, n_tokens=len(ids),
        query_position=query_position(ids, source.method, plan.blocks, plan.prepared),
        query_template=source.query_template, blocks=hashed,
        files=tuple(SourceFile(path=sp.path, token_start=a, token_end=b, lines=sp.lines,
                               bytes=f.size, line_tokens=tuple(lines),
                               sha256=reuse.file_sha(f.text))
                    for sp, (a, b), lines, f in zip(source.spans, tokens.file_tokens,
                                                    tokens.line_tokens, corpus.files)),
        skipped=tuple(Skipped(path=s.path, reason=s.reason) for s in corpus.skipped),
        ingest=IngestRun.timed(plan.workers * opts.nnodes, encode_seconds, len(ids)),
        indexes=built, placement=_placement(placed, opts))


def _reuse_report(plan: Phase1Plan, manifest: Manifest) -> Reuse | None:
    """What a re-ingest reused and what changed since the previous version, where either."""
    stored, previous = plan.stored, plan.previous
    if not (plan.mode.incremental and (previous is not None or stored.reused or stored.rotated)):
        return None
    changes = None if previous is None else reuse.changes(
        {f.path: f.sha256 for f in previous.files},
        {f.path: f.sha256 for f in manifest.files})
    method = plan.source.method
    why = _why(plan.opts, methods.get(method.name), method, stored, changes, previous, manifest)
    return Reuse(len(plan.blocks), len(stored.reused), len(stored.rotated), len(plan.todo),
                 changes, why, plan.local)


def _placement(placed: Placed | None, opts: IngestOptions) -> Placement | None:
    """The manifest's record of which machine keeps which block; None when every block is
    in this folder (one machine, or a cache all machines share)."""
    if opts.nnodes == 1 or placed.shared:
        return None
    return Placement(nodes=opts.nnodes, node=placed.node, held=tuple(placed.held),
                     homes=tuple(placed.homes), hosts=tuple(placed.hosts))


def _placed_alike(folder: Path, opts: IngestOptions) -> bool:
    """A committed context kept as this ingest would keep it: whole (one machine, or a
    shared cache), or split over as many machines, this one being the same node."""
    where = read_manifest(folder).placement
    return where is None or (where.nodes == opts.nnodes and where.node == opts.node_rank)


def _in_process(opts: IngestOptions, encoder, plan: reuse.Plan, measure: bool) -> bool:
    """Encode an incremental ingest's few blocks in this process instead of on a torchrun
    group: the user waits for the group's start and every worker's model load, which one
    changed block does not pay for. On the CPU a group's workers share the same cores, so
    this process (with all of them) is as fast at encoding; on GPUs a group wins when more
    than one block is to be encoded and the method can spread them."""
    if opts.encode_in != "auto":
        return opts.encode_in == "process"
    if measure or opts.nnodes > 1 or not plan.todo or not (plan.reused or plan.rotated):
        return False
    from starqa.runtime import dist

    return (str(dist.resolve_device(opts.device)).startswith("cpu") or len(plan.todo) == 1
            or encoder.sequential)


def _block_size(opts: IngestOptions, root: Path, model: ModelIdentity, dtype: str,
                n: int) -> int | None:
    """--block-size; else, on a re-ingest, the previous version's (`reuse.kept_block_size`);
    else None (the default)."""
    if opts.block_size is not None or opts.force or opts.nnodes > 1:
        return opts.block_size
    previous = _previous(root, opts.paths, opts.method, model.digest, dtype)
    return None if previous is None else reuse.kept_block_size(previous.method.block_size, n)


def _previous(root: Path, paths_: tuple[str, ...], method: str | None = None,
              model_digest: str | None = None, dtype: str | None = None) -> Manifest | None:
    """The most recently used context of the same sources, and of the same method, model
    and dtype where given: what a re-ingest reports its changes against (all three), and
    lays its files out like (none)."""
    sources = tuple(str(Path(p).resolve()) for p in paths_)
    for manifest in store.list_contexts(root):
        if manifest.sources == sources and method in (None, manifest.method.name) and \
                model_digest in (None, manifest.model.digest) and dtype in (None, manifest.dtype):
            return manifest
    return None


def _why(opts: IngestOptions, encoder, method, plan: reuse.Plan, changes, previous,
         manifest: Manifest) -> str | None:
    """Why more blocks were encoded than hold changed files, when it is not plain."""
    if opts.force:
        return "--force re-encodes every block"
    if changes is None or not plan.todo:
        return None
    if encoder.rotatable and method.anchor_size and len(plan.todo) == len(manifest.blocks):
        touched = changes.touches({f.path: (f.token_start, f.token_end) for f in previous.files},
                                  {f.path: (f.token_start, f.token_end) for f in manifest.files},
                                  method.anchor_size)
        if touched:
            return (f"{touched[0]} is in the anchor (the first {method.anchor_size:,} tokens, "
                    "which every block is encoded after): every block was encoded again")
    if encoder.reuse == "prefix" and len(plan.todo) > 1:
        return (f"{method.name} encodes every block after the first change again (each "
                "depends on every block before it)")
    return None


def query_position(ids: list[int], method, blocks, prepared: dict | None = None) -> int:
    """Where Phase 2 positions start (the method's `query_position`: after the context,
    except for pulsar's contiguous mode); `prepared`: the method's `prepare` result."""
    return methods.get(method.name).query_position(ids, method, blocks, prepared)


def _ingest_workers(opts: IngestOptions, method: str, n_blocks: int) -> int:
    """Workers per machine, never more than the method can use: a sequential method (exact
    causal encoding: dense) runs on one worker (ring is the distributed exact method); the
    others never start more workers than blocks."""
    encoder = methods.get(method)
    if encoder.sequential:
        if opts.nnodes > 1:
            raise StarqaError(f"{method} encodes on one worker; it cannot be spread over "
                              "machines.", hint=f"use --method {methods.DEFAULT} across "
                                                "machines, or drop --nnodes")
        return 1
    most = encoder.max_workers(n_blocks)
    if opts.nnodes == 1:
        return min(opts.workers or default_workers(opts.device), most)
    workers = opts.workers or default_workers(opts.device)
    if workers * opts.nnodes > most:
        raise StarqaError(f"{workers * opts.nnodes} workers on {opts.nnodes} machines but only "
                          f"{n_blocks} blocks.", hint="pass a smaller --block-size or --workers")
    return workers


def check_workers(opts: IngestOptions, workers: int, model_path, dtype: str) -> int:
    """The Phase 1 workers to start on this machine's CPU, each loading its own copy of the
    model: `workers` when the cores and the memory hold them. Asked for (--workers), more
    than the cores, or more copies than the memory available holds, is an error naming the
    numbers and the fix (unless `opts.oversubscribe`); by default (one per core), as many
    as the memory holds. GPUs: `launch.check_gpus`."""
    from starqa.runtime import dist, launch
    from starqa import models

    device = str(dist.resolve_device(opts.device)).split(":")[0]
    if device != "cpu" or opts.oversubscribe:
        return workers
    asked = f"--workers {opts.workers}" + (f" ({workers} for {workers} blocks)"
                                           if workers != opts.workers else "")
    if opts.workers is not None:
        launch.check_cores(workers, asked, "add --oversubscribe")
    each = _model_copy_bytes(Path(model_path), models.phase1_dtype(dtype, device, model_path,
                                                                   workers))
    available = models.available_memory()
    if available is None or workers * each <= available:
        return workers
    fits = max(1, available // max(each, 1))
    if opts.workers is None:
        return min(workers, fits)
    gib = 1 << 30
    raise StarqaError(
        f"{asked} need about {workers * each / gib:.1f} GiB for their copies of the "
        f"model ({each / gib:.2f} GiB each) but {available / gib:.1f} GiB of memory is "
        "available.",
        hint=f"pass --workers {fits} or fewer, or add --oversubscribe to start {workers} anyway")


def _model_copy_bytes(model_path: Path, compute: str) -> int:
    """The bytes one worker's copy of the model takes: its weight files, twice that when
    16-bit weights are computed in fp32 (`models.phase1_dtype`)."""
    from starqa.models import weight_files

    weights = sum(f.stat().st_size for f in weight_files(model_path))
    try:
        stored = json.loads((model_path / "config.json").read_text())
        stored = stored.get("torch_dtype") or stored.get("dtype")
    except (OSError, ValueError, AttributeError):
        stored = None
    widen = compute == "float32" and stored in ("bfloat16", "float16")
    return weights * (2 if widen else 1)


def ingest_worker_count(method: str, n_blocks: int, workers: int) -> int:
    """The workers Phase 1 of `method` runs on, on one machine, when `workers` are asked for."""
    return _ingest_workers(IngestOptions(paths=(), workers=workers), method, n_blocks)


def _cache_key(content: str, model_digest: str, method: dict, dtype: str,
               plan: str | None = None) -> str:
    material = {"format": FORMAT, "content": content, "model": model_digest,
                "method": method, "dtype": dtype,
                "prompt": [prompt.SYSTEM, prompt.INTRO, prompt.QUESTION], "text": TEXT}
    if plan is not None:  # token contexts (bench) keep their fixed-size blocks and keys
        material["plan"] = plan
    material = json.dumps(material, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _reusable(folder: Path, plan: str | None = None) -> bool:
    """A committed context that is still what its key (the folder's name) says, so a cache
    hit may reuse it: its manifest names the same content, model, method and dtype (an
    edited manifest is rebuilt, not trusted) and every shard matches its checksum (hashes
    remembered by stat, see shards.verify_checksums). Anything else is encoded again."""
    try:
        manifest = read_manifest(folder)
        shards.verify_checksums(manifest, contents=True)
    except StarqaError:
        return False
    return _cache_key(manifest.content_sha256, manifest.model.digest,
                      manifest.method.as_dict(), manifest.dtype, plan) == folder.name


def _save_tokens(folder: Path, ids: list[int], node_rank: int) -> Path:
    """The context's token ids for this machine's workers (they never tokenise)."""
    import torch
    from safetensors.torch import save_file

    path = folder / f"tokens-node{node_rank}.safetensors"
    save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(path))
    return path


def _default_name(sources: tuple[str, ...]) -> str:
    return Path(sources[0]).resolve().name or "context"


def _config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)
