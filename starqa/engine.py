"""Orchestration of `ingest`, `ask` and `serve`: corpus → prompt → tokens → workers → shards.

Runs in the launcher process (never in a worker). It tokenises (workers get token ids),
checks limits, decides the cache key, starts the torchrun group, and commits the result.
Progress goes through a `UI` object so the CLI can draw it and tests can ignore it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starqa import corpus as corpus_mod
from starqa import methods, paths, prompt, shards, store
from starqa.errors import StarqaError
from starqa.launch import Launch, default_workers, run_workers
from starqa.manifest import (FORMAT, IngestRun, Manifest, ModelIdentity, Skipped, SourceFile,
                             read_manifest, write_json_atomic)
from starqa.methods import method_config, plan_blocks


class UI:
    """Progress callbacks; the default does nothing."""

    def status(self, message: str):
        """A context manager shown while a short step runs."""
        return contextlib.nullcontext()

    def waiting(self, message: str) -> None:
        """Workers are starting; shown until encoding starts or the first token arrives."""

    def start_encoding(self, total_tokens: int, workers: int) -> None: ...

    def advance(self, tokens: int) -> None: ...

    def token(self, text: str) -> None: ...


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


@dataclass
class IngestResult:
    manifest: Manifest | None  # None on machines other than node 0, which commits
    corpus: corpus_mod.Corpus
    cache_hit: bool
    seconds: float
    workers: int = 0
    encode_seconds: float = 0.0
    peak_bytes: list[int] = field(default_factory=list)  # per worker
    measures: list[dict] = field(default_factory=list)  # per worker, when measured (bench)


def ingest(opts: IngestOptions, ui: UI = UI()) -> IngestResult:
    from starqa import dist, models

    started = time.perf_counter()
    with ui.status("Reading files"):
        corpus = corpus_mod.collect(opts.paths, max_file_bytes=opts.max_file_bytes,
                                    include=opts.include, exclude=opts.exclude)
    with ui.status("Resolving model"):
        model_path = models.resolve_model(opts.model)
        tokenizer = models.load_tokenizer(model_path)
        window = models.context_window(_config(model_path))
        model = ModelIdentity.of(model_path, opts.model or models.DEFAULT_MODEL, window,
                                 models.fingerprint(model_path))
    with ui.status("Tokenising"):
        packed, spans = corpus_mod.pack(corpus.files)
        tokens = prompt.tokenize_context(tokenizer, packed, spans)
        ids = tokens.ids
    n = len(ids)
    opts = replace(opts, reserve=default_reserve(window) if opts.reserve is None else opts.reserve)
    if opts.reserve < 0:
        raise StarqaError(f"--reserve must be 0 or more tokens (got {opts.reserve}).")
    if n + opts.reserve > window and not opts.beyond_window:
        raise _no_room(n, opts.reserve, window)
    method = method_config(opts.method, n, opts.block_size, opts.anchor_size,
                           opts.method_params)
    if method.params.get("question"):  # apb: the question joins every block's anchor
        question_ids = tokenizer.encode(method.params["question"], add_special_tokens=False)
        method = replace(method, params={**method.params, "question_ids": question_ids})
    dtype = str(models.parse_dtype(opts.dtype, dist.resolve_device(opts.device))
                ).removeprefix("torch.")
    content = corpus_mod.content_hash(corpus.files)
    key = _cache_key(content, model.digest, method.as_dict(), dtype)
    root = paths.contexts_dir()
    final = root / key
    # One ingest of a key at a time, from the cache check through the commit: a second
    # ingest of the same input waits, then is a cache hit (issue #11, item 9). Only node 0
    # locks: the other machines' launchers must join its torchrun group, never wait on it.
    lock = (store.context_lock(root, key, on_wait=lambda: ui.waiting(
                "Waiting for another ingest of the same context")) if opts.node_rank == 0
            else contextlib.nullcontext())
    with lock:
        if not opts.force and _reusable(final):
            manifest = read_manifest(final)
            if opts.name and opts.name != manifest.name:  # --name applies to a hit too
                manifest = store.rename_context(manifest, opts.name)
            store.touch(manifest)
            return IngestResult(manifest, corpus, True, time.perf_counter() - started)
        return _encode(opts, root, key, tokens, corpus, spans, model, dtype, method, content,
                       started, ui,
                       query_template=prompt.query_template(tokenizer), lock_held=True)


def default_reserve(window: int) -> int:
    """Tokens `ingest` keeps free for a question and its answer: 512 (a question and a short
    answer), but never more than a quarter of a small window."""
    return min(512, window // 4)


def _no_room(n: int, reserve: int, window: int) -> StarqaError:
    """The over-window error of `ingest`: a context that fills the window leaves no room to
    ask (issue #11, item 13), so the numbers include the reserve, and the way out names an
    embedded model whose window would hold it."""
    from starqa.models import EMBEDDED

    need = f"{n:,} tokens" + (f" + {reserve:,} reserved for a question and an answer = "
                              f"{n + reserve:,} tokens" if reserve else "")
    fixes = ["ingest fewer files (--exclude, a sub-folder)"]
    if reserve and n < window:
        fixes.append(f"reserve less (--reserve {window - n:,} or lower; now {reserve:,})")
    fixes += [f"use a model with a longer window (--model {m.name}: {m.window:,} tokens)"
              for m in EMBEDDED if m.window >= n + reserve]
    fixes.append("pass --beyond-window to go on anyway")
    return StarqaError(f"The context is {need} > {window:,} the model was trained on.",
                       hint=", ".join(fixes[:-1]) + ", or " + fixes[-1])


def ingest_tokens(ids: list[int], root: Path, *, model: str | None = None,
                  method: str = methods.DEFAULT,
                  workers: int | None = None, dtype: str | None = None, name: str = "tokens",
                  measure: bool = False, allow_over_window: bool = False,
                  device: str = "auto", ui: UI = UI()) -> IngestResult:
    """Phase 1 over token ids given directly, through the same torchrun workers as `ingest`:
    the way in for `starqa bench`'s synthetic contexts. No files, so answers name no sources;
    always encodes (no cache lookup); the context is committed under `root`.

    measure: the workers report time, FLOPs and bytes communicated (IngestResult.measures).
    allow_over_window: a context longer than the model's window is encoded anyway. For
    timing only, where answers do not matter; `ingest` never passes it (users have
    --beyond-window, which says what it does).
    """
    from starqa import dist, models

    started = time.perf_counter()
    model_path = models.resolve_model(model)
    window = models.context_window(_config(model_path))
    identity = ModelIdentity.of(model_path, model or models.DEFAULT_MODEL, window,
                                models.fingerprint(model_path))
    if len(ids) > window and not allow_over_window:
        raise StarqaError(f"The context is {len(ids):,} tokens > {window:,} the model was "
                          "trained on.", hint="use fewer tokens or a model with a longer window")
    config = method_config(method, len(ids))
    dtype = str(models.parse_dtype(dtype, dist.resolve_device(device))).removeprefix("torch.")
    content = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    key = _cache_key(content, identity.digest, config.as_dict(), dtype)
    opts = IngestOptions(paths=(), model=model, method=method, workers=workers, name=name,
                         dtype=dtype, device=device, command=f"starqa bench ({name})")
    return _encode(opts, root, key, prompt.ContextTokens(list(ids), [], []),
                   corpus_mod.Corpus((), (), ()), [], identity, dtype, config, content, started,
                   ui, measure)


def _encode(opts: IngestOptions, root: Path, key: str, tokens, corpus, spans,
            model: ModelIdentity, dtype, method, content, started, ui: UI, measure: bool = False,
            *, query_template: dict | None = None, lock_held: bool = False) -> IngestResult:
    """Run Phase 1 on a torchrun group and commit the shards under `root / key` (under the
    context's lock; `lock_held`: the caller holds it already)."""
    ids = tokens.ids
    n = len(ids)
    final = root / key
    blocks = plan_blocks(n, method.block_size)
    workers = _ingest_workers(opts, method.name, len(blocks))
    # computed once here, for every worker and the manifest (pulsar: the summaries)
    prepared = methods.get(method.name).prepare(ids, method, blocks)
    # Across machines every node's workers write into one staging folder on the shared
    # cache, and node 0 commits it; on one machine the folder is this process's own.
    multinode = opts.nnodes > 1
    staging = store.staging_dir(root, key, shared=multinode)
    try:
        tokens_file = _save_tokens(staging, ids, opts.node_rank)
        job = {"phase": "ingest", "model_path": model.path, "dtype": dtype,
               "method": method.as_dict(), "blocks": blocks, "staging": str(staging),
               "tokens_file": str(tokens_file), "measure": measure, "prepared": prepared}
        encode_started: list[float] = []
        peaks: dict[int, int] = {}
        measures: dict[int, dict] = {}

        def on_event(event: dict) -> None:
            if event["event"] == "ready" and not encode_started:
                encode_started.append(time.perf_counter())
                ui.start_encoding(n, workers * opts.nnodes)
            elif event["event"] == "block":
                ui.advance(event["tokens"])
            elif event["event"] == "peak":
                peaks[event["rank"]] = event["bytes"]
            elif event["event"] == "measure":
                measures[event["rank"]] = event

        ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading the model)")
        run_workers(job, _launch(opts, workers), on_event)
        encode_seconds = time.perf_counter() - (encode_started[0] if encode_started else started)
        tokens_file.unlink(missing_ok=True)  # node 0 may have committed it away already
        per_rank = {"peak_bytes": [peaks[r] for r in sorted(peaks)],
                    "measures": [measures[r] for r in sorted(measures)]}
        if opts.node_rank != 0:  # node 0 commits what every node wrote
            return IngestResult(None, corpus, False, time.perf_counter() - started, workers,
                                encode_seconds, **per_rank)
        for leftover in staging.glob("tokens-node*.safetensors"):
            leftover.unlink()
        sources = tuple(str(Path(p).resolve()) for p in opts.paths)
        store.commit(staging, final, Manifest(
            key=key, name=opts.name or _default_name(opts.paths), created=time.time(),
            sources=sources, command=opts.command or "starqa ingest " + shlex.join(sources),
            model=model, reserve=opts.reserve, dtype=dtype, method=method,
            content_sha256=content, n_tokens=n,
            query_position=query_position(ids, method, blocks, prepared),
            query_template=query_template, blocks=shards.hash_blocks(staging, blocks),
            files=tuple(SourceFile(path=sp.path, token_start=a, token_end=b, lines=sp.lines,
                                   bytes=f.size, line_tokens=tuple(lines))
                        for sp, (a, b), lines, f in zip(spans, tokens.file_tokens,
                                                        tokens.line_tokens, corpus.files)),
            skipped=tuple(Skipped(path=s.path, reason=s.reason) for s in corpus.skipped),
            ingest=IngestRun.timed(workers * opts.nnodes, encode_seconds, n)),
            replace_existing=True, held=lock_held)  # ingest found it not reusable, or forced
    except BaseException:
        if opts.node_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = read_manifest(final)
    store.touch(manifest)
    return IngestResult(manifest, corpus, False, time.perf_counter() - started,
                        workers * opts.nnodes, encode_seconds, **per_rank)


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


def ingest_worker_count(method: str, n_blocks: int, workers: int) -> int:
    """The workers Phase 1 of `method` runs on, on one machine, when `workers` are asked for."""
    return _ingest_workers(IngestOptions(paths=(), workers=workers), method, n_blocks)


DEFAULT_KEEPALIVE = 300.0  # seconds a warm group waits for the next question (as ollama)


@dataclass(frozen=True)
class AskOptions:
    question: str
    context: str | None = None
    model: str | None = None
    workers: int | None = None
    max_new_tokens: int = 256
    beyond_window: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    device: str = "auto"
    warm: bool = True  # use a running `starqa serve` group for the context when there is one
    weights: str | None = None  # Phase 2 weight format (models.WEIGHT_FORMATS); None: default
    keepalive: float = 0.0  # a cold ask leaves a warm group this long; 0: none (CLI: 300 s)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    context: Manifest
    query_tokens: int
    workers: int
    seconds: float
    first_token_seconds: float | None
    decode_seconds: float  # first token → last token
    prefill_seconds: float | None  # the workers' question prefill, up to the first token
    sources: list[dict] = field(default_factory=list)  # top files and lines attended to
    peak_bytes: list[int] = field(default_factory=list)  # per worker
    measures: list[dict] = field(default_factory=list)  # per worker, when measured (bench)
    query_host: bool = True  # False on machines that do not hold the last block
    warm: bool = False  # answered by a running worker group
    weights: str | None = None  # Phase 2 weight format, where known


def ask(opts: AskOptions, ui: UI = UI()) -> Answer:
    from starqa import models

    started = time.perf_counter()
    if not opts.question.strip():
        raise StarqaError("The question is empty.")
    if opts.max_new_tokens < 1:
        raise StarqaError(f"--max-new-tokens must be at least 1 (got {opts.max_new_tokens}).")
    manifest = store.find_context(paths.contexts_dir(), opts.context)
    if opts.warm and opts.nnodes == 1 and opts.model is None:
        from starqa import client

        group = client.find(manifest.key)
        if group is not None and opts.weights in (None, group.get("weights")):
            return _ask_warm(opts, manifest, group, ui, started)
    with ui.status("Checking model and shards"):
        model_path = _checked_model(manifest, opts.model)
        tokenizer, query_ids = _question(manifest, model_path, opts.question)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if n + m + opts.max_new_tokens > window and not opts.beyond_window:
        raise prompt.over_window(n, m, opts.max_new_tokens, window)
    workers, why = _phase2_workers(manifest, model_path, opts.workers, opts.nnodes, opts.device)
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    stops = models.stop_ids(tokenizer, model_path)
    if workers == 1 and opts.nnodes == 1:
        answer = _answer_here(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens,
                              stops, weights, opts.device, why, ui, started)
    else:
        answer = _answer(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens,
                         stops, _launch(opts, workers), ui, started, weights=weights)
    if opts.keepalive > 0 and opts.warm and opts.nnodes == 1:
        from starqa import client

        # The next question finds this context warm: a group starts in the background
        # (a second one for the same context refuses to start, see `serve`).
        client.spawn(manifest.key, opts.workers, opts.keepalive, opts.weights)
    return answer


def _question(manifest: Manifest, model_path: Path, question: str) -> tuple[Any, list[int]]:
    """(tokenizer, the question's query ids). With the manifest's query template the plain
    `tokenizers` library does it (no transformers import on a cold ask's way to its first
    token); without (older caches, templates that reshape the question), transformers."""
    from starqa import models

    template = manifest.query_template
    if isinstance(template, dict) and all(isinstance(template.get(k), str)
                                          for k in ("prefix", "suffix")):
        if (fast := models.load_fast_tokenizer(model_path)) is not None:
            return fast, fast.encode(template["prefix"] + question.strip() + template["suffix"])
    tokenizer = models.load_tokenizer(model_path)
    return tokenizer, prompt.tokenize_query(tokenizer, question)


def ask_tokens(manifest: Manifest, query_ids: list[int], *, workers: int | None = None,
               max_new_tokens: int = 16, stop: bool = True, measure: bool = False,
               allow_over_window: bool = False, device: str = "auto", weights: str | None = None,
               ui: UI = UI()) -> Answer:
    """Phase 2 for query token ids on a fresh torchrun group (never a warm one): the way in
    for `starqa bench`. stop=False generates exactly `max_new_tokens` (an end-of-turn token
    does not end it); measure: the workers report time and bytes communicated
    (Answer.measures); allow_over_window as in `ingest_tokens`."""
    from starqa import models

    started = time.perf_counter()
    model_path = _checked_model(manifest, None)
    tokenizer = models.load_tokenizer(model_path)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if n + m + max_new_tokens > window and not allow_over_window:
        raise StarqaError(f"Context {n:,} + query {m:,} + up to {max_new_tokens:,} new tokens "
                          f"= {n + m + max_new_tokens:,} tokens > {window:,} the model was "
                          "trained on.")
    workers = _phase2_workers(manifest, model_path, workers, 1, device)[0]
    stops = models.stop_ids(tokenizer, model_path) if stop else set()
    return _answer(manifest, model_path, tokenizer, query_ids, max_new_tokens, stops,
                   Launch(workers, device=device), ui, started, measure,
                   models.phase2_weights(weights, manifest.model.spec, device))


def _answer(manifest: Manifest, model_path: Path, tokenizer, query_ids: list[int],
            max_new_tokens: int, stops: set[int], launch: Launch, ui: UI, started: float,
            measure: bool = False, weights: str = "dense") -> Answer:
    """Run Phase 2 on a torchrun group, streaming tokens to `ui`."""
    workers = launch.workers
    job = {"phase": "ask", "model_path": str(model_path), "dtype": manifest.dtype,
           "context_dir": str(manifest.folder), "query_ids": query_ids, "weights": weights,
           "max_new_tokens": max_new_tokens, "stop_ids": sorted(stops), "measure": measure}
    stream = prompt.TextStream(tokenizer)
    timing: dict[str, Any] = {}
    peaks: dict[int, int] = {}
    measures: dict[int, dict] = {}

    def on_event(event: dict) -> None:
        if event["event"] == "token":
            timing.setdefault("first", time.perf_counter())
            if piece := stream.add(event["id"]):
                ui.token(piece)
        elif event["event"] == "done":
            timing["done"] = event
        elif event["event"] == "peak":
            peaks[event["rank"]] = event["bytes"]
        elif event["event"] == "measure":
            measures[event["rank"]] = event

    ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading model and shards)")
    run_workers(job, launch, on_event)
    store.touch(manifest)
    if piece := stream.finish():
        ui.token(piece)
    done = timing.get("done", {})
    first = timing.get("first")
    return Answer(text=stream.text.strip(), token_ids=stream.ids, context=manifest,
                  query_tokens=len(query_ids), workers=workers * launch.nnodes,
                  query_host=launch.node_rank == launch.nnodes - 1,
                  seconds=time.perf_counter() - started,
                  first_token_seconds=(first - started) if first else None,
                  decode_seconds=done.get("decode_s", 0.0), prefill_seconds=done.get("prefill_s"),
                  sources=done.get("sources") or [],
                  peak_bytes=[peaks[r] for r in sorted(peaks)],
                  measures=[measures[r] for r in sorted(measures)], weights=weights)


