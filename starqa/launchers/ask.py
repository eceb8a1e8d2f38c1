"""Phase 2's launcher, `starqa ask` and `starqa serve`: a cached context and a question →
query tokens → an answer from a warm group (over its socket), from this process (a world of
one, when model and shards fit in memory) or from a torchrun group; `serve` keeps a group
warm for later questions. Every path answers through `starqa.phase2.answering.Answerer`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starqa.cache import hosts, shards, store
from starqa.core import paths
from starqa.corpus import prompt
from starqa.core.errors import StarqaError
from starqa.topk.indexes import TopK, topk_of
from starqa.runtime.launch import Launch, launch_of, run_workers
from starqa.cache.manifest import Manifest, write_json_atomic
from starqa.phase2.placement import phase2_workers
from starqa.core.progress import UI

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
    keepalive: float = 0.0  # a cold ask leaves a warm group this long; 0: none; < 0: one
    # that never exits on its own (CLI: 300 s)
    topk: TopK | None = None  # top-k attention (starqa.topk.indexes.topk_settings); None: exact


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
    attention: str = "exact"  # or the top-k settings (`TopK.describe`): then no sources
    before_torch: bool = False  # the first token came before torch was imported (a cold
    # ask's head start, starqa.coldstart.firsttoken)


def ask(opts: AskOptions, ui: UI = UI(), head=None) -> Answer:
    """Answer `opts.question` about a cached context: on its warm group if one runs, else
    on a world of one (`head`, a `starqa.coldstart.headstart.HeadStart`: the process the command
    forked as it started, when it has one; else this process) or on torchrun's workers.
    `head` is this call's to run or let go."""
    try:
        return _ask(opts, ui, head)
    finally:
        if head is not None:  # not taken (or done): its child exits, unless it serves on
            head.close()


def _ask(opts: AskOptions, ui: UI, head) -> Answer:
    from starqa import models

    started = time.perf_counter()
    if not opts.question.strip():
        raise StarqaError("The question is empty.")
    if opts.max_new_tokens < 1:
        raise StarqaError(f"--max-new-tokens must be at least 1 (got {opts.max_new_tokens}).")
    manifest = store.find_context(paths.contexts_dir(), opts.context)
    if opts.beyond_window and opts.max_new_tokens > manifest.model.window:
        # without --beyond-window the room check says it; the answer's buffers are this long
        raise StarqaError(f"--max-new-tokens {opts.max_new_tokens:,} is longer than the model's "
                          f"whole window ({manifest.model.window:,} tokens).",
                          hint=f"ask with --max-new-tokens {manifest.model.window} or lower")
    if opts.warm and opts.nnodes == 1 and opts.model is None:
        from starqa.workers import client

        group = client.find(manifest.key)
        if group is not None and opts.weights in (None, group.get("weights")) \
                and group.get("topk") == (opts.topk.as_dict() if opts.topk else None):
            if head is not None:  # the group answers: no torch in this command
                head.close()
                head = None
            try:
                return _ask_warm(opts, manifest, group, ui, started)
            except client.Unreachable:  # it died without cleaning up: answer cold
                client.forget(group)
    with ui.status("Checking model and shards"):
        model_path = _checked_model(manifest, opts.model, ui)
        tokenizer, query_ids = question_ids(manifest, model_path, opts.question)
    if opts.nnodes == 1:  # no group to fetch blocks kept on other machines from
        try:
            hosts.check_here(manifest)
        except StarqaError:
            from starqa.workers import client

            if (group := client.part(manifest.key)) is not None:  # warm, on another machine
                raise client.elsewhere(group) from None
            raise
    manifest = _with_indexes(manifest, opts.topk, ui)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if not opts.beyond_window and (error := prompt.room_error(n, m, opts.max_new_tokens, window)):
        raise error
    workers, why = phase2_workers(manifest, model_path, opts.workers, opts.nnodes, opts.device,
                                  opts.topk)
    weights = models.phase2_weights(opts.weights, manifest.model.spec, opts.device)
    stops = models.stop_ids(tokenizer, model_path)
    if head is not None and not (workers == 1 and opts.nnodes == 1):
        head.close()  # a torchrun group answers
        head = None
    keep = opts.keepalive != 0 and opts.warm and opts.nnodes == 1  # leave a warm group
    # a world of one forked as the command started (starqa.coldstart.headstart)
    if head is not None:
        ui.waiting(f"Loading model and shards ({why})")
        then = {"keepalive": opts.keepalive, "workers": opts.workers, "weights": opts.weights,
                "topk": opts.topk.as_dict() if opts.topk else None} if keep else None
        answer = _answer(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens,
                         stops, launch_of(opts, 1), ui, started, weights=weights,
                         topk=opts.topk, head=head, then_serve=then)
    elif workers == 1 and opts.nnodes == 1:
        answer = _answer_here(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens,
                              stops, weights, opts.device, why, ui, started, opts.topk)
    else:
        answer = _answer(manifest, model_path, tokenizer, query_ids, opts.max_new_tokens,
                         stops, launch_of(opts, workers), ui, started, weights=weights,
                         topk=opts.topk)
    if keep and not (head is not None and head.serving):
        from starqa.workers import client

        # The next question finds this context warm: a group starts in the background
        # (a second one for the same context refuses to start, see `serve`); the head
        # start, where one answered, went on as that group itself.
        client.spawn(manifest.key, opts.workers, opts.keepalive, opts.weights,
                     opts.topk.cli_args() if opts.topk else ())
    return answer


