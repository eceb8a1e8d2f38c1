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
from dataclasses import dataclass, field, replace
from pathlib import Path

from starqa.cache import blockstore, shards, store
from starqa.topk import indexes
from starqa import methods
from starqa.reingest import packorder, reuse
from starqa.core import paths, tensorfile
from starqa.corpus import prompt
from starqa import corpus as corpus_mod
from starqa.core.errors import StarqaError
from starqa.reingest.incremental import adopt as adopt_blocks
from starqa.reingest.incremental import keep as keep_blocks
from starqa.reingest.incremental import rope
from starqa.runtime.launch import default_workers, launch_of, run_workers
from starqa.cache.manifest import (FORMAT, block_file, IngestRun, Manifest, ModelIdentity,
    Placement, Skipped, SourceFile, read_manifest)
from starqa.methods import method_config, plan_blocks, plan_file_blocks
from starqa.core.progress import UI
from starqa.reingest.reuse import Reuse

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


def ingest(opts: IngestOptions, ui: UI = UI()) -> IngestResult:
    from starqa.runtime import dist
    from starqa import models

    started = time.perf_counter()
    if opts.max_file_bytes < 1:
        raise StarqaError(f"--max-file-size {opts.max_file_bytes} skips every file as too large.",
                          hint=f"leave it out for the default, or pass --max-file-size "
                               f"{IngestOptions.max_file_bytes} (bytes; any number above 0)")
    with ui.status("Reading files"):
        corpus = corpus_mod.collect(opts.paths, max_file_bytes=opts.max_file_bytes,
                                    include=opts.include, exclude=opts.exclude)
    with ui.status("Resolving model"):
        model_path = models.resolve_model(opts.model, ui)
        tokenizer = models.load_tokenizer(model_path)
        window = models.context_window(_config(model_path))
        model = ModelIdentity.of(model_path, opts.model or models.DEFAULT_MODEL, window,
                                 models.fingerprint(model_path))
    dtype = str(models.parse_dtype(opts.dtype, dist.resolve_device(opts.device))
                ).removeprefix("torch.")
    root = paths.contexts_dir()
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
        ids = tokens.ids
    corpus = replace(corpus, files=files)
    n = len(ids)
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
    content = corpus_mod.content_hash(corpus.files)
    key = _cache_key(content, model.digest, method.as_dict(), dtype, PLAN)
    final = root / key
    # One ingest of a key at a time, from the cache check through the commit: a second
    # ingest of the same input waits, then is a cache hit (issue #11, item 9). Only node 0
    # locks: the other machines' launchers must join its torchrun group, never wait on it.
    lock = (store.context_lock(root, key, on_wait=lambda: ui.waiting(
                "Waiting for another ingest of the same context")) if opts.node_rank == 0
            else contextlib.nullcontext())
    with lock:
        hit = not opts.force and _reusable(final, PLAN) and _placed_alike(final, opts)
        if hit and opts.nnodes == 1:
            manifest = read_manifest(final)
            if opts.name and opts.name != manifest.name:  # --name applies to a hit too
                manifest = store.rename_context(manifest, opts.name)
            store.touch(manifest)
        else:
            blocks = plan_file_blocks(n, method.block_size, [
                (f.path, a, b) for f, (a, b) in zip(corpus.files, tokens.file_tokens)])
            # Across machines every machine starts the group, even with the context here:
            # it is a cache hit only where every machine holds it (the workers agree).
            return _encode(opts, root, key, tokens, corpus, spans, model, dtype, method,
                           content, started, ui, blocks=blocks, incremental=opts.nnodes == 1,
                           query_template=prompt.query_template(tokenizer), lock_held=True,
                           hit_here=hit)
    if opts.index:  # a hit without the indexes asked for: built now (they take the lock)
        manifest = indexes.ensure(manifest, opts.index, on_build=ui.waiting)
    return IngestResult(manifest, corpus, True, time.perf_counter() - started)


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


