"""The torchrun worker: `python -m starqa.workers.worker JOB.json`, one process per rank.

Reads the job the launcher wrote, joins the process group (starqa.runtime.dist), loads the model,
and runs Phase 1 (encode and save this rank's blocks) or Phase 2 (load this rank's shards,
answer). Talks to the launcher through JSON event lines on stdout (see `emit`). A job with
`"measure": true` (starqa bench) also reports this rank's time, FLOPs and bytes
communicated in a `measure` event; other jobs pay nothing for it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starqa.core.errors import StarqaError, disk_full

EVENT_PREFIX = "@@starqa "


def emit(event: str, **fields) -> None:
    """One event line for the launcher. Lines are short, so concurrent ranks never interleave."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _load_model(job: dict, info):
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

    dtype = job.get("compute_dtype", job["dtype"])
    if job.get("across") and len(set(dist.all_gather_object(info, dtype))) > 1:
        dtype = job["dtype"]
    return load_model(job["model_path"], dtype=getattr(torch, dtype), device=info.device,
                      attn_implementation=hooks.register())


def run_ingest(job: dict, info) -> None:
    from safetensors.torch import load_file

    from starqa.runtime import dist
    from starqa.core import gcpause
    from starqa import methods
    from starqa.workers.encoding import encode_blocks

    method = methods.MethodConfig(**job["method"])
    encoder = methods.get(method.name)
    blocks = [tuple(b) for b in job["blocks"]]
    todo = job.get("todo", list(range(len(blocks))))  # an incremental ingest: fewer
    folder = Path(job["staging"])
    across = job.get("across", False)  # machines that keep their own blocks (issue #15)
    if across:
        from starqa.cache import hosts

        if all(dist.all_gather_object(info, job.get("hit", False))):
            emit("hit", rank=info.rank)  # every machine holds the context already
            return
        shared = hosts.shared_folder(info, folder.parent)
    ids = load_file(job["tokens_file"])["ids"].long()
    model = _load_model(job, info)
    gcpause.settle()
    mine = encoder.share(todo, len(blocks), info.world_size, info.rank)
    emit("ready", rank=info.rank, blocks=mine)
    _fault("ingest", info.rank)
    _slow("ingest")
    measure = job.get("measure", False)
    if measure:
        dist.barrier(info)  # every rank starts its clock together, after the model loaded
    counter = flop_counter() if measure else contextlib.nullcontext()
    started, cpu = time.perf_counter(), time.process_time()
    with counter:
        encode_blocks(model, ids, method, blocks, todo, folder, info, job.get("prepared"),
                      lambda index, tokens: emit("block", rank=info.rank, index=index,
                                                 tokens=tokens),
                      index=job.get("index"),
                      on_index=lambda seconds: emit("index", rank=info.rank, seconds=seconds),
                      dtype=job["dtype"])
    if measure:
        emit("measure", rank=info.rank, phase="ingest", seconds=time.perf_counter() - started,
             cpu_seconds=time.process_time() - cpu, flops=counter.get_total_flops(),
             tokens=sum(blocks[i][1] - blocks[i][0] for i in mine), **info.traffic.as_dict())
    dist.barrier(info)
    if across:
        _fault("place", info.rank)
        placed = hosts.place_ingest(info, folder, blocks, shared)
        if placed is not None:
            emit("placement", node=info.node, **placed)


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


def _answerer(job: dict, info):
    """This rank's Answerer for the job's context, once every rank has loaded its own."""
    from starqa.runtime import dist
    from starqa.phase2.answering import Answerer
    from starqa.topk.indexes import topk_of
    from starqa.cache.manifest import read_manifest

    manifest = read_manifest(Path(job["context_dir"]))
    if len(info.nodes) > 1:  # across machines: each one holds what its ranks load
        from starqa.cache.hosts import ensure_blocks

        manifest = ensure_blocks(info, manifest)
    answerer = Answerer.from_cache(manifest, info, Path(job["model_path"]),
                                   job.get("weights", "dense"), topk_of(job.get("topk")))
    dist.barrier(info)
    return answerer, manifest


def run_ask(job: dict, info, prefilled=None):
    """Answer the job's question; returns the Answerer (model and shard, still loaded).
    prefilled: the question's forward, run by the head start before torch was imported
    (starqa.coldstart.firsttoken), which streamed the first token itself."""
    ctx, _ = _answerer(job, info)
    emit("ready", rank=info.rank, blocks=ctx.blocks)
    _fault("ask", info.rank)
    started = time.perf_counter() if prefilled is None else prefilled.started
    first: list[float] = [prefilled.picked] if prefilled is not None else []

    def on_token(token: int) -> None:
        first or first.append(time.perf_counter())
        emit("token", id=token)

    tokens, top = ctx.answer(job["query_ids"], job["max_new_tokens"], job["stop_ids"],
                             on_token if info.is_last else None, prefilled=prefilled)
    if info.is_last:
        end = time.perf_counter()
        emit("done", tokens=len(tokens), prefill_s=(first[0] if first else end) - started,
             decode_s=end - (first[0] if first else end), sources=top,
             before_torch=prefilled is not None)
    if job.get("measure", False):
        emit("measure", rank=info.rank, phase="ask", seconds=time.perf_counter() - started,
             tokens=len(tokens), sources_seconds=ctx.sources_seconds, **info.traffic.as_dict())
    return ctx