def _with_indexes(manifest: Manifest, topk: TopK | None, ui: UI) -> Manifest:
    """The context with the indexes top-k attention needs, built now if it has none."""
    if topk is None:
        return manifest
    from starqa.topk import indexes

    return indexes.ensure(manifest, topk.index, on_build=ui.waiting)


def question_ids(manifest: Manifest, model_path: Path, question: str) -> tuple[Any, list[int]]:
    """(tokenizer, the question's query ids), without importing transformers where the
    manifest has its query template (`prompt.QueryTokens`)."""
    tokens = prompt.QueryTokens(manifest.query_template, model_path)
    ids = tokens.ids(question)
    return tokens.tokenizer, ids


def ask_tokens(manifest: Manifest, query_ids: list[int], *, workers: int | None = None,
               max_new_tokens: int = 16, stop: bool = True, measure: bool = False,
               allow_over_window: bool = False, device: str = "auto", weights: str | None = None,
               topk: TopK | None = None, ui: UI = UI()) -> Answer:
    """Phase 2 for query token ids on a fresh torchrun group (never a warm one): the way in
    for `starqa bench`. stop=False generates exactly `max_new_tokens` (an end-of-turn token
    does not end it); measure: the workers report time and bytes communicated
    (Answer.measures); allow_over_window as in `ingest_tokens`."""
    from starqa import models

    started = time.perf_counter()
    model_path = _checked_model(manifest, None)
    tokenizer = models.load_tokenizer(model_path)
    n, m, window = manifest.n_tokens, len(query_ids), manifest.model.window
    if not allow_over_window and (error := prompt.room_error(n, m, max_new_tokens, window)):
        raise error
    manifest = _with_indexes(manifest, topk, ui)
    workers = phase2_workers(manifest, model_path, workers, 1, device, topk)[0]
    stops = models.stop_ids(tokenizer, model_path) if stop else set()
    return _answer(manifest, model_path, tokenizer, query_ids, max_new_tokens, stops,
                   Launch(workers, device=device), ui, started, measure,
                   models.phase2_weights(weights, manifest.model.spec, device), topk)


def _answer(manifest: Manifest, model_path: Path, tokenizer, query_ids: list[int],
            max_new_tokens: int, stops: set[int], launch: Launch, ui: UI, started: float,
            measure: bool = False, weights: str = "dense", topk: TopK | None = None,
            head=None, then_serve: dict | None = None) -> Answer:
    """Run Phase 2 on a torchrun group, or on the head start (`head`: a world of one forked
    as the command started; with `then_serve`, the warm group's settings, it goes on as
    that group once it has answered), streaming tokens to `ui`."""
    workers = launch.workers
    job = {"phase": "ask", "model_path": str(model_path), "dtype": manifest.dtype,
           "context_dir": str(manifest.folder), "query_ids": query_ids, "weights": weights,
           "max_new_tokens": max_new_tokens, "stop_ids": sorted(stops), "measure": measure,
           "topk": topk.as_dict() if topk else None}
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
            timing["end"] = time.perf_counter()  # (a head start may go on serving after)
        elif event["event"] == "peak":
            peaks[event["rank"]] = event["bytes"]
        elif event["event"] == "measure":
            measures[event["rank"]] = event

    if head is not None:
        head.run({**job, "device": launch.device, "then_serve": then_serve}, on_event)
    else:
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
                  seconds=timing.get("end", time.perf_counter()) - started,
                  first_token_seconds=(first - started) if first else None,
                  decode_seconds=done.get("decode_s", 0.0), prefill_seconds=done.get("prefill_s"),
                  sources=done.get("sources") or [],
                  peak_bytes=[peaks[r] for r in sorted(peaks)],
                  measures=[measures[r] for r in sorted(measures)], weights=weights,
                  attention=topk.describe() if topk else "exact",
                  before_torch=done.get("before_torch", False))