def _answer_here(manifest: Manifest, model_path: Path, tokenizer, query_ids: list[int],
                 max_new_tokens: int, stops: set[int], weights: str, device: str, why: str,
                 ui: UI, started: float) -> Answer:
    """Phase 2 as a world of one in this process: no torchrun, no second Python start."""
    import resource

    from starqa import dist
    from starqa.answering import Answerer

    ui.waiting(f"Loading model and shards ({why})")
    answerer = Answerer.from_cache(manifest, dist.local_world(device), model_path, weights)
    stream = prompt.TextStream(tokenizer)
    first: list[float] = []

    def on_token(token: int) -> None:
        first or first.append(time.perf_counter())
        if piece := stream.add(token):
            ui.token(piece)

    loaded = time.perf_counter()
    tokens, top = answerer.answer(query_ids, max_new_tokens, stops, on_token)
    end = time.perf_counter()
    store.touch(manifest)
    if piece := stream.finish():
        ui.token(piece)
    return Answer(text=stream.text.strip(), token_ids=tokens, context=manifest,
                  query_tokens=len(query_ids), workers=1, seconds=end - started,
                  first_token_seconds=(first[0] - started) if first else None,
                  decode_seconds=(end - first[0]) if first else 0.0,
                  prefill_seconds=(first[0] if first else end) - loaded, sources=top or [],
                  peak_bytes=[resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                  weights=weights)


def _ask_warm(opts: AskOptions, manifest: Manifest, group: dict, ui: UI, started: float) -> Answer:
    """Ask a running worker group over its socket (no model load, no torch import here)."""
    from starqa.client import Client

    conn = Client(group)
    try:
        first = None
        for event in conn.ask(opts.question, (), opts.max_new_tokens, opts.beyond_window):
            if event["event"] == "token":
                first = first or time.perf_counter()
                ui.token(event["text"])
            elif event["event"] == "done":
                done = event
    except KeyboardInterrupt:  # stop the answer, leave the group warm
        with contextlib.suppress(OSError):
            conn.cancel()
        raise
    finally:
        conn.close()
    return Answer(text=done["text"], token_ids=done["token_ids"], context=manifest,
                  query_tokens=done["question_tokens"], workers=group["workers"],
                  seconds=time.perf_counter() - started,
                  first_token_seconds=(first - started) if first else None,
                  decode_seconds=done["decode_s"], prefill_seconds=done["first_token_s"],
                  sources=done["sources"] or [], warm=True, weights=group.get("weights"))


@dataclass(frozen=True)
class ServeOptions:
    context: str | None = None
    model: str | None = None
    workers: int | None = None
    keepalive: float = DEFAULT_KEEPALIVE  # idle seconds before the group exits; <= 0: never
    device: str = "auto"
    weights: str | None = None  # Phase 2 weight format; None: the default


def serve(opts: ServeOptions, ui: UI = UI(), on_ready=None) -> None:
    """Run a warm worker group for a context until stopped or idle for `keepalive` (<= 0:
    never). One worker runs in this process; more run on torchrun."""
    from starqa import client, models

    manifest = store.find_context(paths.contexts_dir(), opts.context)
    key = manifest.key
    claim = client.claim(key)  # held while the group lives: one group per context
    if claim is None or client.find(key) is not None:
        raise StarqaError(f"A worker group for {manifest.name} ({key}) is already running "
                          "or starting.", hint=f"starqa stop {manifest.name}")
    with claim:
        with ui.status("Checking model and shards"):
            model_path = _checked_model(manifest, opts.model)
        workers, why = _phase2_workers(manifest, model_path, opts.workers, 1, opts.device)
        run_file = client.run_dir() / f"{key}.json"
        job = {"phase": "serve", "model_path": str(model_path), "dtype": manifest.dtype,
               "context_dir": str(manifest.folder), "keepalive": opts.keepalive,
               "socket": str(client.run_dir() / f"{key}.sock"),
               "weights": models.phase2_weights(opts.weights, manifest.model.spec,
                                                opts.device)}
        ready: set[int] = set()

        def on_event(event: dict) -> None:
            if event["event"] == "ready":
                ready.add(event["rank"])
                if len(ready) == workers:
                    info = {"key": key, "name": manifest.name, "pid": os.getpid(),
                            "workers": workers, "socket": job["socket"],
                            "started": time.time(), "keepalive": opts.keepalive,
                            "tokens": manifest.n_tokens, "weights": job["weights"],
                            "method": manifest.method.name}
                    write_json_atomic(run_file, info)
                    if on_ready:
                        on_ready(info)

        try:
            if workers == 1:
                _serve_here(job, manifest, model_path, opts.device, why, ui,
                            lambda: on_event({"event": "ready", "rank": 0}))
            else:
                ui.waiting(f"Starting {workers} workers (loading model and shards; {why})")
                run_workers(job, Launch(workers, device=opts.device), on_event)
        finally:
            run_file.unlink(missing_ok=True)


def _serve_here(job: dict, manifest: Manifest, model_path: Path, device: str, why: str, ui: UI,
                on_ready) -> None:
    """A warm group of one worker: this process (starqa.server's loop, no torchrun)."""
    from starqa import dist
    from starqa.answering import Answerer
    from starqa.server import serve_group

    ui.waiting(f"Loading model and shards ({why})")
    info = dist.local_world(device)
    answerer = Answerer.from_cache(manifest, info, model_path, job["weights"])
    serve_group(job, info, answerer, manifest, on_ready)


# ---------------------------------------------------------------------------------------


def _checked_model(manifest: Manifest, spec: str | None) -> Path:
    """The manifest's model, verified, with every shard present at its recorded size (the
    workers verify checksums as they load)."""
    model_path = manifest_model(manifest, spec)
    shards.verify_present(manifest)
    return model_path


def _phase2_workers(manifest: Manifest, model_path: Path, requested: int | None, nnodes: int,
                    device: str) -> tuple[int, str]:
    """Workers per machine for Phase 2, and why. Star Attention spreads Phase 2 because one
    host cannot hold every shard; on one machine whose memory holds the model and every
    shard, one worker with all the cores is fastest (W workers would each run the whole
    model for every token). Never more workers in all than the context has blocks."""
    n_blocks = len(manifest.blocks)
    if nnodes > 1:
        workers = requested or default_workers(device)
        if workers * nnodes > n_blocks:
            raise StarqaError(f"{workers * nnodes} workers on {nnodes} machines but the "
                              f"context has only {n_blocks} blocks.",
                              hint="pass a smaller --workers")
        return workers, f"{workers} per machine on {nnodes} machines"
    if requested:
        workers = min(requested, n_blocks)
        return workers, f"--workers {requested}" + (f", {n_blocks} blocks" * (workers < requested))
    need = (store.context_size(manifest) + _weights_bytes(model_path)) * 3 // 2
    free = _free_memory(device)
    if free is None or need <= free:
        return 1, f"1 worker: model and shards fit in {'GPU ' * _is_cuda(device)}memory"
    workers = min(default_workers(device), n_blocks)
    return workers, f"{workers} workers: model and shards need {need / 2**30:.1f} GiB, " \
                    f"{free / 2**30:.1f} GiB free"


def _weights_bytes(model_path: Path) -> int:
    from starqa.models import weight_files

    return sum(f.stat().st_size for f in weight_files(model_path))


def _is_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def _free_memory(device: str) -> int | None:
    """Bytes free on `device` (CPU: MemAvailable), or None when unknown."""
    if _is_cuda(device):
        import torch

        return torch.cuda.mem_get_info(0)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def _cache_key(content: str, model_digest: str, method: dict, dtype: str) -> str:
    material = json.dumps({"format": FORMAT, "content": content, "model": model_digest,
                           "method": method, "dtype": dtype,
                           "prompt": [prompt.SYSTEM, prompt.INTRO, prompt.QUESTION]},
                          sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _reusable(folder: Path) -> bool:
    """A committed context that is still what its key (the folder's name) says, so a cache
    hit may reuse it: its manifest names the same content, model, method and dtype (an
    edited manifest is rebuilt, not trusted) and every shard matches its checksum (hashes
    remembered by stat, see shards.verify_checksums). Anything else is encoded again."""
    try:
        manifest = read_manifest(folder)
        shards.verify_checksums(manifest)
    except StarqaError:
        return False
    return _cache_key(manifest.content_sha256, manifest.model.digest,
                      manifest.method.as_dict(), manifest.dtype) == folder.name


def _save_tokens(folder: Path, ids: list[int], node_rank: int) -> Path:
    """The context's token ids for this machine's workers (they never tokenise)."""
    import torch
    from safetensors.torch import save_file

    path = folder / f"tokens-node{node_rank}.safetensors"
    save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(path))
    return path


def manifest_model(manifest: Manifest, spec: str | None) -> Path:
    """The model the context was made with; a different one is an error, never a silent mix."""
    from starqa import models

    recorded = manifest.model
    path = Path(recorded.path)
    asked, made = models.embedded_model(spec or ""), models.embedded_model(recorded.spec)
    if asked and made and asked.name != made.name:  # known before any download or conversion
        raise StarqaError(
            f"Context {manifest.name!r} was ingested with {made.name}; --model asks for "
            f"{asked.name}. A context is answered by the model that encoded it.",
            hint=f"ask with --model {made.name}, or re-ingest with the other model: "
                 f"{manifest.command} --model {asked.name}")
    if spec is not None:
        path = models.resolve_model(spec)
    elif not (path / "config.json").exists():
        path = models.resolve_model(recorded.spec)  # e.g. the embedded model was deleted
    actual = models.fingerprint(path)
    if actual["digest"] != recorded.digest:
        raise StarqaError(
            f"Model {actual['name']} ({actual['digest'][:12]}) does not match the model context "
            f"{manifest.name!r} was ingested with: {recorded.name} ({recorded.digest[:12]}).",
            hint=f"ask with --model {recorded.spec}, or re-ingest: {manifest.command}")
    return path


def _launch(opts, workers: int) -> Launch:
    return Launch(workers, opts.nnodes, opts.node_rank, opts.rdzv_endpoint, opts.device)


def _default_name(sources: tuple[str, ...]) -> str:
    return Path(sources[0]).resolve().name or "context"
