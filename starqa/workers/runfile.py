"""A warm group's run file, `$STARQA_HOME/run/<key>.json`: what `ps`, `stop`, `ask` and `chat`
know of a group without asking it. The launcher writes it (`starqa.launchers.serve`) once
this machine's workers are ready and removes it when the group ends; `starqa.workers.client`
reads it. A group across machines has one on each machine; only the query host's names a
socket.

On disk a `RunInfo` is a JSON object of its fields (those of a group across machines only
when it is one), read back field by field with `starqa.runtime.protocol`'s codec: a file
with a required field missing, or any field unknown or mistyped, is not one this starqa
wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from starqa.runtime.protocol import decode, encode

ACROSS = ("node", "nodes", "query")  # the fields of a group across machines


@dataclass(frozen=True)
class RunInfo:
    """One warm group, as this machine runs it: the context it serves (`key`, `name`, its
    `tokens` and Phase 1 `method`), the launcher's `pid`, its `workers` (across machines:
    the whole group's), the query host's `socket` (None: this machine runs a part of a group
    served from another, `query`), when it `started` and its `keepalive` (idle seconds
    before it exits; <= 0: never), its Phase 2 `weights` and top-k settings (`topk`; None:
    exact attention), and what `client.follow` restarts it with after a re-ingest."""

    key: str
    name: str
    pid: int
    workers: int
    socket: str | None
    started: float
    keepalive: float
    tokens: int | None = None  # (None: a run file of an earlier starqa, which did not say)
    weights: str | None = None
    method: str | None = None
    topk: dict | None = None  # starqa.topk.indexes.TopK.as_dict()
    requested_workers: int | None = None  # --workers as given (None: chosen)
    attention_args: tuple[str, ...] = ()  # the top-k options, as `serve` takes them
    node: int | None = None  # across machines: this machine's node rank,
    nodes: int | None = None  # how many machines,
    query: str | None = None  # and the query host, described

    @property
    def across(self) -> bool:
        """Whether the group runs across machines."""
        return bool(self.nodes)

    def as_dict(self) -> dict:
        """The run file's JSON object (`ps --json` shows it)."""
        data = encode(self)
        return data if self.across else {k: v for k, v in data.items() if k not in ACROSS}


def write(path: Path, info: RunInfo) -> None:
    """Write the run file whole (a temporary file renamed into place): a reader never sees
    half of one."""
    from starqa.cache.manifest import write_json_atomic

    write_json_atomic(path, info.as_dict())


def read(path: Path) -> RunInfo:
    """The run file at `path`; OSError when it cannot be read, ValueError (not JSON, or a
    group across machines that does not say where) or ProtocolError (a field missing,
    unknown or mistyped) when it is not a run file this starqa wrote."""
    data = json.loads(path.read_text())
    info = decode(RunInfo, data, "run file")
    if info.across and any(getattr(info, name) is None for name in ACROSS):
        raise ValueError(f"{path}: a group across machines without {', '.join(ACROSS)}")
    return info


def with_status(info: RunInfo, status) -> dict:
    """The run file's object with what the group says of itself now (a `GroupStatus`, or
    None where it did not answer): what `starqa ps` shows of each group."""
    return info.as_dict() | ({} if status is None else encode(status))
