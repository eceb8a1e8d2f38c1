"""Distributed glue, and the only module that reads torchrun's environment.

Owns process-group set-up (workers leave with os._exit, see worker.main); every collective
takes the group explicitly and adds what it moved to the rank's `Traffic`.
CPU runs use gloo, CUDA runs nccl. A process started without torchrun is a world of one
with no process group, so the phases run unchanged in-process (tests, single worker).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from datetime import timedelta

import torch
import torch.distributed as dist

# Re-exported: Phase 2 loads each rank's shards by it.
from starqa.core.blocks import split_contiguous  # noqa: F401


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
class Peer:
    """Where one rank runs: its machine (torchrun's node rank), that machine's host name,
    and the address it reaches node 0 from (what gloo connects to)."""

    node: int
    host: str
    address: str

    def describe(self) -> str:
        return f"node {self.node} ({self.host}, {self.address})"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None  # None for a world of one
    traffic: Traffic = field(default_factory=Traffic, compare=False)  # this rank's, so far
    # Every rank's Peer, by rank (a world of one: empty, one machine)
    roster: tuple[Peer, ...] = field(default=(), compare=False)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def node(self) -> int:
        """This rank's machine (0 in a world of one)."""
        return self.roster[self.rank].node if self.roster else 0

    @property
    def nodes(self) -> list[int]:
        """The machines of the group, in order (node ranks)."""
        return sorted({p.node for p in self.roster}) or [0]

    def node_ranks(self, node: int) -> list[int]:
        """The ranks running on machine `node`, in order (its local ranks)."""
        return [r for r, p in enumerate(self.roster) if p.node == node] or [0]

    @property
    def lead(self) -> bool:
        """The first rank of its machine: the one that reads and writes the machine's files
        for the group (a machine's other ranks share its disk)."""
        return self.node_ranks(self.node)[0] == self.rank


def env_rank() -> int:
    """This process's rank in torchrun's group (`RANK`); 0 outside torchrun."""
    return int(os.environ.get("RANK", 0))


def init(device: str = "auto", timeout_s: float = 1800,
         on_lost: Callable[[str], None] | None = None) -> DistInfo:
    """Join the torchrun group (or make a world of one). Pins this worker's CPU threads.

    A group over several machines also starts `watch_peers` right after joining: should a
    worker of another machine stop beating, `on_lost` is called (from the watchdog's
    thread) with that machine described, once; it is expected not to return (a worker
    reports and leaves)."""
    rank = env_rank()
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
    info = DistInfo(rank, local_rank, world, dev, group)
    if group is None:
        return info
    me = Peer(int(os.environ.get("GROUP_RANK", 0)), socket.gethostname(), _own_address())
    if on_lost is not None and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
        watch_peers(rank, world, me, on_lost)
    roster = tuple(Peer(**p) for p in all_gather_object(info, me.__dict__))
    return DistInfo(rank, local_rank, world, dev, group, Traffic(), roster)  # roster: uncounted


# ---------------------------------------------------------------------------------------
# the heartbeat watchdog (issue #15, item 4)

BEAT_S = 1.0  # each worker beats this often
LOST_AFTER_S = 5.0  # a worker silent this long is lost (STARQA_LOST_AFTER overrides)


def watch_peers(rank: int, world: int, me: Peer, on_lost: Callable[[str], None],
                lost_after_s: float | None = None) -> threading.Thread:
    """A daemon thread that beats for this worker and watches every other one's beat.

    Through its own client of torchrun's TCPStore (MASTER_ADDR:MASTER_PORT, hosted by node
    0's torchrun agent), every `BEAT_S` it adds 1 to `beat/RANK` and reads every other
    rank's counter. A counter that has not moved for `lost_after_s` (a worker frozen, its
    machine powered off, the cable cut: nothing closed a connection, so gloo would wait
    for its timeout), or a store that stops answering (node 0 itself gone), calls
    `on_lost` with the machine described (`Peer.describe`, which each worker writes once as
    `peer/RANK`). Counters, not clocks: machines' clocks need not agree.
    Started right after the process group forms, when every rank has joined."""
    if lost_after_s is None:
        lost_after_s = float(os.environ.get("STARQA_LOST_AFTER", LOST_AFTER_S))
    prefix = (f"starqa-watch/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    timeout = timedelta(seconds=max(1.0, lost_after_s))
    store = dist.PrefixStore(prefix, dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500)),
        is_master=False, timeout=timeout, wait_for_workers=False))
    store.set(f"peer/{rank}", json.dumps(me.__dict__))
    store.add(f"beat/{rank}", 1)
    state = _Beats(rank, world, me)
    threading.Thread(target=state.beat, args=(store,), name="starqa-beat", daemon=True).start()
    thread = threading.Thread(target=state.watch, args=(lost_after_s, on_lost),
                              name="starqa-watchdog", daemon=True)
    thread.start()
    return thread