def run_serve(job: dict, info) -> None:
    """Keep model and shards loaded and answer questions from a local socket
    (starqa.workers.server)."""
    from starqa.workers.server import serve_group

    answerer, manifest = _answerer(job, info)
    query = info.roster[-1] if info.roster else None
    serve_group(job, info, answerer, manifest,
                lambda: emit("ready", rank=info.rank, blocks=answerer.blocks,
                             query_host=info.is_last, world=info.world_size,
                             nodes=len(info.nodes), node=info.node,
                             query=query.describe() if query else None))


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


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A function that asks the kernel to send `sig` to the calling process when its parent
    exits (Linux `prctl(PR_SET_PDEATHSIG)`; a no-op elsewhere), so a `kill -9` of the
    launcher takes torchrun down, and torchrun's death its workers (issue #11, item 4).
    libc is looked up here, so the returned function is safe as a `preexec_fn` (no dlopen
    between fork and exec). The setting survives exec."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1

    def set_it() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_it


def _slow(phase: str) -> None:
    """Test-only: STARQA_SLOW=seconds makes every worker wait here, alive, before encoding
    (having created the file `$STARQA_SLOW_MARK.RANK` first, when that is set)."""
    if phase == "ingest" and (seconds := os.environ.get("STARQA_SLOW")):
        if mark := os.environ.get("STARQA_SLOW_MARK"):
            Path(f"{mark}.{os.environ.get('RANK', 0)}").touch()
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


def _report_lost(lost: str) -> None:
    emit("error", rank=int(os.environ.get("RANK", 0)), kind="WorkerError", lost=True,
         message=f"Lost {lost}: it stopped answering the group (the machine or its workers "
                 f"died or froze, or the network failed). Nothing of this run was kept on "
                 f"this machine; its cache is as it was before.",
         hint="see that machine's own output for why; run the command again on every "
              "machine once it is back")


def _lost(lost: str) -> None:
    """The heartbeat watchdog's verdict (dist.watch_peers, its own thread): report the lost
    machine and leave at once, whatever the main thread is waiting in. Staging folders are
    the launcher's to remove (it does, on this error)."""
    print(f"lost {lost}: no heartbeat", file=sys.stderr, flush=True)
    _report_lost(lost)
    sys.stdout.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    from starqa.runtime import dist
    from starqa.core import gcpause

    gcpause.pause()  # until the model is loaded (Answerer.from_cache settles it)

    parent = os.getppid()
    parent_death_signal()()  # torchrun gone (even by SIGKILL): this worker goes too
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(open(argv[0]).read())
    info = dist.init(job.get("device", "auto"), on_lost=_lost)
    if code := run_job(job, info):
        return code
    # Done. Leave without tearing the group down: now and then gloo's threads abort the
    # process while it unwinds ("terminate called without an active exception"), turning a
    # finished job into a failed one. Nothing is left to flush but our own streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(job: dict, info, after: Callable[[Any], None] | None = None,
            prefilled=None) -> int:
    """Run the job's phase on this rank: 0, or 1 once the failure is reported (an `error`
    event, or a traceback on stderr). A torchrun rank (`main`) and a cold ask's head start
    (`starqa.coldstart.headstart`, a world of one) both come here. `after`: called, once the phase
    is done and reported, with what it returns (an ask's Answerer: the head start goes on
    as the warm group with it). `prefilled`: an ask's question forward, run already
    (`run_ask`)."""
    from starqa.runtime import dist

    try:
        if job["phase"] == "ask":
            done = run_ask(job, info, prefilled)
        else:
            done = {"ingest": run_ingest, "serve": run_serve}[job["phase"]](job, info)
        emit("peak", rank=info.rank, bytes=_peak_memory(info))
        dist.barrier(info)  # every rank is done with the group
        if after is not None:
            after(done)
    except StarqaError as err:
        emit("error", rank=info.rank, kind=type(err).__name__, message=str(err), hint=err.hint)
        return 1
    except OSError as err:
        if (known := disk_full(err, f"Worker {info.rank}")) is None:
            traceback.print_exc()
        else:
            emit("error", rank=info.rank, kind="StarqaError", message=str(known), hint=known.hint)
        return 1
    except Exception as err:
        traceback.print_exc()
        if (lost := dist.lost_peer(info, err)) is not None:  # another machine died or left
            _report_lost(lost)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
