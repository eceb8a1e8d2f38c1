"""The torchrun worker: `python -m starqa.worker JOB.json`, one process per rank.

Reads the job the launcher wrote, joins the process group (starqa.dist), loads the model,
and runs Phase 1 (encode and save this rank's blocks) or Phase 2 (load this rank's shards,
answer). Talks to the launcher through JSON event lines on stdout (see `emit`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

EVENT_PREFIX = "@@starqa "


def emit(event: str, **fields) -> None:
    """One event line for the launcher. Lines are short, so concurrent ranks never interleave."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _load_model(job: dict, info):
    import torch

    from starqa import hooks
    from starqa.models import load_model

    dtype = getattr(torch, job["dtype"])
    return load_model(job["model_path"], dtype=dtype, device=info.device,
                      attn_implementation=hooks.register())


def run_ingest(job: dict, info) -> None:
    from safetensors.torch import load_file

    from starqa import dist, phase1, store
    from starqa.methods import MethodConfig

    method = MethodConfig(**job["method"])
    blocks = [tuple(b) for b in job["blocks"]]
    folder = store.Path(job["staging"])
    ids = load_file(job["tokens_file"])["ids"].long()
    model = _load_model(job, info)
    mine = list(dist.split_contiguous(len(blocks), info.world_size, info.rank))
    emit("ready", rank=info.rank, blocks=mine)
    _fault("ingest", info.rank)
    for index, k, v in phase1.encode(model, ids, method, blocks, mine):
        start, end = blocks[index]
        store.save_block(folder, index, k.cpu(), v.cpu(), {
            "index": str(index), "start": str(start), "end": str(end), "method": method.name})
        emit("block", rank=info.rank, index=index, tokens=end - start)
    dist.barrier(info)


def run_ask(job: dict, info) -> None:
    from starqa import dist, phase2, store

    manifest = store.read_manifest(store.Path(job["context_dir"]))
    blocks = list(dist.split_contiguous(len(manifest["blocks"]), info.world_size, info.rank))
    model = _load_model(job, info)
    shard = store.load_shard(manifest, blocks, device=info.device)
    query_host = info.is_last
    hook = phase2.ShardAttention(info, shard, query_host)
    dist.barrier(info)
    emit("ready", rank=info.rank, blocks=blocks)
    started = time.perf_counter()
    on_token = (lambda t: emit("token", id=t)) if query_host else None
    tokens = phase2.generate(model, info, hook, job["query_ids"], manifest["n_tokens"],
                             job["max_new_tokens"], set(job["stop_ids"]), on_token)
    if query_host:
        emit("done", tokens=len(tokens), seconds=time.perf_counter() - started,
             mass=hook.mass.tolist())


def _peak_memory(info) -> int:
    """This worker's peak memory in bytes: GPU memory on CUDA, else the process's max RSS."""
    if info.device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(info.device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _fault(phase: str, rank: int) -> None:
    """Test-only fault injection: STARQA_FAULT=phase:rank makes that worker die here."""
    if os.environ.get("STARQA_FAULT") == f"{phase}:{rank}":
        print(f"injected fault in {phase} on rank {rank}", file=sys.stderr, flush=True)
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    from starqa import dist
    from starqa.errors import StarqaError

    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(open(argv[0]).read())
    info = dist.init(job.get("device", "auto"))
    try:
        {"ingest": run_ingest, "ask": run_ask}[job["phase"]](job, info)
        emit("peak", rank=info.rank, bytes=_peak_memory(info))
    except StarqaError as err:
        emit("error", rank=info.rank, kind=type(err).__name__, message=str(err), hint=err.hint)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        dist.shutdown(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