class _Beats:
    """What the beating thread last saw (store calls can hang on a frozen store host, so a
    second thread judges, from these times alone)."""

    def __init__(self, rank: int, world: int, me: Peer):
        self.rank, self.me = rank, me
        self.others = [r for r in range(world) if r != rank]
        self.described: dict[int, str] = {}  # rank → its machine ("" for this machine)
        self.ok = time.monotonic()  # the store last answered
        self.moved = {r: (0, self.ok) for r in self.others}  # rank → (count, when it moved)

    def beat(self, store) -> None:
        while True:
            try:
                store.add(f"beat/{self.rank}", 1)
                counts = {r: store.add(f"beat/{r}", 0) for r in self.others}  # 0: a read
                for r in self.others:
                    if r not in self.described and store.check([f"peer/{r}"]):
                        peer = Peer(**json.loads(store.get(f"peer/{r}")))
                        self.described[r] = peer.describe() if peer.node != self.me.node else ""
            except Exception:  # the store's host stopped answering: `watch` sees `ok` age
                time.sleep(BEAT_S)
                continue
            now = time.monotonic()
            self.ok = now
            for r, count in counts.items():
                if count != self.moved[r][0]:
                    self.moved[r] = (count, now)
            time.sleep(BEAT_S)

    def watch(self, lost_after_s: float, on_lost: Callable[[str], None]) -> None:
        while True:
            time.sleep(BEAT_S)
            now = time.monotonic()
            if now - self.ok > lost_after_s and self.me.node != 0:  # node 0 hosts the store
                zero = [d for d in self.described.values() if d.startswith("node 0 ")]
                on_lost(zero[0] if zero else
                        f"node 0 ({os.environ.get('MASTER_ADDR', '?')}, the rendezvous host)")
                return
            for r, (_, moved) in self.moved.items():
                # peers of this machine are torchrun's to watch (it sees their exit)
                if now - moved > lost_after_s and self.described.get(r, "-"):
                    on_lost(self.described.get(r, f"the worker of rank {r}"))
                    return


