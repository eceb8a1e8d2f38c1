"""How many Phase 1 workers an ingest starts on a machine: as many as the method can use
(`workers_for`; on a CPU, one with every core for star), and on a CPU no more than the
cores and the memory hold (`check_workers`)."""

from __future__ import annotations

import json
from pathlib import Path

from starqa import methods
from starqa.core.errors import StarqaError
from starqa.launchers.ingest.options import IngestOptions
from starqa.runtime.launch import default_workers


def workers_for(opts: IngestOptions, method: str, n_blocks: int) -> int:
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
        return min(opts.workers or _default(opts.device, encoder), most)
    workers = opts.workers or _default(opts.device, encoder)
    if workers * opts.nnodes > most:
        raise StarqaError(f"{workers * opts.nnodes} workers on {opts.nnodes} machines but only "
                          f"{n_blocks} blocks.", hint="pass a smaller --block-size or --workers")
    return workers


def _default(device: str, encoder: methods.Method) -> int:
    """Workers per machine when --workers is not given: all GPUs, else all cores, but on a
    CPU one with every core for a method whose blocks share a prefix (star's anchor): each
    worker encodes that prefix once, so a worker per core would encode it once per core
    for the same cores (`ingest samples/` with Qwen2.5-Coder-1.5B on 2 cores: 49.9 s
    against 64.5, docs/results.md)."""
    from starqa.models import cuda_available

    on_gpu = device.startswith("cuda") or (device == "auto" and cuda_available())
    return 1 if encoder.shares_prefix and not on_gpu else default_workers(device)


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
    return workers_for(IngestOptions(paths=(), workers=workers), method, n_blocks)
