"""Where Phase 2 runs: the group's size, chosen from the model's and the shards' bytes and
the memory free on the device (one worker with every core when everything fits), or as
asked."""

from __future__ import annotations

from pathlib import Path

from starqa.cache import store
from starqa.core.errors import StarqaError
from starqa.topk.indexes import memory_bytes
from starqa.runtime.launch import default_workers
from starqa.cache.manifest import Manifest


def phase2_workers(manifest: Manifest, model_path: Path, requested: int | None, nnodes: int,
                   device: str, topk=None) -> tuple[int, str]:
    """Workers per machine for Phase 2, and why. Star Attention spreads Phase 2 because one
    host cannot hold every shard; on one machine whose memory holds the model and every
    shard, one worker with all the cores is fastest (W workers would each run the whole
    model for every token). Never more workers in all than the context has blocks.
    `topk` (indexes.TopK): what top-k attention holds counts instead of the shards."""
    n_blocks = len(manifest.blocks)
    if requested:
        _check_cores(requested if nnodes > 1 else min(requested, n_blocks), requested, device)
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
    data = store.context_size(manifest) if topk is None else memory_bytes(manifest, topk)
    need = (data + _weights_bytes(model_path)) * 3 // 2
    free = _free_memory(device)
    if free is None or need <= free:
        what = "shards" if topk is None else "what top-k attention reads"
        return 1, f"1 worker: model and {what} fit in {'GPU ' * _is_cuda(device)}memory"
    workers = min(default_workers(device), n_blocks)
    return workers, f"{workers} workers: model and shards need {need / 2**30:.1f} GiB, " \
                    f"{free / 2**30:.1f} GiB free"


def _check_cores(workers: int, requested: int, device: str) -> None:
    """Phase 2's CPU workers against the cores (`launch.check_cores`, as Phase 1's);
    STARQA_OVERSUBSCRIBE=1 starts them anyway."""
    from starqa.runtime import launch

    if _is_cuda(device) or launch.oversubscribed():
        return
    launch.check_cores(workers, f"--workers {requested}" + (
        f" ({workers} for the context's blocks)" if workers != requested else ""),
        "set STARQA_OVERSUBSCRIBE=1")


def _weights_bytes(model_path: Path) -> int:
    from starqa.models import weight_files

    return sum(f.stat().st_size for f in weight_files(model_path))


def _is_cuda(device: str) -> bool:
    if device == "auto":
        from starqa.models import cuda_available

        return cuda_available()
    return device.startswith("cuda")


def _free_memory(device: str) -> int | None:
    """Bytes free on `device` (CPU: MemAvailable), or None when unknown."""
    if _is_cuda(device):
        import torch

        return torch.cuda.mem_get_info(0)[0]
    from starqa.models import available_memory

    return available_memory()