def _own_address() -> str:
    """The address this machine reaches node 0 (MASTER_ADDR) from: a UDP socket's local end
    after connect (no packet is sent)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(os.environ.get("MASTER_PORT", 29500))))
        return s.getsockname()[0]
    return "?"


def split_by_host(n_items: int, info: DistInfo) -> range:
    """This rank's contiguous share of `n_items`, split first between the machines (one
    contiguous range each, `split_contiguous` over the nodes), then between the ranks of
    each machine: what Phase 2 loads, so that each machine's share is what it keeps on its
    own disk. On one machine the same as `split_contiguous(n_items, world, rank)`."""
    nodes = info.nodes
    host = split_contiguous(n_items, len(nodes), nodes.index(info.node))
    ranks = info.node_ranks(info.node)
    mine = split_contiguous(len(host), len(ranks), ranks.index(info.rank))
    return host[mine.start:mine.stop]


_PEER = re.compile(r"\[?(\d+\.\d+\.\d+\.\d+)\]?:\d+")


def lost_peer(info: DistInfo, error: BaseException) -> str | None:
    """The machine a collective's failure names, described ("node 1 (host, 10.0.0.2)"),
    when the error is a lost connection (a peer that died or left) and the group spans
    machines, else None."""
    text = str(error)
    if not re.search(r"[Cc]onnection (closed|reset)|[Bb]roken pipe|peer|timed out|Timeout",
                     text):
        return None
    others = [p for p in info.roster if p.node != info.node]
    if not others:  # one machine: torchrun reports the worker that died, with its lines
        return None
    addresses = _PEER.findall(text)
    for address in addresses:
        if found := [p for p in others if p.address == address]:
            return found[0].describe()
    if len({p.node for p in others}) == 1:  # one other machine: it is the one
        return others[0].describe()
    return f"the worker at {addresses[0]}" if addresses else "another machine of the group"


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


def _padded(info: DistInfo, payload: bytes):
    """This rank's payload as a uint8 tensor padded to the longest rank's, and every rank's
    length (one all-gather of [1] int64, so every rank pads to the same size)."""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=info.device)
    lengths = _all_gather(info, length).view(-1).tolist()
    return _byte_tensor(payload, max(lengths), info.device), lengths


def gather_object(info: DistInfo, obj, dst: int) -> list | None:
    """Every rank's JSON-able `obj`, as a list on rank `dst` (None elsewhere).

    Sent as UTF-8 JSON in a uint8 tensor, never pickled: what arrives is parsed, not run.
    As JSON does, dict keys come back as strings (also in a world of one, so callers see
    the same values however many workers there are)."""
    payload = _to_json(obj)
    if info.group is None:
        return [json.loads(payload)]
    mine, lengths = _padded(info, payload)
    width = mine.numel()
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


def all_gather_object(info: DistInfo, obj) -> list:
    """Every rank's JSON-able `obj`, as a list by rank, on every rank (UTF-8 JSON in byte
    tensors, never pickled; dict keys come back as strings)."""
    payload = _to_json(obj)
    if info.group is None:
        return [json.loads(payload)]
    mine, lengths = _padded(info, payload)
    rows = _all_gather(info, mine)
    info.traffic.add("all_gather_object", len(payload) * (info.world_size - 1),
                     sum(n for r, n in enumerate(lengths) if r != info.rank))
    return [json.loads(row[:n].cpu().numpy().tobytes()) for row, n in zip(rows, lengths)]


# ---------------------------------------------------------------------------------------
# files between machines (per-host shards, issue #15)


def move_files(info: DistInfo, folder: Path, have: dict[str, str], want: list[str],
               shared: bool = False) -> dict[str, list[int]]:
    """Every machine's lead rank ends with the files it `want`s in its `folder`: each one
    it lacks comes from the first machine that has it (`have`: name → sha256), sent over
    the group (gloo/nccl point-to-point, length then bytes) and checked against that
    sha256, or, `shared` (one file system for all), linked from that machine's folder.
    Written as a temp file and renamed, so a folder never holds half a file.

    Every rank calls it together; only lead ranks' `have` and `want` count (the others
    pass {} and []). Returns name → the nodes holding it before any move. A wanted file
    no machine has is not moved (the caller sees it missing from the result) and nothing
    moves at all then, so every rank can raise the same error."""
    mine = {"node": info.node, "folder": str(folder), "have": have if info.lead else {},
            "want": sorted(want) if info.lead else []}
    table = all_gather_object(info, mine)
    holders: dict[str, list[int]] = {}
    for entry in table:
        for name in entry["have"]:
            holders.setdefault(name, []).append(entry["node"])
    wanted = sorted({n for entry in table for n in entry["want"]})
    if any(name not in holders for name in wanted):
        return holders
    for name in wanted:
        sender = next(r for r, e in enumerate(table) if name in e["have"])
        sha = table[sender]["have"][name]
        receivers = [r for r, e in enumerate(table) if name in e["want"] and name not in e["have"]]
        if info.rank == sender and not shared:
            data = Path(folder, name).read_bytes()
            for receiver in receivers:
                send_bytes(info, data, receiver)
        elif info.rank in receivers:
            data = None if shared else recv_bytes(info, sender)
            _write_checked(Path(folder, name), data, Path(table[sender]["folder"], name), sha)
    return holders


def _write_checked(path: Path, data: bytes | None, source: Path, sha256: str) -> None:
    """`data` (or, None, a copy of `source`) as `path`, if it hashes to `sha256`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if data is None:
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
            data = tmp.read_bytes()
        else:
            tmp.write_bytes(data)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise OSError(f"{path.name} arrived damaged (its sha256 differs from the sender's)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def send_bytes(info: DistInfo, data: bytes, dst: int) -> None:
    """`data` to rank `dst` (which calls `recv_bytes`): its length, then the bytes."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=info.device), dst=dst,
              group=info.group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(info.device),
                  dst=dst, group=info.group)
    info.traffic.add("send_bytes", len(data), 0)


def recv_bytes(info: DistInfo, src: int) -> bytes:
    """The bytes rank `src` sends with `send_bytes`."""
    length = torch.zeros(1, dtype=torch.int64, device=info.device)
    dist.recv(length, src=src, group=info.group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=info.device)
    if data.numel():
        dist.recv(data, src=src, group=info.group)
    info.traffic.add("send_bytes", 0, data.numel())
    return data.cpu().numpy().tobytes()


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
