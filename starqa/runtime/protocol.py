"""The launcher ↔ worker protocol: the job a launcher hands its workers, and the events they
send back, as frozen dataclasses with one codec.

Jobs. A launcher builds one job: `IngestJob` (Phase 1, `starqa.launchers.ingest`), `AskJob`
(one question, `starqa.launchers.ask`) or `ServeJob` (a warm group, `starqa.launchers.ask`).
`starqa.runtime.launch.run_workers` writes it with `encode_job` to `job.json` in the run's
temporary folder and starts `torch.distributed.run ... -m starqa.workers.worker job.json`;
each rank reads it back with `decode_job` (`starqa.workers.worker.main`) and runs its
phase. A cold ask's head start (`starqa.coldstart.headstart`) receives the same text as one
line on a pipe. On disk a job is a JSON object: its fields, by name, plus `"phase"`
(`"ingest"`, `"ask"` or `"serve"`) naming its class; tuples are JSON lists, a nested job
part (`IndexJob`, `ThenServe`) a JSON object.

Events. A worker reports to its launcher through its stdout: one line per event,
`EVENT_PREFIX` then a JSON object of the event's fields plus `"event"` naming its kind
(`emit` writes it, `read_event` reads one back; any other line is what the worker printed
on its own, kept for an error report). Lines are short, so concurrent ranks never
interleave one. What each phase sends, in order:

- ingest: `Hit` (every machine holds the context already; nothing else follows) or
  `Ready` per rank, then `Block` per block written (and `IndexBuilt` per block with
  top-k indexes), `Measure` (a bench), `Placed` (across machines: each machine's
  lead), `Peak`;
- ask: `Ready` per rank, `Token` per answer token and then `Done` (the query host),
  `Measure` (a bench), `Peak`;
- serve: `Ready` per rank (with the group's shape), then nothing until the group stops
  (questions come over the socket, `starqa.workers.server`);
- a head start that goes on as the warm group: `Serving`, as it leaves the command;
- any phase: `Error`, a failure the worker could explain (the launcher raises it; a
  worker that dies without one is reported with the tail of its own lines).

The codec: `encode` turns a job or event into its JSON object; `decode` checks an object
against a class, field by field (a missing, unknown or mistyped field raises
`ProtocolError` naming it) and converts JSON lists back to tuples.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from starqa.core.errors import StarqaError

EVENT_PREFIX = "@@starqa "


class ProtocolError(StarqaError):
    """A job or event that does not have the fields its class names, of their types."""


# ------------------------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class IndexJob:
    """Top-k attention's indexes Phase 1 builds beside the blocks (`starqa.topk.indexes`):
    the index kind and the staging sub-folder they go to."""

    kind: str
    folder: str


@dataclass(frozen=True)
class IngestJob:
    """Phase 1 on every rank: encode this rank's share of blocks `todo` of the context
    whose token ids are in `tokens_file`, and write them into `staging`."""

    PHASE: ClassVar[str] = "ingest"
    model_path: str
    dtype: str  # the cache's (torch's name)
    compute_dtype: str  # what the model computes in (`models.phase1_dtype`)
    method: dict  # methods.MethodConfig.as_dict()
    blocks: tuple[tuple[int, int], ...]  # every block's [start, end) token range
    todo: tuple[int, ...]  # the blocks to encode (an incremental ingest: fewer)
    staging: str
    tokens_file: str  # safetensors: "ids", int32 [n]
    measure: bool = False  # report a `Measure` event (starqa bench)
    prepared: dict | None = None  # the method's `prepare` result (pulsar: the summaries)
    index: IndexJob | None = None
    across: bool = False  # machines that keep their own blocks (starqa.cache.hosts)
    hit: bool = False  # this machine holds the context already (across machines)
    device: str = "auto"
    kv: str = "float"  # the KV's precision as saved (starqa.cache.manifest.KV_KINDS)


@dataclass(frozen=True)
class ThenServe:
    """A cold ask's keep-alive settings: the head start, once it has answered, goes on as
    the context's warm group with them (`starqa.coldstart.headstart`)."""

    keepalive: float
    workers: int | None = None
    weights: str | None = None
    topk: dict | None = None  # starqa.topk.indexes.TopK.as_dict(); None: exact


