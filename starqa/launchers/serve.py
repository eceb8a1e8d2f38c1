"""`starqa serve`: a warm worker group for a cached context, its model and shards loaded
once, answering questions from a local socket (`starqa.workers.server`) until stopped or
idle; one worker runs in this process, more on torchrun. Its run file (`client.run_dir()`)
tells `ask`, `chat`, `ps` and `stop` where it listens.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starqa.cache import hosts, store
from starqa.cache.manifest import Manifest
from starqa.core import paths
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.launchers.query import checked_model, with_indexes
from starqa.phase2.placement import phase2_workers
from starqa.runtime.launch import launch_of, run_workers
from starqa.runtime.protocol import Event, Ready, ServeJob
from starqa.topk.indexes import TopK, topk_of
from starqa.workers import runfile
from starqa.workers.runfile import RunInfo
from starqa.core import DEFAULT_KEEPALIVE


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

    manifest = store.find_context(paths.contexts_dir(), opts.context)
    key = manifest.key
    claim = claim or client.claim(key)  # held while the group lives: one group per context
    if claim is None and (group := client.part(key)) is not None:
        raise client.elsewhere(group)
    if claim is None or client.find(key) is not None:
        raise StarqaError(f"A worker group for {manifest.name} ({key}) is already running "
                          "or starting.", hint=f"starqa stop {manifest.name}")
    with claim:
        _serve_claimed(opts, manifest, ui, on_ready, answerer)


def _serve_claimed(opts: ServeOptions, manifest: Manifest, ui: UI, on_ready,
                   answerer) -> None:
    """`serve`, once this process holds the context's group slot."""
    from starqa import models
    from starqa.workers import client

    if opts.nnodes == 1:  # across machines, blocks kept elsewhere come over the group
        hosts.check_here(manifest)
    with ui.status("Checking model and shards"):
        model_path = checked_model(manifest, opts.model, ui)
    manifest = with_indexes(manifest, opts.topk, ui)
    workers, why = phase2_workers(manifest, model_path, opts.workers, opts.nnodes,
                                  opts.device, opts.topk)
    job = ServeJob(model_path=str(model_path), dtype=manifest.dtype,
                   context_dir=str(manifest.folder), socket=str(client.socket_path(manifest.key)),
                   keepalive=opts.keepalive,
                   weights=models.phase2_weights(opts.weights, manifest.model.spec, opts.device),
                   topk=opts.topk.as_dict() if opts.topk else None,
                   lazy_tokenizer=answerer is not None, device=opts.device)
    run_file = client.run_dir() / f"{manifest.key}.json"
    on_event = _announce(opts, manifest, job, workers, run_file, on_ready)
    try:
        if workers == 1 and opts.nnodes == 1:
            _serve_here(job, manifest, why, ui, lambda: on_event(Ready(rank=0)), answerer)
        else:
            ui.waiting(f"Starting {workers} workers (loading model and shards; {why})")
            run_workers(job, launch_of(opts, workers), on_event)
    finally:
        run_file.unlink(missing_ok=True)


def _announce(opts: ServeOptions, manifest: Manifest, job: ServeJob, workers: int,
              run_file: Path, on_ready) -> Callable[[Event], None]:
    """The group's event handler: once this machine's `workers` are ready, it writes the
    run file (what `ps`, `stop` and `ask` read) and calls `on_ready` with its contents."""
    ready: dict[int, Ready] = {}

    def on_event(event: Event) -> None:
        if not isinstance(event, Ready):
            return
        ready[event.rank] = event
        if len(ready) != workers:  # this machine's workers (all, on one machine)
            return
        info = RunInfo(key=manifest.key, name=manifest.name, pid=os.getpid(),
                       workers=workers, socket=job.socket, started=time.time(),
                       keepalive=opts.keepalive, tokens=manifest.n_tokens,
                       weights=job.weights, method=manifest.method.name, topk=job.topk,
                       # what client.follow restarts it with after a re-ingest
                       requested_workers=opts.workers,
                       attention_args=tuple(opts.topk.cli_args()) if opts.topk else ())
        if opts.nnodes > 1:
            first = next(iter(ready.values()))
            query = any(e.query_host for e in ready.values())
            info = dataclasses.replace(info, workers=first.world, node=first.node,
                                       nodes=first.nodes, query=first.query,
                                       socket=job.socket if query else None)
        runfile.write(run_file, info)
        if on_ready:
            on_ready(info)

    return on_event


def _serve_here(job: ServeJob, manifest: Manifest, why: str, ui: UI, on_ready,
                answerer=None) -> None:
    """A warm group of one worker: this process (starqa.workers.server's loop, no torchrun),
    with `answerer` if it holds the model and shard already."""
    from starqa.runtime import dist
    from starqa.phase2.answerer import Answerer
    from starqa.workers.server import serve_group

    if answerer is None:
        ui.waiting(f"Loading model and shards ({why})")
        info = dist.local_world(job.device)
        answerer = Answerer.from_cache(manifest, info, Path(job.model_path), job.weights,
                                       topk_of(job.topk))
    serve_group(job, answerer.info, answerer, manifest, on_ready)