def ingest_tokens(ids: list[int], root: Path, *, model: str | None = None,
                  method: str = methods.DEFAULT,
                  workers: int | None = None, dtype: str | None = None, name: str = "tokens",
                  measure: bool = False, allow_over_window: bool = False,
                  device: str = "auto", ui: UI = UI()) -> IngestResult:
    """Phase 1 over token ids given directly, through the same torchrun workers as `ingest`:
    the way in for `starqa bench`'s synthetic contexts. One stand-in file named `name` holds
    every token (so answers are attributed, as for ingested files); always encodes (no cache
    lookup); the context is committed under `root`.

    measure: the workers report time, FLOPs and bytes communicated (IngestResult.measures).
    allow_over_window: a context longer than the model's window is encoded anyway. For
    timing only, where answers do not matter; `ingest` never passes it (users have
    --beyond-window, which says what it does).
    """
    from starqa.runtime import dist
    from starqa import models

    started = time.perf_counter()
    spec = model or os.environ.get("STARQA_MODEL") or models.DEFAULT_MODEL  # as resolved
    model_path = models.resolve_model(spec, ui)
    window = models.context_window(_config(model_path))
    identity = ModelIdentity.of(model_path, spec, window,
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
    # One stand-in file over every token, a line per BENCH_LINE tokens, so that answers
    # are attributed (and `bench` measures what that costs) as for ingested files.
    n = len(ids)
    lines = list(range(0, n, BENCH_LINE))
    whole = corpus_mod.SourceFile(name, "", 0)
    return _encode(opts, root, key, prompt.ContextTokens(list(ids), [(0, n)], [lines]),
                   corpus_mod.Corpus((), (whole,), ()),
                   [corpus_mod.FileSpan(name, 0, 0, 0, len(lines))], identity, dtype, config,
                   content, started, ui, measure)


BENCH_LINE = 64  # tokens per line of `ingest_tokens`' stand-in file


def _encode(opts: IngestOptions, root: Path, key: str, tokens, corpus, spans,
            model: ModelIdentity, dtype, method, content, started, ui: UI, measure: bool = False,
            *, blocks=None, incremental: bool = False, query_template: dict | None = None,
            lock_held: bool = False, hit_here: bool = False) -> IngestResult:
    """Run Phase 1 and commit the shards under `root / key` (under the context's lock;
    `lock_held`: the caller holds it already). `incremental`: blocks the content-addressed
    store holds are linked in (or re-rotated), and only the others are encoded, in this
    process or on a torchrun group (`_in_process`); every block then joins the store.
    Across machines (`opts.nnodes` > 1) each machine stages and commits its own blocks
    (starqa.cache.hosts); `hit_here`: this machine holds the context already."""
    ids = tokens.ids
    n = len(ids)
    final = root / key
    blocks = blocks or plan_blocks(n, method.block_size)
    encoder = methods.get(method.name)
    # computed once here, for every worker and the manifest (pulsar: the summaries)
    prepared = encoder.prepare(ids, method, blocks)
    bstore = blockstore.store_dir(root)
    freqs = rope(model.path) if incremental and encoder.rotatable else None
    plan = reuse.plan(method, ids, blocks, prepared, model.digest, dtype, bstore,
                      force=opts.force or not incremental, rotate=freqs is not None)
    previous = _previous(root, opts.paths, method.name, model.digest, dtype) \
        if incremental else None
    todo = list(plan.todo)
    local = incremental and _in_process(opts, encoder, plan, measure)
    # a group never has more workers than blocks to spread (apb runs every block)
    spread = max(len(encoder.share(todo, len(blocks), 1, 0)), 1)
    workers = 1 if local or not todo else _ingest_workers(opts, method.name, spread)
    if not local and todo:
        workers = check_workers(opts, workers, model.path, dtype)
    # Each machine's workers write into its own staging folder, and each machine commits
    # the blocks it keeps (on a shared cache, node 0 all of them: starqa.cache.hosts).
    multinode = opts.nnodes > 1
    if multinode and opts.index:
        raise StarqaError("--index is not built across machines yet.",
                          hint="ingest across machines without --index; top-k attention "
                               "needs every block on one machine (ingest there with --index)")
    staging = store.staging_dir(root, key, node=opts.node_rank if multinode else None)
    placed: dict = {}
    try:
        keep_blocks(plan, bstore, staging, blocks, freqs, method.name)
        todo_tokens = sum(blocks[i][1] - blocks[i][0] for i in todo)
        index_job = ({"kind": opts.index, "folder": indexes.new_folder(opts.index)}
                     if opts.index else None)
        index_seconds: list[float] = []
        encode_started: list[float] = []
        peaks: dict[int, int] = {}
        measures: dict[int, dict] = {}
        if not todo:
            pass
        elif local:
            from starqa.workers.encoding import encode_in_process

            ui.waiting("Loading the model")
            encode_in_process(model.path, dtype, opts.device, ids, method, blocks, todo, staging,
                              prepared, on_ready=lambda: (encode_started.append(
                                  time.perf_counter()), ui.start_encoding(todo_tokens, 1)),
                              on_block=lambda index, tokens: ui.advance(tokens),
                              index=index_job, on_index=index_seconds.append)
        else:
            from starqa.runtime import dist
            from starqa import models

            tokens_file = _save_tokens(staging, ids, opts.node_rank)
            job = {"phase": "ingest", "model_path": model.path, "dtype": dtype,
                   "compute_dtype": models.phase1_dtype(
                       dtype, dist.resolve_device(opts.device), model.path, workers),
                   "method": method.as_dict(), "blocks": blocks, "todo": todo,
                   "staging": str(staging), "tokens_file": str(tokens_file),
                   "measure": measure, "prepared": prepared, "index": index_job,
                   "across": multinode, "hit": hit_here}

            def on_event(event: dict) -> None:
                if event["event"] == "ready" and not encode_started:
                    encode_started.append(time.perf_counter())
                    ui.start_encoding(todo_tokens, workers * opts.nnodes)
                elif event["event"] == "block":
                    ui.advance(event["tokens"])
                elif event["event"] == "peak":
                    peaks[event["rank"]] = event["bytes"]
                elif event["event"] == "measure":
                    measures[event["rank"]] = event
                elif event["event"] == "index":
                    index_seconds.append(event["seconds"])
                elif event["event"] in ("placement", "hit"):
                    placed.update(event)

            ui.waiting(f"Starting {workers} worker{'s' * (workers > 1)} (loading the model)")
            run_workers(job, launch_of(opts, workers), on_event)
            tokens_file.unlink(missing_ok=True)  # node 0 may have committed it away already
        encode_seconds = time.perf_counter() - (encode_started[0] if encode_started else started)
        per_rank = {"peak_bytes": [peaks[r] for r in sorted(peaks)],
                    "measures": [measures[r] for r in sorted(measures)]}
        for leftover in staging.glob("tokens-node*.safetensors"):
            leftover.unlink()
        if placed.get("event") == "hit":  # every machine holds it: nothing was encoded
            shutil.rmtree(staging, ignore_errors=True)
            manifest = read_manifest(final)
            store.touch(manifest)
            return IngestResult(manifest, corpus, True, time.perf_counter() - started)
        if multinode and placed.get("shared") and opts.node_rank != 0:
            shutil.rmtree(staging, ignore_errors=True)  # node 0 commits on the shared cache
            return IngestResult(None, corpus, False, time.perf_counter() - started, workers,
                                encode_seconds, **per_rank)
        if multinode:  # every block's checksum, gathered from the machines that keep them
            hashed = shards.listed_blocks(staging, blocks, placed["sums"], placed["held"])
        else:
            hashed = (adopt_blocks(plan, bstore, staging, blocks) if incremental  # into the store
                      else shards.hash_blocks(staging, blocks, known=plan.known))
        sources = tuple(str(Path(p).resolve()) for p in opts.paths)
        built = ()
        if index_job is not None:  # the blocks linked in, not encoded, get theirs here
            encoded = set(todo)
            for i in (i for i in range(len(blocks)) if i not in encoded):
                index_seconds.append(indexes.write_block(
                    staging / index_job["folder"], opts.index, i,
                    tensorfile.read_tensor(staging / block_file(i), "k")))
            built = (indexes.hash_set(staging, index_job["folder"], opts.index, len(blocks),
                                      sum(index_seconds)),)
        store.commit(staging, final, Manifest(
            key=key, name=opts.name or _default_name(opts.paths), created=time.time(),
            sources=sources, command=opts.command or "starqa ingest " + shlex.join(sources),
            model=model, reserve=opts.reserve, dtype=dtype, method=method,
            content_sha256=content, n_tokens=n,
            query_position=query_position(ids, method, blocks, prepared),
            query_template=query_template, blocks=hashed,
            files=tuple(SourceFile(path=sp.path, token_start=a, token_end=b, lines=sp.lines,
                                   bytes=f.size, line_tokens=tuple(lines),
                                   sha256=reuse.file_sha(f.text))
                        for sp, (a, b), lines, f in zip(spans, tokens.file_tokens,
                                                        tokens.line_tokens, corpus.files)),
            skipped=tuple(Skipped(path=s.path, reason=s.reason) for s in corpus.skipped),
            ingest=IngestRun.timed(workers * opts.nnodes, encode_seconds, n), indexes=built,
            placement=_placement(placed, opts)),
            replace_existing=True, held=lock_held and opts.node_rank == 0)
    except BaseException:  # every machine drops its own staging: no half-written context
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = read_manifest(final)
    store.touch(manifest)
    report = None
    if incremental and (previous is not None or plan.reused or plan.rotated):
        changes = None if previous is None else reuse.changes(
            {f.path: f.sha256 for f in previous.files},
            {f.path: f.sha256 for f in manifest.files})
        report = Reuse(len(blocks), len(plan.reused), len(plan.rotated), len(todo), changes,
                       _why(opts, encoder, method, plan, changes, previous, manifest), local)
    return IngestResult(manifest, corpus, False, time.perf_counter() - started,
                        workers * opts.nnodes, encode_seconds, **per_rank, reuse=report)


def _placement(placed: dict, opts: IngestOptions) -> Placement | None:
    """The manifest's record of which machine keeps which block; None when every block is
    in this folder (one machine, or a cache all machines share)."""
    if opts.nnodes == 1 or placed.get("shared"):
        return None
    return Placement(nodes=opts.nnodes, node=placed["node"], held=tuple(placed["held"]),
                     homes=tuple(placed["homes"]), hosts=tuple(placed["hosts"]))


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