@dataclass(frozen=True)
class AskJob:
    """Phase 2 for one question on every rank: load this rank's shards of the context in
    `context_dir`, answer `query_ids`; the query host streams the tokens."""

    PHASE: ClassVar[str] = "ask"
    model_path: str
    dtype: str
    context_dir: str
    query_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    weights: str = "dense"  # Phase 2 weight format (models.WEIGHT_FORMATS)
    topk: dict | None = None  # starqa.topk.indexes.TopK.as_dict(); None: exact
    measure: bool = False  # report a `Measure` event (starqa bench)
    device: str = "auto"
    then_serve: ThenServe | None = None  # a head start only


@dataclass(frozen=True)
class ServeJob:
    """A warm group on every rank: load this rank's shards of the context in `context_dir`
    and answer questions from the socket the query host listens on."""

    PHASE: ClassVar[str] = "serve"
    model_path: str
    dtype: str
    context_dir: str
    socket: str
    keepalive: float  # idle seconds before the group exits; <= 0: never
    weights: str = "dense"
    topk: dict | None = None
    # a cold ask's head start going on as the group listens at once; transformers'
    # tokenizer (conversation history) loads at the first question that needs it
    lazy_tokenizer: bool = False
    device: str = "auto"


Job = Union[IngestJob, AskJob, ServeJob]
JOBS: dict[str, type] = {cls.PHASE: cls for cls in (IngestJob, AskJob, ServeJob)}


def encode_job(job: Job) -> str:
    """The job as the JSON text a worker reads (`job.json`, or a head start's pipe line)."""
    return json.dumps({"phase": job.PHASE, **encode(job)})


def decode_job(text: str) -> Job:
    """The job `encode_job` wrote; ProtocolError naming what is wrong with any other text."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ProtocolError(f"A worker job that is not JSON ({err}).") from None
    return decode_tagged(data, "phase", JOBS, "job")


# ---------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Ready:
    """A rank has loaded its model (and, in Phase 2, its shards): `blocks` are its own.
    A serve group's ranks say where the group runs too."""

    KIND: ClassVar[str] = "ready"
    rank: int
    blocks: tuple[int, ...] = ()
    query_host: bool = False  # this rank holds the last block and the socket
    world: int = 1  # ranks in the group
    nodes: int = 1  # machines in the group
    node: int = 0  # this rank's machine
    query: str | None = None  # the query host's machine, described (across machines)


@dataclass(frozen=True)
class Block:
    """Block `index` is written: `tokens` more of the context encoded."""

    KIND: ClassVar[str] = "block"
    rank: int
    index: int
    tokens: int


@dataclass(frozen=True)
class IndexBuilt:
    """A block's top-k indexes are written, in `seconds`."""

    KIND: ClassVar[str] = "index"
    rank: int
    seconds: float


@dataclass(frozen=True)
class Hit:
    """Every machine of the group holds the context already: nothing is encoded."""

    KIND: ClassVar[str] = "hit"
    rank: int


@dataclass(frozen=True)
class Placed:
    """Which machine keeps which block, from each machine's lead after Phase 1 across
    machines (`starqa.cache.hosts.place_ingest`): what its launcher commits."""

    KIND: ClassVar[str] = "placement"
    node: int
    shared: bool  # one cache all machines share: node 0 commits every block
    held: tuple[int, ...]  # the blocks this machine keeps
    homes: tuple[int, ...]  # per block, the machine that keeps it
    hosts: tuple[str, ...]  # per machine, "host, address"
    sums: tuple[tuple[int, str], ...]  # per block, (bytes, sha256)


@dataclass(frozen=True)
class Measure:
    """This rank's numbers for `starqa bench`: seconds, tokens, FLOPs (Phase 1), bytes
    communicated (`dist.Traffic.as_dict`), by name."""

    KIND: ClassVar[str] = "measure"
    rank: int
    phase: str  # "ingest" or "ask"
    values: dict

    def row(self) -> dict:
        """The numbers as one flat record (what IngestResult/Answer.measures hold)."""
        return {"event": self.KIND, "rank": self.rank, "phase": self.phase, **self.values}


@dataclass(frozen=True)
class Peak:
    """This rank's peak memory in bytes, once its phase is done."""

    KIND: ClassVar[str] = "peak"
    rank: int
    bytes: int


