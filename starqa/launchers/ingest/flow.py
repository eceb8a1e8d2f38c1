"""Phase 1's launcher, `starqa ingest`: folder → corpus → packed prompt → token ids → checks →
cache key → a cache hit, or Phase 1's steps (`steps.run_phase1`: block plan → torchrun
workers → shards → manifest, committed whole or not at all) → Phase 2's weights prepared.

Runs in the launcher process, never in a worker: it tokenises (workers get token ids),
checks the window, decides the cache key, starts the group and commits the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from starqa import corpus as corpus_mod
from starqa import methods
from starqa.cache import shards, store
from starqa.cache.manifest import (FORMAT, KV_KINDS, ModelIdentity, kv_bytes_per_token, kv_tag,
    read_manifest)
from starqa.core import paths
from starqa.core.defaults import default_reserve
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.launchers.ingest.options import (IngestOptions, IngestResult, Mode, Prepared,
    TokenIngestOptions)
from starqa.launchers.ingest.planner import plan as plan_ingest
from starqa.launchers.ingest.steps import run_phase1
from starqa.methods import MethodConfig, method_config, plan_file_blocks
from starqa.reingest import packorder, reuse
from starqa.topk import indexes

ENCODE_IN = ("auto", "process", "group")
PLAN = "files-1"  # the block plan of `ingest` (methods.plan_file_blocks), in its cache key
# How documents become ids, in every cache key: "data-1" tokenises them as data (no control
# tokens, prompt.Encoder) and escapes their boundaries (corpus.pack).
TEXT = "data-1"


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
        model, tokenizer, per_token = _model(opts.model, ui)
    dtype = _cache_dtype(opts.dtype, opts.device)
    root = paths.contexts_dir()
    corpus, tokens, spans = _tokenised(opts, root, corpus, tokenizer, ui)
    opts = _planned(_checked(opts, len(tokens.ids), model.window), len(tokens.ids),
                    model.window, lambda kv: per_token(dtype, kv), ui)
    method = _method(opts, root, model, dtype, tokens.ids, tokenizer)
    content = corpus_mod.content_hash(corpus.files)
    key = _cache_key(content, model.digest, method.as_dict(), kv_tag(dtype, _kv(opts)), PLAN)
    source = Prepared(key, tokens, corpus, spans, model, dtype, method, content, kv=_kv(opts))
    result = _cached_or_encoded(opts, root, source, tokenizer, ui, started)
    return _with_prepared_weights(result, opts, source, ui, started)


def _with_prepared_weights(result: IngestResult, opts: IngestOptions, source: Prepared, ui: UI,
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

    from starqa.models.decoder_io import prepare_weights

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


def _model(spec: str | None, ui: UI
           ) -> tuple[ModelIdentity, Any, Callable[[str, str], int | None]]:
    """The model `spec` names (None: the default), resolved; its tokenizer; and the bytes of
    KV a token takes in a cache of a dtype and KV precision (None where the config does not
    say)."""
    from starqa import models

    model_path = models.resolve_model(spec, ui)
    tokenizer = models.load_tokenizer(model_path)
    config = _config(model_path)
    window = models.context_window(config)
    return (ModelIdentity.of(model_path, models.recorded_spec(spec or models.DEFAULT_MODEL),
                             window, models.fingerprint(model_path)), tokenizer,
            lambda dtype, kv: _kv_per_token(config, dtype, kv))


def _kv_per_token(config, dtype: str, kv: str) -> int | None:
    """`kv_bytes_per_token` for the model's config (layers, KV heads, head size)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return kv_bytes_per_token(layers, kv_heads, head_dim, kv,
                              {"float32": 4, "float64": 8}.get(dtype, 2))


