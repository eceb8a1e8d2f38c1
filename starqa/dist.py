"""Distributed glue, and the only module that reads torchrun's environment.

Owns process-group set-up (workers leave with os._exit, see worker.main); every collective
takes the group explicitly and adds what it moved to the rank's `Traffic`.
CPU runs use gloo, CUDA runs nccl. A process started without torchrun is a world of one
with no process group, so the phases run unchanged in-process (tests, single worker).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Re-exported: Phase 2 loads each rank's shards by it.
from starqa.methods.blocks import split_contiguous  # noqa: F401


@dataclass
class Traffic:
    """Payload bytes one rank moved through the collectives of this module, by collective.

    Counted as if every collective were plain transfers of its payload between ranks:
    all_gather sends this rank's tensor to each of the W-1 others and receives theirs;
    broadcast sends the tensor from `src` to W-1 ranks, each receiving it once; ring_shift
    sends one tensor and receives one. Object collectives count their JSON payload (UTF-8
    bytes, without padding).
    Not counted: the backend's own routing (gloo's rings and trees), headers, the size
    messages of object collectives, barriers. A world of one moves nothing. Summed over the
    ranks of a group, bytes sent equal bytes received.
    """

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, sent: int, received: int) -> None:
        self.sent[op] = self.sent.get(op, 0) + sent
        self.received[op] = self.received.get(op, 0) + received
        self.calls[op] = self.calls.get(op, 0) + 1

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def as_dict(self) -> dict:
        return {"sent_bytes": self.total_sent, "received_bytes": self.total_received,
                "by_op": {op: {"calls": self.calls[op], "sent": self.sent[op],
                               "received": self.received[op]} for op in self.calls}}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None  # None for a world of one
    traffic: Traffic = field(default_factory=Traffic, compare=False)  # this rank's, so far

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def init(device: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the torchrun group (or make a world of one). Pins this worker's CPU threads."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(device)
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


def local_world(device: str | torch.device = "cpu") -> DistInfo:
    """A world of one in this process: no process group, every collective a no-op."""
    return DistInfo(0, 0, 1, torch.device(resolve_device(device)), None)


def resolve_device(device: str | torch.device) -> str | torch.device:
    """`--device auto`: the GPU when torch sees one, else the CPU; any other as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def all_gather(info: DistInfo, tensor: torch.Tensor) -> torch.Tensor:
    """Stack every rank's `tensor` (same shape everywhere): returns [world, *tensor.shape]."""
    if info.group is None:
        return tensor.unsqueeze(0)
    others = (info.world_size - 1) * _nbytes(tensor)
    info.traffic.add("all_gather", others, others)
    return _all_gather(info, tensor)


def broadcast(info: DistInfo, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Rank `src`'s tensor on every rank (in place)."""
    if info.group is not None:
        dist.broadcast(tensor, src=src, group=info.group)
        size = _nbytes(tensor)
        if info.rank == src:
            info.traffic.add("broadcast", (info.world_size - 1) * size, 0)
        else:
            info.traffic.add("broadcast", 0, size)
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
    info.traffic.add("ring_shift", _nbytes(tensor), _nbytes(received))
    return received


def gather_object(info: DistInfo, obj, dst: int) -> list | None:
    """Every rank's JSON-able `obj`, as a list on rank `dst` (None elsewhere).

    Sent as UTF-8 JSON in a uint8 tensor, never pickled: what arrives is parsed, not run.
    As JSON does, dict keys come back as strings (also in a world of one, so callers see
    the same values however many workers there are)."""
    payload = _to_json(obj)
    if info.group is None:
        return [json.loads(payload)]
    # lengths: [world] int64 on every rank, so every rank pads to the same size
    length = torch.tensor([len(payload)], dtype=torch.int64, device=info.device)
    lengths = _all_gather(info, length).view(-1).tolist()
    width = max(lengths)
    mine = _byte_tensor(payload, width, info.device)
    out = [torch.empty(width, dtype=torch.uint8, device=info.device)
           for _ in range(info.world_size)] if info.rank == dst else None
    dist.gather(mine, out, dst=dst, group=info.group)
    if info.rank != dst:
        info.traffic.add("gather_object", len(payload), 0)
        return None
    info.traffic.add("gather_object", 0, sum(n for r, n in enumerate(lengths) if r != dst))
    return [json.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, lengths)]


def broadcast_object(info: DistInfo, obj, src: int):
    """Rank `src`'s JSON-able `obj` on every rank (UTF-8 JSON in a uint8 tensor, never
    pickled; dict keys come back as strings, in a world of one too)."""
    if info.group is None:
        return json.loads(_to_json(obj))
    payload = _to_json(obj) if info.rank == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=info.device)
    dist.broadcast(length, src=src, group=info.group)
    n = int(length.item())
    data = (_byte_tensor(payload, n, info.device) if info.rank == src
            else torch.empty(n, dtype=torch.uint8, device=info.device))
    dist.broadcast(data, src=src, group=info.group)
    if info.rank == src:
        info.traffic.add("broadcast_object", (info.world_size - 1) * n, 0)
        return json.loads(payload)
    info.traffic.add("broadcast_object", 0, n)
    return json.loads(data.cpu().numpy().tobytes())


def _all_gather(info: DistInfo, tensor: torch.Tensor) -> torch.Tensor:
    """all_gather without counting traffic (also the object collectives' size messages)."""
    flat = tensor.contiguous().view(-1)
    out = flat.new_empty(info.world_size, flat.numel())
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13: one call into one buffer
        dist.all_gather_single(out.view(-1), flat, group=info.group)
    else:  # older torch: the same buffer, filled row by row
        dist.all_gather(list(out.unbind()), flat, group=info.group)
    return out.view(info.world_size, *tensor.shape)


def barrier(info: DistInfo) -> None:
    if info.group is not None:
        dist.barrier(group=info.group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _to_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _byte_tensor(payload: bytes, width: int, device: torch.device) -> torch.Tensor:
    """`payload` as a [width] uint8 tensor, zero-padded."""
    out = torch.zeros(width, dtype=torch.uint8)
    if payload:
        out[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out.to(device)
