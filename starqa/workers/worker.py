"""The torchrun worker: `python -m starqa.workers.worker JOB.json`, one process per rank.

Reads the job the launcher wrote (`starqa.runtime.protocol`: an IngestJob, AskJob or
ServeJob), joins the process group (starqa.runtime.dist), loads the model, and runs Phase 1
(encode and save this rank's blocks) or Phase 2 (load this rank's shards, answer). Talks to
the launcher through the protocol's event lines on stdout (`protocol.emit`). A job with
`measure` (starqa bench) also reports this rank's time, FLOPs and bytes communicated in a
`Measure` event; other jobs pay nothing for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starqa.core.errors import StarqaError, disk_full
from starqa.runtime.protocol import (AskJob, Block, Done, Error, Hit, IndexBuilt, IngestJob, Job,
    Measure, Peak, Placed, Ready, ServeJob, Token, decode_job, emit)


def _load_model(job: IngestJob, info, rope_length: int | None = None):
    """Phase 1's model, in the dtype it computes in: the job's `compute_dtype`, chosen once
    by the launcher for its workers (`models.phase1_dtype`: fp32 for a bf16 cache on a CPU
    without bf16 matrix instructions; the blocks are stored in the job's `dtype`). Across
    machines every rank must compute in one dtype, or the methods that pass KV between
    ranks (ring, APB) would exchange tensors of two: where the machines chose differently,
    all keep the cache's."""
    import torch

    from starqa.runtime import dist
    from starqa.phase1 import hooks
    from starqa.models import load_model

    dtype = job.compute_dtype
    if job.across and len(set(dist.all_gather_object(info, dtype))) > 1:
        dtype = job.dtype
    return load_model(job.model_path, dtype=getattr(torch, dtype), device=info.device,
                      attn_implementation=hooks.register(), rope_length=rope_length)


def run_ingest(job: IngestJob, info) -> None:
    """Phase 1 on this rank: encode its share of the job's blocks into the staging folder;
    across machines, then move each block to the machine that keeps it."""
    from safetensors.torch import load_file

    from starqa.runtime import dist
    from starqa.core import gcpause
    from starqa import methods
    from starqa.workers.encoding import BlockSink, EncodeTask, encode_blocks, rope_length

    method = methods.MethodConfig(**job.method)
    encoder = methods.get(method.name)
    folder = Path(job.staging)
    if job.across:  # machines that keep their own blocks (issue #15)
        from starqa.cache import hosts

        if all(dist.all_gather_object(info, job.hit)):
            emit(Hit(rank=info.rank))  # every machine holds the context already
            return
        shared = hosts.shared_folder(info, folder.parent)
    ids = load_file(job.tokens_file)["ids"].long()
    task = EncodeTask(method, job.blocks, job.todo, job.prepared)
    model = _load_model(job, info, rope_length(job.model_path, ids, task))
    gcpause.settle()
    mine = encoder.share(job.todo, len(job.blocks), info.world_size, info.rank)
    emit(Ready(rank=info.rank, blocks=tuple(mine)))
    _fault("ingest", info.rank)
    _slow("ingest", info.rank)
    if job.measure:
        dist.barrier(info)  # every rank starts its clock together, after the model loaded
    counter = flop_counter() if job.measure else contextlib.nullcontext()
    started, cpu = time.perf_counter(), time.process_time()
    sink = BlockSink(folder, job.dtype, job.index,
                     lambda index, tokens: emit(Block(rank=info.rank, index=index,
                                                      tokens=tokens)),
                     lambda seconds: emit(IndexBuilt(rank=info.rank, seconds=seconds)),
                     kv=job.kv)
    with counter:
        encode_blocks(model, ids, task, info, sink)
    if job.measure:
        emit(Measure(rank=info.rank, phase="ingest", values={
            "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu,
            "flops": counter.get_total_flops(),
            "tokens": sum(job.blocks[i][1] - job.blocks[i][0] for i in mine),
            **info.traffic.as_dict()}))
    dist.barrier(info)
    if job.across:
        _fault("place", info.rank)
        placed = hosts.place_ingest(info, folder, job.blocks, shared)
        if placed is not None:
            emit(Placed(node=info.node, shared=placed["shared"], held=tuple(placed["held"]),
                        homes=tuple(placed["homes"]), hosts=tuple(placed["hosts"]),
                        sums=tuple(tuple(s) for s in placed["sums"])))


def flop_counter():
    """torch's FLOP counter (`FlopCounterMode`), taught SDPA's kernels with GQA.

    torch counts matmuls (2·m·n·k) but not the CPU kernel SDPA dispatches to
    (`_scaled_dot_product_flash_attention_for_cpu`), which Phase 1 uses, and before 2.13
    its formula for the CUDA kernels refuses fewer KV heads than query heads (`enable_gqa`:
    "sdpa_flop_count: query/key/value shapes are incompatible", which stopped a bench on
    an H100 with torch 2.11). Each is counted here the way torch counts the CUDA ones: QKᵀ
    and PV over the full [M, N] score matrix, 4·B·Hq·M·N·D, causal masks not discounted.
    Phase 2's `attend` is plain matmuls and needs nothing. flash-attn's own kernels (CUDA,
    optional) are not counted."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        # query [B, Hq, M, D], key [B, Hkv, N, D], value [B, Hkv, N, Dv]; GQA shares KV heads
        batch, heads, m, dim = query_shape
        n, dim_v = key_shape[2], value_shape[3]
        return 2 * batch * heads * m * n * dim + 2 * batch * heads * m * n * dim_v

    aten = torch.ops.aten
    kernels = [aten._scaled_dot_product_flash_attention_for_cpu,
               aten._scaled_dot_product_flash_attention,
               aten._scaled_dot_product_efficient_attention]
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):  # torch >= 2.5
        kernels.append(aten._scaled_dot_product_cudnn_attention)
    return FlopCounterMode(display=False, custom_mapping=dict.fromkeys(kernels, sdpa))


def _answerer(job: AskJob | ServeJob, info):
    """This rank's Answerer for the job's context, once every rank has loaded its own."""
    from starqa.runtime import dist
    from starqa.phase2.answerer import Answerer
    from starqa.topk.indexes import topk_of
    from starqa.cache.manifest import read_manifest

    manifest = read_manifest(Path(job.context_dir))
    if len(info.nodes) > 1:  # across machines: each one holds what its ranks load
        from starqa.cache.hosts import ensure_blocks

        manifest = ensure_blocks(info, manifest)
    answerer = Answerer.from_cache(manifest, info, Path(job.model_path), job.weights,
                                   topk_of(job.topk))
    dist.barrier(info)
    return answerer, manifest


def run_ask(job: AskJob, info, prefilled=None):
    """Answer the job's question; returns the Answerer (model and shard, still loaded).
    prefilled: the question's forward, run by the head start before torch was imported
    (starqa.coldstart.firsttoken), which streamed the first token itself."""
    answerer, _ = _answerer(job, info)
    emit(Ready(rank=info.rank, blocks=tuple(answerer.blocks)))
    _fault("ask", info.rank)
    started = time.perf_counter() if prefilled is None else prefilled.started
    first: list[float] = [prefilled.picked] if prefilled is not None else []

    def on_token(token: int) -> None:
        first or first.append(time.perf_counter())
        emit(Token(id=token))

    tokens, top = answerer.answer(list(job.query_ids), job.max_new_tokens, list(job.stop_ids),
                             on_token if info.is_last else None, prefilled=prefilled)
    if info.is_last:
        end = time.perf_counter()
        emit(Done(tokens=len(tokens), prefill_s=(first[0] if first else end) - started,
                  decode_s=end - (first[0] if first else end),
                  sources=None if top is None else tuple(top),
                  before_torch=prefilled is not None))
    if job.measure:
        emit(Measure(rank=info.rank, phase="ask", values={
            "seconds": time.perf_counter() - started, "tokens": len(tokens),
            "sources_seconds": answerer.sources_seconds, **info.traffic.as_dict()}))
    return answerer


def run_serve(job: ServeJob, info) -> None:
    """Keep model and shards loaded and answer questions from a local socket
    (starqa.workers.server)."""
    from starqa.workers.server import serve_group

    answerer, manifest = _answerer(job, info)
    query = info.roster[-1] if info.roster else None
    serve_group(job, info, answerer, manifest,
                lambda: emit(Ready(rank=info.rank, blocks=tuple(answerer.blocks),
                                   query_host=info.is_last, world=info.world_size,
                                   nodes=len(info.nodes), node=info.node,
                                   query=query.describe() if query else None)))


def _peak_memory(info) -> int:
    """This worker's peak memory in bytes: GPU memory on CUDA, else `own_peak_rss`."""
    if info.device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(info.device)
    return own_peak_rss()


def own_peak_rss() -> int:
    """The largest resident set of this process's own memory since it started, in bytes
    (Linux: /proc/self/status VmHWM). Not getrusage's ru_maxrss: Linux carries it across
    execve, so a process started by another holds the starter's resident set at its fork
    (torchrun's agent, ~220 MiB with torch imported: above a small worker's own, which
    it hid). Elsewhere ru_maxrss, the best there is (bytes on macOS, KiB on the others)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _slow(phase: str, rank: int) -> None:
    """Test-only: STARQA_SLOW=seconds makes every worker wait here, alive, before encoding
    (having created the file `$STARQA_SLOW_MARK.RANK` first, when that is set)."""
    if phase == "ingest" and (seconds := os.environ.get("STARQA_SLOW")):
        if mark := os.environ.get("STARQA_SLOW_MARK"):
            Path(f"{mark}.{rank}").touch()
        time.sleep(float(seconds))


def _fault(phase: str, rank: int) -> None:
    """Test-only fault injection (phases: ingest, place, ask): STARQA_FAULT=phase:rank
    makes that worker die here;
    STARQA_FAULT=phase:rank:disk-full makes its writes fail as on a full disk."""
    fault = os.environ.get("STARQA_FAULT", "")
    if fault == f"{phase}:{rank}":
        print(f"injected fault in {phase} on rank {rank}", file=sys.stderr, flush=True)
        os._exit(3)
    if fault == f"{phase}:{rank}:disk-full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "injected")


def _report_lost(lost: str, rank: int) -> None:
    emit(Error(rank=rank, kind="WorkerError", lost=True,
               message=f"Lost {lost}: it stopped answering the group (the machine or its "
                       f"workers died or froze, or the network failed). Nothing of this run "
                       f"was kept on this machine; its cache is as it was before.",
               hint="see that machine's own output for why; run the command again on every "
                    "machine once it is back"))


def _lost(lost: str) -> None:
    """The heartbeat watchdog's verdict (dist.watch_peers, its own thread): report the lost
    machine and leave at once, whatever the main thread is waiting in. Staging folders are
    the launcher's to remove (it does, on this error)."""
    from starqa.runtime import dist

    print(f"lost {lost}: no heartbeat", file=sys.stderr, flush=True)
    _report_lost(lost, dist.env_rank())
    sys.stdout.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    from starqa.runtime import dist
    from starqa.runtime.launch import parent_death_signal
    from starqa.core import gcpause

    gcpause.pause()  # until the model is loaded (Answerer.from_cache settles it)

    parent = os.getppid()
    parent_death_signal()()  # torchrun gone (even by SIGKILL): this worker goes too
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    argv = sys.argv[1:] if argv is None else argv
    job = decode_job(Path(argv[0]).read_text())
    info = dist.init(job.device, on_lost=_lost)
    if code := run_job(job, info):
        return code
    # Done. Leave without tearing the group down: now and then gloo's threads abort the
    # process while it unwinds ("terminate called without an active exception"), turning a
    # finished job into a failed one. Nothing is left to flush but our own streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(job: Job, info, after: Callable[[Any], None] | None = None,
            prefilled=None) -> int:
    """Run the job's phase on this rank: 0, or 1 once the failure is reported (an `error`
    event, or a traceback on stderr). A torchrun rank (`main`) and a cold ask's head start
    (`starqa.coldstart.headstart`, a world of one) both come here. `after`: called, once the phase
    is done and reported, with what it returns (an ask's Answerer: the head start goes on
    as the warm group with it). `prefilled`: an ask's question forward, run already
    (`run_ask`)."""
    from starqa.runtime import dist

    try:
        if isinstance(job, AskJob):
            done = run_ask(job, info, prefilled)
        elif isinstance(job, IngestJob):
            done = run_ingest(job, info)
        else:
            done = run_serve(job, info)
        emit(Peak(rank=info.rank, bytes=_peak_memory(info)))
        dist.barrier(info)  # every rank is done with the group
        if after is not None:
            after(done)
    except StarqaError as err:
        emit(Error(rank=info.rank, kind=type(err).__name__, message=str(err), hint=err.hint))
        return 1
    except OSError as err:
        if (known := disk_full(err, f"Worker {info.rank}")) is None:
            traceback.print_exc()
        else:
            emit(Error(rank=info.rank, kind="StarqaError", message=str(known), hint=known.hint))
        return 1
    except Exception as err:
        traceback.print_exc()
        if (lost := dist.lost_peer(info, err)) is not None:  # another machine died or left
            _report_lost(lost, info.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