def _answer_here(manifest: Manifest, model_path: Path, tokenizer, query_ids: list[int],
                 max_new_tokens: int, stops: set[int], weights: str, device: str, why: str,
                 ui: UI, started: float, topk: TopK | None = None) -> Answer:
    """Phase 2 as a world of one in this process: no torchrun, no second Python start."""
    from starqa.runtime import dist
    from starqa.phase2.answering import Answerer
    from starqa.workers.worker import own_peak_rss

    ui.waiting(f"Loading model and shards ({why})")
    answerer = Answerer.from_cache(manifest, dist.local_world(device), model_path, weights,
                                   topk)
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
                  peak_bytes=[own_peak_rss()],
                  weights=weights, attention=topk.describe() if topk else "exact")


def _ask_warm(opts: AskOptions, manifest: Manifest, group: dict, ui: UI, started: float) -> Answer:
    """Ask a running worker group over its socket (no model load, no torch import here)."""
    from starqa.workers.client import Client

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
                  sources=done["sources"] or [], warm=True, weights=group.get("weights"),
                  attention=opts.topk.describe() if opts.topk else "exact")


@dataclass(frozen=True)
class ServeOptions:
    context: str | None = None
    model: str | None = None
    workers: int | None = None
    keepalive: float = DEFAULT_KEEPALIVE  # idle seconds before the group exits; <= 0: never
    device: str = "auto"
    weights: str | None = None  # Phase 2 weight format; None: the default
    topk: TopK | None = None  # top-k attention; None: exact
    nnodes: int = 1  # across machines (issue #15): each runs `serve` with its --node-rank
    node_rank: int = 0
    rdzv_endpoint: str | None = None


def serve(opts: ServeOptions, ui: UI = UI(), on_ready=None, answerer=None,
          claim=None) -> None:
    """Run a warm worker group for a context until stopped or idle for `keepalive` (<= 0:
    never). One worker runs in this process; more run on torchrun. `answerer`: the model
    and shard a world of one holds already (a cold ask's head start going on as the
    group, starqa.coldstart.headstart), so nothing is loaded again; `claim`: the context's group
    slot (`client.claim`), when the caller holds it already.

    Across machines (`nnodes` > 1) every machine runs this with its own `node_rank`; the
    query host (the machine of the last rank) serves the socket and writes a run file with
    it; the others write one without a socket (`starqa ps` shows their part) and run until
    the query host's group stops."""
    from starqa.workers import client
    from starqa import models

    manifest = store.find_context(paths.contexts_dir(), opts.context)
    key = manifest.key
    claim = claim or client.claim(key)  # held while the group lives: one group per context
    if claim is None and (group := client.part(key)) is not None:
        raise client.elsewhere(group)
    if claim is None or client.find(key) is not None:
        raise StarqaError(f"A worker group for {manifest.name} ({key}) is already running "
                          "or starting.", hint=f"starqa stop {manifest.name}")
    with claim:
        if opts.nnodes == 1:  # across machines, blocks kept elsewhere come over the group
            hosts.check_here(manifest)
        with ui.status("Checking model and shards"):
            model_path = _checked_model(manifest, opts.model, ui)
        manifest = _with_indexes(manifest, opts.topk, ui)
        workers, why = phase2_workers(manifest, model_path, opts.workers, opts.nnodes,
                                      opts.device, opts.topk)
        run_file = client.run_dir() / f"{key}.json"
        job = {"phase": "serve", "model_path": str(model_path), "dtype": manifest.dtype,
               "context_dir": str(manifest.folder), "keepalive": opts.keepalive,
               "socket": str(client.socket_path(key)),
               "weights": models.phase2_weights(opts.weights, manifest.model.spec,
                                                opts.device),
               "topk": opts.topk.as_dict() if opts.topk else None,
               # a cold ask's head start going on as the group listens at once; transformers'
               # tokenizer (conversation history) loads at the first question that needs it
               "lazy_tokenizer": answerer is not None}
        ready: dict[int, dict] = {}

        def on_event(event: dict) -> None:
            if event["event"] == "ready":
                ready[event["rank"]] = event
                if len(ready) == workers:  # this machine's workers (all, on one machine)
                    info = {"key": key, "name": manifest.name, "pid": os.getpid(),
                            "workers": workers, "socket": job["socket"],
                            "started": time.time(), "keepalive": opts.keepalive,
                            "tokens": manifest.n_tokens, "weights": job["weights"],
                            "method": manifest.method.name, "topk": job["topk"],
                            # what client.follow restarts it with after a re-ingest
                            "requested_workers": opts.workers,
                            "attention_args": opts.topk.cli_args() if opts.topk else []}
                    if opts.nnodes > 1:
                        first = next(iter(ready.values()))
                        query = any(e.get("query_host") for e in ready.values())
                        info |= {"workers": first["world"], "node": first["node"],
                                 "nodes": first["nodes"], "query": first["query"],
                                 "socket": job["socket"] if query else None}
                    write_json_atomic(run_file, info)
                    if on_ready:
                        on_ready(info)

        try:
            if workers == 1 and opts.nnodes == 1:
                _serve_here(job, manifest, model_path, opts.device, why, ui,
                            lambda: on_event({"event": "ready", "rank": 0}), answerer)
            else:
                ui.waiting(f"Starting {workers} workers (loading model and shards; {why})")
                run_workers(job, launch_of(opts, workers), on_event)
        finally:
            run_file.unlink(missing_ok=True)