def _planned(opts: IngestOptions, n: int, window: int, per_token: Callable[[str], int | None],
             ui: UI) -> IngestOptions:
    """`opts` as the planner fits them to the window and the memory (`planner.plan`), its
    line said."""
    from starqa.models.devices import available_memory, total_memory

    choice = plan_ingest(opts, n, window, per_token, total_memory(), available_memory())
    if choice.line:
        ui.note(choice.line)
    return choice.opts


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
    layout = None if opts.nnodes > 1 else store.latest_of(root, opts.paths)
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
    """`opts` with its reserve resolved, once the index asked for and the reserve are
    checked against the model's `window` (the context's `n` tokens: `planner.plan`)."""
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


def _cached_or_encoded(opts: IngestOptions, root: Path, source: Prepared, tokenizer, ui: UI,
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
            return run_phase1(opts, root, source, started, ui,
                           Mode(incremental=opts.nnodes == 1, lock_held=True, hit_here=hit))
        manifest = read_manifest(final)
        if opts.name and opts.name != manifest.name:  # --name applies to a hit too
            manifest = store.rename_context(manifest, opts.name)
        store.touch(manifest)
    if opts.index:  # a hit without the indexes asked for: built now (they take the lock)
        manifest = indexes.ensure(manifest, opts.index, on_build=ui.waiting)
    return IngestResult(manifest, source.corpus, True, time.perf_counter() - started)


def ingest_tokens(ids: list[int], root: Path, opts: TokenIngestOptions = TokenIngestOptions(),
                  ui: UI = UI()) -> IngestResult:
    """Phase 1 over token ids given directly, through the same torchrun workers as `ingest`:
    the way in for `starqa bench`'s synthetic contexts. One stand-in file named `opts.name`
    holds every token (so answers are attributed, as for ingested files); always encodes
    (no cache lookup); the context is committed under `root`."""
    from starqa import models
    from starqa.runtime.launch import oversubscribed

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
                                command=f"starqa bench ({name})", oversubscribe=oversubscribed())
    # One stand-in file over every token, a line per BENCH_LINE tokens, so that answers
    # are attributed (and `bench` measures what that costs) as for ingested files.
    n = len(ids)
    lines = list(range(0, n, BENCH_LINE))
    whole = corpus_mod.TextFile(name, "", 0)
    source = Prepared(key, prompt.ContextTokens(list(ids), [(0, n)], [lines]),
                    corpus_mod.Corpus((), (whole,), ()),
                    [corpus_mod.FileSpan(name, 0, 0, 0, len(lines))], identity, dtype, config,
                    content)
    return run_phase1(ingest_opts, root, source, started, ui, Mode(measure=opts.measure))


BENCH_LINE = 64  # tokens per line of `ingest_tokens`' stand-in file


def _placed_alike(folder: Path, opts: IngestOptions) -> bool:
    """A committed context kept as this ingest would keep it: whole (one machine, or a
    shared cache), or split over as many machines, this one being the same node."""
    where = read_manifest(folder).placement
    return where is None or (where.nodes == opts.nnodes and where.node == opts.node_rank)


def _block_size(opts: IngestOptions, root: Path, model: ModelIdentity, dtype: str,
                n: int) -> int | None:
    """--block-size; else, on a re-ingest, the previous version's (`reuse.kept_block_size`);
    else None (the default)."""
    if opts.block_size is not None or opts.force or opts.nnodes > 1:
        return opts.block_size
    previous = store.latest_of(root, opts.paths, opts.method, model.digest, dtype)
    return None if previous is None else reuse.kept_block_size(previous.method.block_size, n)


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
                      manifest.method.as_dict(), kv_tag(manifest.dtype, manifest.kv),
                      plan) == folder.name


def _kv(opts: IngestOptions) -> str:
    """--kv, checked (None, where no planner chose: float)."""
    if opts.kv is None:
        return KV_KINDS[0]
    if opts.kv not in KV_KINDS:
        raise StarqaError(f"Unknown --kv {opts.kv!r}.",
                          hint=f"choose one of: {', '.join(KV_KINDS)}")
    return opts.kv


def _config(model_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)
