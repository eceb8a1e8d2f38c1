"""Phase 1's plan and steps for one ingest (`run_phase1`): plan it (which blocks the
content-addressed store holds, where the others are encoded, on how many workers), link in
what the store holds, encode the rest in this process or on a torchrun group
(`starqa.workers.worker`), then commit the shards, indexes and manifest, all or nothing.
"""

from __future__ import annotations

import shlex
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starqa import methods
from starqa.cache import blockstore, shards, store
from starqa.cache.manifest import (IngestRun, Manifest, Placement, Skipped, PackedFile,
    block_file, kv_tag, read_manifest)
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.launchers.ingest.options import IngestOptions, IngestResult, Mode, Prepared
from starqa.launchers.ingest.workers import check_workers, workers_for
from starqa.methods import plan_blocks
from starqa.reingest import resume, reuse
from starqa.reingest.incremental import adopt as adopt_blocks
from starqa.reingest.incremental import keep as keep_blocks
from starqa.reingest.incremental import block_model, rope
from starqa.reingest.reuse import Reuse
from starqa.runtime.launch import PerRank, launch_of, run_workers
from starqa.runtime.protocol import (Block, Event, Hit, IndexBuilt, IndexJob, IngestJob, Placed,
    Ready)
from starqa.topk import indexes


@dataclass(frozen=True)
class Phase1Plan:
    """What Phase 1 will do for one ingest, decided before anything is written: the blocks
    and the method's prepared data; which blocks the store holds (`stored`: linked in,
    re-rotated with `freqs`, or to encode); the previous version a re-ingest reports
    against; whether the blocks to encode are encoded in this process (`local`) or on a
    group of `workers` per machine; the staging folder; the top-k indexes to build."""

    opts: IngestOptions
    source: Prepared
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


def run_phase1(opts: IngestOptions, root: Path, source: Prepared, started: float, ui: UI,
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
        _keep_finished(plan, ui)
        shutil.rmtree(plan.staging, ignore_errors=True)
        raise
    manifest = read_manifest(plan.final)
    store.touch(manifest)
    return IngestResult(manifest, source.corpus, False, time.perf_counter() - started,
                        plan.workers * opts.nnodes, encode_seconds,
                        peak_bytes=heard.ranks.peak_bytes(), measures=heard.ranks.measure_rows(),
                        reuse=_reuse_report(plan, manifest))


def _keep_finished(plan: Phase1Plan, ui: UI) -> None:
    """An ingest on one machine that is interrupted (Ctrl-C, an error, a worker's death)
    keeps the blocks it finished in the block store: the same command resumes from them."""
    if not plan.mode.incremental or plan.multinode or not plan.staging.is_dir():
        return
    kept = resume.keep_finished(plan.stored, plan.store, plan.staging, plan.todo)
    if kept:
        ui.note(f"Kept the {kept} block{'s' * (kept > 1)} encoded before the interruption "
                f"(of {len(plan.todo)}): the same command resumes from them.")


def _plan(opts: IngestOptions, root: Path, source: Prepared, mode: Mode) -> Phase1Plan:
    """What Phase 1 will do (`Phase1Plan`); makes the staging folder."""
    ids, method, model = source.tokens.ids, source.method, source.model
    blocks = source.blocks or plan_blocks(len(ids), method.block_size)
    encoder = methods.get(method.name)
    # computed once here, for every worker and the manifest (pulsar: the summaries)
    prepared = encoder.prepare(ids, method, blocks)
    bstore = blockstore.store_dir(root)
    freqs = rope(model.path) if mode.incremental and encoder.rotatable(method) else None
    force = opts.force or not mode.incremental
    tag = kv_tag(source.dtype, source.kv)  # int8 blocks' addresses differ from float ones
    # a RoPE whose frequencies depend on the context's length names them too (models.rope)
    digest = block_model(model.digest, model.path, query_position(ids, method, blocks, prepared))
    stored = reuse.plan(method, ids, blocks, prepared, reuse.BlockStore(bstore, digest, tag),
                        force=force, rotate=freqs is not None)
    if not force and opts.nnodes == 1 and resume.recover(root, source.key, stored, bstore):
        # blocks of an ingest of these very inputs that crashed: planned again with them
        stored = reuse.plan(method, ids, blocks, prepared, reuse.BlockStore(bstore, digest, tag),
                            force=False, rotate=freqs is not None)
    previous = store.latest_of(root, opts.paths, method.name, model.digest, source.dtype) \
        if mode.incremental else None
    todo = list(stored.todo)
    # a group never has more workers than blocks to spread (apb runs every block)
    spread = max(len(encoder.share(todo, len(blocks), 1, 0)), 1)
    workers = workers_for(opts, method.name, spread) if todo else 1
    local = _in_process(opts, encoder, stored, mode, workers)
    workers = 1 if local else workers
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
                                heard.index_seconds.append, kv=source.kv), on_ready)


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
                    hit=plan.mode.hit_here, kv=source.kv)

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
                shards.read_keys(plan.staging / block_file(i))))
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
        model=source.model, reserve=opts.reserve, dtype=source.dtype, kv=source.kv,
        method=source.method,
        content_sha256=source.content, n_tokens=len(ids),
        query_position=query_position(ids, source.method, plan.blocks, plan.prepared),
        query_template=source.query_template, blocks=hashed,
        files=tuple(PackedFile(path=sp.path, token_start=a, token_end=b, lines=sp.lines,
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


def _in_process(opts: IngestOptions, encoder, plan: reuse.Plan, mode: Mode, workers: int
                ) -> bool:
    """Encode in this process instead of on a torchrun group, where the group would not pay
    for its start (a second Python, torch's import, the rendezvous: seconds the user
    waits): on the CPU, a group of one worker (star's default there, and dense's), whose
    work this process does with the same cores; and an incremental ingest's few blocks,
    which do not pay for every worker's model load either. On the CPU a group's workers
    share the same cores, so this process (with all of them) is as fast at encoding; on
    GPUs a group wins when more than one block is to be encoded and the method can spread
    them. `workers`: the group's workers on this machine."""
    if opts.encode_in != "auto":
        return opts.encode_in == "process"
    if mode.measure or opts.nnodes > 1 or not plan.todo:
        return False
    from starqa.runtime import dist

    on_cpu = str(dist.resolve_device(opts.device)).startswith("cpu")
    if on_cpu and workers == 1:
        return True
    return mode.incremental and bool(plan.reused or plan.rotated) and (
        on_cpu or len(plan.todo) == 1 or encoder.sequential)


def _why(opts: IngestOptions, encoder, method, plan: reuse.Plan, changes, previous,
         manifest: Manifest) -> str | None:
    """Why more blocks were encoded than hold changed files, when it is not plain."""
    if opts.force:
        return "--force re-encodes every block"
    if changes is None or not plan.todo:
        return None
    if encoder.rotatable(method) and method.anchor_size and len(plan.todo) == len(manifest.blocks):
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


def _save_tokens(folder: Path, ids: list[int], node_rank: int) -> Path:
    """The context's token ids for this machine's workers (they never tokenise)."""
    import torch
    from safetensors.torch import save_file

    path = folder / f"tokens-node{node_rank}.safetensors"
    save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(path))
    return path


def _default_name(sources: tuple[str, ...]) -> str:
    return Path(sources[0]).resolve().name or "context"