@dataclass(frozen=True)
class Token:
    """One answer token, from the query host, as it is picked."""

    KIND: ClassVar[str] = "token"
    id: int


@dataclass(frozen=True)
class Done:
    """The answer is complete (the query host): its length, the question's prefill up to the
    first token and the decode after it, and the top sources (None under top-k)."""

    KIND: ClassVar[str] = "done"
    tokens: int
    prefill_s: float
    decode_s: float
    sources: tuple[dict, ...] | None = None
    before_torch: bool = False  # the first token came from the head start's early forward


@dataclass(frozen=True)
class Error:
    """A failure the worker explains: `kind` names the StarqaError class to raise."""

    KIND: ClassVar[str] = "error"
    rank: int
    kind: str
    message: str
    hint: str | None = None
    lost: bool = False  # it lost another machine (a consequence, not the cause)


@dataclass(frozen=True)
class Serving:
    """A head start has gone on as the context's warm group (process `pid`): it no longer
    writes to the command."""

    KIND: ClassVar[str] = "serving"
    pid: int


Event = Union[Ready, Block, IndexBuilt, Hit, Placed, Measure, Peak, Token, Done, Error,
              Serving]
EVENTS: dict[str, type] = {cls.KIND: cls for cls in typing.get_args(Event)}


def emit(event: Event) -> None:
    """One event line on stdout, for the launcher."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event.KIND, **encode(event)}) + "\n")
    sys.stdout.flush()


def read_event(line: str) -> Event | None:
    """The event of a worker's output line; None for any other line (what the worker printed
    on its own, or an event line cut by another writer's)."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        data = json.loads(line[len(EVENT_PREFIX):])
    except ValueError:
        return None
    return decode_tagged(data, "event", EVENTS, "event")


# ----------------------------------------------------------------------------------- codec


def encode(obj) -> dict:
    """A job's or event's fields as a JSON-able object (nested dataclasses as objects)."""
    return dataclasses.asdict(obj)


def decode(cls: type, data: Any, where: str | None = None):
    """`data` (a JSON object) as `cls`, every field checked against its annotation."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where} is not a JSON object: {_short(data)}.")
    fields = _fields(cls)
    if unknown := sorted(set(data) - set(fields)):
        raise ProtocolError(f"{where} has no field {unknown[0]!r}.")
    values = {}
    for name, (hint, required) in fields.items():
        if name in data:
            values[name] = _value(hint, data[name], f"{where}.{name}")
        elif required:
            raise ProtocolError(f"{where} lacks its field {name!r}.")
    return cls(**values)


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """Per field of dataclass `cls`: (its type, whether it has no default)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


def decode_tagged(data: Any, tag: str, classes: dict[str, type], what: str):
    """The dataclass `data[tag]` names (a key of `classes`), decoded from the rest of `data`."""
    if not isinstance(data, dict):
        raise ProtocolError(f"A {what} that is not a JSON object: {_short(data)}.")
    name = data.get(tag)
    if name not in classes:
        raise ProtocolError(f"A {what} whose {tag!r} is {_short(name)}: not one of "
                            f"{', '.join(classes)}.")
    return decode(classes[name], {k: v for k, v in data.items() if k != tag})


def _value(hint, value, where: str):
    """`value` checked against type `hint` (JSON lists become tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                return _value(option, value, where)
            except ProtocolError:
                continue
        raise _wrong(where, value, hint)
    if hint is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(hint):
        return decode(hint, value, where)
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            return _items(args, value, where)
    elif hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint in (int, str):
        if isinstance(value, hint) and not isinstance(value, bool):
            return value
    elif hint is bool:
        if isinstance(value, bool):
            return value
    raise _wrong(where, value, hint)


def _items(args: tuple, value: list | tuple, where: str) -> tuple:
    """A JSON list as the tuple `tuple[args]` names: `tuple[X, ...]` or `tuple[X, Y]`."""
    if len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    elif len(args) != len(value):
        raise ProtocolError(f"{where} has {len(value)} items, not {len(args)}.")
    return tuple(_value(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _wrong(where: str, value, hint) -> ProtocolError:
    name = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return ProtocolError(f"{where} is {_short(value)}, not {name or hint}.")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
