"""Distributed glue, and the only module that reads torchrun's environment.

Owns process-group set-up (workers leave with os._exit, see worker.main); every collective
takes the group explicitly.
CPU runs use gloo, CUDA runs nccl. A process started without torchrun is a world of one
with no process group, so the phases run unchanged in-process (tests, single worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None  # None for a world of one

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def init(device: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the torchrun group (or make a world of one). Pins this worker's CPU threads."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if threads := os.environ.get("STARQA_THREADS"):
        torch.set_num_threads(int(threads))
    group = None
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
        group = dist.group.WORLD
    return DistInfo(rank, local_rank, world, dev, group)


def all_gather(info: DistInfo, tensor: torch.Tensor) -> torch.Tensor:
    """Stack every rank's `tensor` (same shape everywhere): returns [world, *tensor.shape]."""
    if info.group is None:
        return tensor.unsqueeze(0)
    flat = tensor.contiguous().view(-1)
    out = flat.new_empty(info.world_size * flat.numel())
    dist.all_gather_single(out, flat, group=info.group)
    return out.view(info.world_size, *tensor.shape)


def broadcast(info: DistInfo, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Rank `src`'s tensor on every rank (in place)."""
    if info.group is not None:
        dist.broadcast(tensor, src=src, group=info.group)
    return tensor


def ring_shift(info: DistInfo, tensor: torch.Tensor) -> torch.Tensor:
    """Send `tensor` to the next rank and return the one the previous rank sent (same shape
    on every rank); ranks form a ring, rank W-1 sending to rank 0."""
    if info.group is None:
        return tensor
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), (info.rank + 1) % info.world_size,
                      group=info.group),
           dist.P2POp(dist.irecv, received, (info.rank - 1) % info.world_size, group=info.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def gather_object(info: DistInfo, obj, dst: int) -> list | None:
    """Every rank's picklable `obj`, as a list on rank `dst` (None elsewhere)."""
    if info.group is None:
        return [obj]
    out = [None] * info.world_size if info.rank == dst else None
    dist.gather_object(obj, out, dst=dst, group=info.group)
    return out


def broadcast_object(info: DistInfo, obj, src: int):
    """Rank `src`'s picklable `obj` on every rank."""
    if info.group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=info.group)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.group is not None:
        dist.barrier(group=info.group)


def split_contiguous(n_items: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `n_items` (the first ranks take one extra)."""
    base, extra = divmod(n_items, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