def _serve_here(job: dict, manifest: Manifest, model_path: Path, device: str, why: str, ui: UI,
                on_ready, answerer=None) -> None:
    """A warm group of one worker: this process (starqa.workers.server's loop, no torchrun), with
    `answerer` if it holds the model and shard already."""
    from starqa.runtime import dist
    from starqa.phase2.answering import Answerer
    from starqa.workers.server import serve_group

    if answerer is None:
        ui.waiting(f"Loading model and shards ({why})")
        info = dist.local_world(device)
        answerer = Answerer.from_cache(manifest, info, model_path, job["weights"],
                                       topk_of(job["topk"]))
    serve_group(job, answerer.info, answerer, manifest, on_ready)


def _checked_model(manifest: Manifest, spec: str | None, ui: UI | None = None) -> Path:
    """The manifest's model, verified, with every shard present at its recorded size (the
    workers verify checksums as they load)."""
    model_path = manifest_model(manifest, spec, ui)
    shards.verify_present(manifest)
    return model_path


def manifest_model(manifest: Manifest, spec: str | None, ui: UI | None = None) -> Path:
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
                 f"{manifest.rerun} --model {asked.name}")
    if spec is not None:
        path = models.resolve_model(spec, ui)
    elif not (path / "config.json").exists():
        if made is None and not Path(recorded.spec).expanduser().is_dir():
            raise StarqaError(
                f"Context {manifest.name!r} was ingested with the model at {recorded.path}, "
                "which is no longer there.",
                hint=f"put the model back there, ask with --model PATH (the same model "
                     f"elsewhere), or re-ingest with another model: {manifest.rerun} "
                     "--model MODEL")
        path = models.resolve_model(recorded.spec, ui)  # e.g. the embedded model was deleted
    actual = models.fingerprint(path)
    replaced = Path(path).resolve() == Path(recorded.path).resolve()
    if actual["digest"] != recorded.digest and replaced:
        # the folder it was made with holds another model now: --model that folder is no way out
        changed = [part for part in ("config", "weights", "tokenizer")
                   if actual.get(f"{part}_sha256") != getattr(recorded, f"{part}_sha256")]
        raise StarqaError(
            f"The model now at {recorded.path} ({actual['digest'][:12]}) does not match the model "
            f"context {manifest.name!r} was ingested with there ({recorded.digest[:12]}): its "
            f"{' and '.join(changed) or 'fingerprint'} changed since.",
            hint=f"put the model the context was made with back at {recorded.path}, or "
                 f"re-ingest with the model there now: {manifest.rerun}")
    if actual["digest"] != recorded.digest:
        raise StarqaError(
            f"Model {actual['name']} ({actual['digest'][:12]}) does not match the model context "
            f"{manifest.name!r} was ingested with: {recorded.name} ({recorded.digest[:12]}).",
            hint=f"ask with --model {shlex.quote(recorded.spec)}, or re-ingest: "
                 f"{manifest.rerun}")
    return path
