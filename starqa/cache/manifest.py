"""A context's manifest: its typed, frozen schema, and its one reader and one writer.

Every context folder holds `manifest.json` beside its shards (see `starqa.cache.shards`):

    format 4, key, name, created, sources, command,
    model           the model's identity (`ModelIdentity`: path, spec, window, fingerprint)
    reserve         tokens `ingest` kept free to ask (absent in older manifests)
    dtype, method   the cache's dtype and the method's settings (`methods.MethodConfig`)
    kv              the KV's precision (`KV_KINDS`): "float", in `dtype` (absent in older
                    manifests: the same), or "int8", rows with fp32 scales (`cache.shards`)
    content_sha256, n_tokens, query_position,
    query_template  how `ask` tokenises a question without transformers (absent in older ones)
    blocks          one `Block` per shard: token range, file, size, sha256
    files, skipped  the files packed (`PackedFile`: token span, line starts) and those left out
    ingest          how the encoding ran (`IngestRun`)
    indexes         top-k attention's vector indexes (`IndexSet`; absent: none built)
    placement       a context made across machines without a shared file system: which
                    blocks this machine keeps, and which machine keeps each (`Placement`;
                    absent: every block is here)

`write_manifest` writes exactly this JSON, in this order, atomically; `read_manifest` reads
it back and refuses (ShardError naming the file, the problem and the rebuild command) a
manifest that is missing, not JSON, of another format, or missing or mistyping a field. Keys
this starqa does not know are ignored. The folder a manifest lives in is not part of it:
`Manifest.folder` carries it (None for a manifest not read from disk).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from starqa.core.errors import ShardError, StarqaError
from starqa import methods
from starqa.methods import ContextBias, MethodConfig

MANIFEST = "manifest.json"
FORMAT = 4  # 2: files carry line_tokens (sources); 3: query_position; 4: blocks hold token ids

_NOT_JSON = {"json": False}  # field metadata: not written to (or read from) the file


# A cache's KV precision: "float", in the cache's dtype; "int8", each row of D keys or values
# int8 with an fp32 scale (starqa.attention.kvint8): about half the bytes
KV_KINDS = ("float", "int8")


def kv_bytes_per_token(layers: int, kv_heads: int, dim: int, kv: str,
                       float_bytes: int = 2) -> int:
    """Bytes of KV one token takes in a cache of KV precision `kv`: keys and values of every
    layer and KV head; int8 rows carry a 4-byte scale each. (Qwen2.5-Coder-1.5B: 28 layers,
    2 KV heads of 128: bf16 28,672; int8 14,784.)"""
    row = dim + 4 if kv == "int8" else dim * float_bytes
    return layers * kv_heads * 2 * row


def kv_tag(dtype: str, kv: str) -> str:
    """What cache keys and block addresses hash for a cache's dtype and KV precision: the
    dtype alone for float KV (the keys of every context made before int8 KV), else
    "dtype+kv", so blocks of two precisions never share a name."""
    return dtype if kv == "float" else f"{dtype}+{kv}"


def block_file(index: int) -> str:
    """The shard file of block `index`, the only name a manifest's block may give."""
    return f"block_{index:05d}.safetensors"


INDEX_FOLDER = re.compile(r"index-[a-z]+-[0-9a-f]{8}")  # an IndexSet's folder, nothing else


def index_file(block: int, layer: int, head: int) -> str:
    """The faiss file of (block, layer, KV head) inside its IndexSet's folder."""
    return f"block_{block:05d}.l{layer:03d}.h{head:02d}.faiss"


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """The model a context was encoded with: where it was, how it was named on the command
    line (`spec`), its trained window and its fingerprint (`models.fingerprint`)."""

    path: str
    spec: str
    window: int
    name: str
    config_sha256: str
    weights_sha256: str
    tokenizer_sha256: str
    digest: str  # of the three hashes: the identity a cache key uses

    @classmethod
    def of(cls, path: Path, spec: str, window: int, fingerprint: dict[str, str]) -> ModelIdentity:
        return cls(path=str(path), spec=spec, window=window, **fingerprint)


@dataclass(frozen=True, kw_only=True)
class Block:
    """One shard: tokens [start, end) of the context, in `file`, of `bytes` and `sha256`."""

    index: int
    start: int
    end: int
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class PackedFile:
    """A file as the context holds it (read, it was a `corpus.TextFile`): its tokens
    [token_start, token_end) and the token each line starts at."""

    path: str
    token_start: int
    token_end: int
    lines: int
    bytes: int
    line_tokens: tuple[int, ...]
    sha256: str | None = None  # of the file's text: what a re-ingest compares (issue #14)


@dataclass(frozen=True, kw_only=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class IngestRun:
    workers: int
    encode_seconds: float
    tokens_per_second: float

    @classmethod
    def timed(cls, workers: int, encode_seconds: float, n_tokens: int) -> IngestRun:
        return cls(workers=workers, encode_seconds=round(encode_seconds, 3),
                   tokens_per_second=round(n_tokens / max(encode_seconds, 1e-9), 1))


@dataclass(frozen=True, kw_only=True)
class IndexFile:
    """One faiss index: the keys of (block, layer, KV head), in `file` of its set's folder."""

    block: int
    layer: int
    head: int
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class IndexSet:
    """Every block's indexes of one kind (`starqa.topk.indexes`), in `folder` of the context."""

    kind: str
    folder: str
    params: dict
    build_seconds: float
    files: tuple[IndexFile, ...]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the blocks of a context encoded across machines live (issue #15): every
    machine of the ingest commits the same plan and checksums (`Manifest.blocks`) and keeps
    the files of `held` only, in its own `$STARQA_HOME`."""

    nodes: int  # machines of the ingest
    node: int  # this machine's node rank
    held: tuple[int, ...]  # the blocks whose files are in this folder
    homes: tuple[int, ...]  # per block, the node that kept it at ingest
    hosts: tuple[str, ...]  # per node, "host (address)" as the group saw it

    def where(self, indices) -> str:
        """Which machines of the ingest keep blocks `indices`: "blocks 2-3 on node 1 (b,
        10.77.0.2)"."""
        by_node: dict[int, list[int]] = {}
        for i in indices:
            by_node.setdefault(self.homes[i], []).append(i)
        return "; ".join(f"{_span(blocks)} on node {node} ({self.hosts[node]})"
                         for node, blocks in sorted(by_node.items()))


def _span(blocks: list[int]) -> str:
    if len(blocks) == 1:
        return f"block {blocks[0]}"
    if blocks == list(range(blocks[0], blocks[-1] + 1)):
        return f"blocks {blocks[0]}-{blocks[-1]}"
    return "blocks " + ", ".join(map(str, blocks))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A context's manifest; fields in the order of the file."""

    key: str  # the context's folder name: a hash of content, model, method, dtype, prompt
    name: str
    created: float
    sources: tuple[str, ...]
    command: str  # how it was made, pasteable: the hint that rebuilds it
    model: ModelIdentity
    reserve: int | None = None
    dtype: str
    kv: str = "float"
    method: MethodConfig
    content_sha256: str
    n_tokens: int
    query_position: int
    query_template: dict | None = None
    blocks: tuple[Block, ...]
    files: tuple[PackedFile, ...]
    skipped: tuple[Skipped, ...]
    ingest: IngestRun
    indexes: tuple[IndexSet, ...] = ()
    placement: Placement | None = None
    folder: Path | None = field(default=None, compare=False, metadata=_NOT_JSON)
    # Optional keys the file lacked (older format-3 manifests): left out when written back,
    # so a rewrite (a rename) changes nothing else.
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False,
                                   metadata=_NOT_JSON)

    @property
    def past_window(self) -> bool:
        """Built with `--beyond-window`: the question's positions start where they leave less
        than the reserve (older manifests: not one token) of the model's window for a
        question and an answer, so only `ask --beyond-window` answers from it. (A context
        encoded at contiguous positions may hold many windows of tokens, and not be past.)"""
        return self.query_position + max(self.reserve or 0, 1) > self.model.window

    @property
    def context_bias(self) -> ContextBias:
        """What Phase 2 adds to the context keys' scores where the blocks share positions
        (`methods.ContextBias`: none where they do not, nor on the keys before the shared
        positions)."""
        return ContextBias.of(self.n_tokens, self.query_position,
                              methods.get(self.method.name).shared_from(self.method))

    @property
    def local_blocks(self) -> tuple[int, ...]:
        """The blocks whose files this folder holds: all of them, unless the context was
        made across machines that keep their own (`placement`)."""
        if self.placement is None:
            return tuple(range(len(self.blocks)))
        return self.placement.held

    @property
    def rerun(self) -> str:
        """The pasteable command that rebuilds this context (`rerun_command`)."""
        return rerun_command(self.command, self.sources) or "starqa ingest PATH"

    def to_json(self) -> dict[str, Any]:
        """The manifest as `manifest.json` holds it (without its folder)."""
        data = {"format": FORMAT, **_to_json(self)}
        for key in self.absent | {"placement"}:  # placement: only where there is one
            if data.get(key) is None or data[key] == _default_json(key):
                data.pop(key, None)
        return data


def _default_json(name: str) -> Any:
    """A Manifest field's default as JSON (MISSING where it has none)."""
    found = next(f for f in fields(Manifest) if f.name == name)
    return MISSING if found.default is MISSING else _to_json(found.default)


# ---------------------------------------------------------------------------------------
# writer


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file (synced) and a rename, so a
    reader, or the next start after a crash, sees the old file or the new one, never half of
    one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(json.dumps(data, indent=1, sort_keys=False))
            fh.flush()
            os.fsync(fh.fileno())  # on disk before the rename, so a crash never leaves it empty
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written temporary left beside `path`
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(folder: Path, manifest: Manifest) -> Manifest:
    """Write `manifest` as `folder/manifest.json` (atomically); returns it, with its folder.
    A manifest the reader would refuse is never written (ValueError)."""
    data = manifest.to_json()
    try:
        _check(data)
    except _Damage as damage:
        raise ValueError(f"refusing to write a bad manifest to {folder}: {damage}") from None
    write_json_atomic(folder / MANIFEST, data)
    return replace(manifest, folder=folder)


# ---------------------------------------------------------------------------------------
# reader


def read_manifest(folder: Path) -> Manifest:
    """The manifest of the context in `folder`, every field checked; ShardError naming the
    file and what is wrong otherwise, with the commands that rebuild the context."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path} is missing", hint=_rebuild_hint(folder, None)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardError(f"{path} is not valid JSON ({err})",
                         hint=_rebuild_hint(folder, None)) from None
    except OSError as err:
        raise ShardError(f"{path} cannot be read ({err.strerror})",
                         hint=_rebuild_hint(folder, None)) from None
    if not isinstance(data, dict):
        raise ShardError(f"{path} is not a JSON object (it is {type(data).__name__})",
                         hint=_rebuild_hint(folder, None))
    if data.get("format") != FORMAT:
        raise ShardError(f"{path} was written by an incompatible starqa (format "
                         f"{data.get('format')!r}, expected {FORMAT})",
                         hint=_rebuild_hint(folder, data))
    try:
        manifest = _check(data)
        if manifest.key != folder.name:
            raise _Damage(f"its key {manifest.key!r} is not its folder's name")
    except _Damage as damage:
        raise ShardError(f"{path} is damaged: {damage}", hint=_rebuild_hint(folder, data)) from None
    absent = frozenset(f.name for f in fields(Manifest) if f.name not in data
                       and f.metadata.get("json", True))
    return replace(manifest, folder=folder, absent=absent)


class _Damage(Exception):
    """What makes a manifest's JSON unusable (a missing or mistyped field, a bad shard name)."""


def _check(data: dict) -> Manifest:
    """The Manifest `data` holds; _Damage naming the first problem otherwise."""
    manifest = _from_json(Manifest, data, "")
    for i, block in enumerate(manifest.blocks):
        if block.index != i or block.file != block_file(i):  # never a path elsewhere
            raise _Damage(f"blocks[{i}] names {block.file!r}, not {block_file(i)!r}")
    _check_numbers(manifest)
    for i, found in enumerate(manifest.indexes):
        if not INDEX_FOLDER.fullmatch(found.folder) or not found.folder.startswith(
                f"index-{found.kind}-"):
            raise _Damage(f"indexes[{i}] names the folder {found.folder!r}")
        for entry in found.files:
            if entry.file != index_file(entry.block, entry.layer, entry.head):
                raise _Damage(f"indexes[{i}] names the file {entry.file!r}")
    if (where := manifest.placement) is not None:
        n = len(manifest.blocks)
        if len(where.homes) != n or any(not 0 <= i < n for i in where.held) or \
                not 0 <= where.node < where.nodes or len(where.hosts) != where.nodes or \
                any(not 0 <= h < where.nodes for h in where.homes):
            raise _Damage("placement does not fit its blocks and nodes")
    return manifest


def _check_numbers(manifest: Manifest) -> None:
    """The manifest's numbers agree with each other (_Damage naming the first that does
    not): the blocks cut tokens 0..n_tokens in order, each at least one token; the query
    position is where the method puts it (`Method.query_bounds`); every file's tokens and
    line starts lie inside the context; sizes are not negative. Phase 2 trusts them all:
    a wrong one answers garbage, never an error."""
    n, method = manifest.n_tokens, manifest.method
    if n < 1 or not manifest.blocks:
        raise _Damage(f"it holds {n} tokens in {len(manifest.blocks)} blocks")
    at = 0
    for block in manifest.blocks:
        if block.start != at or block.end <= block.start or block.bytes < 0:
            raise _Damage(f"blocks[{block.index}] holds tokens {block.start}-{block.end}, "
                          f"not from {at} on (the blocks cut the context in order)")
        at = block.end
    if at != n:
        raise _Damage(f"its blocks end at token {at}, its n_tokens is {n}")
    if method.block_size < 1 or method.anchor_size < 0:
        raise _Damage(f"its method's block size {method.block_size} or anchor "
                      f"{method.anchor_size} is impossible")
    try:
        low, high = methods.get(method.name).query_bounds(
            method, n, [(b.start, b.end) for b in manifest.blocks])
    except StarqaError as err:  # an unknown method
        raise _Damage(str(err)) from None
    if not low <= manifest.query_position <= high:
        where = f"{low}" if low == high else f"between {low} and {high}"
        raise _Damage(f"its query_position {manifest.query_position} is not {where} "
                      f"({method.name} over {n} tokens)")
    for i, file in enumerate(manifest.files):
        if not 0 <= file.token_start <= file.token_end <= n or any(
                not file.token_start <= t <= file.token_end for t in file.line_tokens):
            raise _Damage(f"files[{i}] ({file.path!r}) lies outside tokens 0-{n}")
    if manifest.kv not in KV_KINDS:
        raise _Damage(f"its kv {manifest.kv!r} is not one of {', '.join(KV_KINDS)}")
    if (manifest.reserve or 0) < 0 or manifest.model.window < 1:
        raise _Damage(f"its reserve {manifest.reserve} or window {manifest.model.window} "
                      "is impossible")


def _rebuild_hint(folder: Path, data: dict | None) -> str:
    """Commands that remove the context and rebuild it, pasteable: its recorded command
    (which starts with a `cd` to where it ran), else an ingest of its recorded sources."""
    remove = f"starqa rm {shlex.quote(folder.name)}"
    data = data or {}
    command = rerun_command(data.get("command"), data.get("sources"))
    if command is not None:
        return f"remove it and re-ingest: {remove} && {command}"
    return f"remove it ({remove}) and ingest the sources it was made from again: starqa ingest PATH"


_OPERATOR = frozenset("();<>|&")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def rerun_command(command: Any, sources: Any) -> str | None:
    """The command that rebuilds a context, rebuilt word by word from what its manifest
    records, never its stored text echoed (a manifest is data, and hints are pasted into a
    shell): a recorded `cd DIR && starqa ingest ARGS` (what `starqa ingest` writes) or
    `starqa ingest ARGS`, each word quoted again; else `starqa ingest SOURCES`; None when
    neither is usable. A recorded command of any other shape (a pipe, a `;`, a second
    command, a control character: an edited manifest) is never repeated."""
    words = _ingest_words(command)
    if words is not None:
        cd, args = words
        line = "starqa ingest " + shlex.join(args)
        return line if cd is None else f"cd {shlex.quote(cd)} && {line}"
    if isinstance(sources, (list, tuple)) and sources and \
            all(isinstance(s, str) and s for s in sources):
        return "starqa ingest " + shlex.join(sources)
    return None


def _ingest_words(command: Any) -> tuple[str | None, list[str]] | None:
    """(the folder of its `cd`, or None; the words after `starqa ingest`) of a recorded
    command; None unless it is exactly one ingest, after at most one `cd DIR &&`."""
    if not isinstance(command, str) or _CONTROL.search(command):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote
        return None
    cd = None
    if words[:1] == ["cd"] and words[2:3] == ["&&"]:
        cd, words = words[1], words[3:]
    if words[:2] != ["starqa", "ingest"] or \
            any(word and set(word) <= _OPERATOR for word in [cd or "", *words]):
        return None
    return cd, words[2:]


# ---------------------------------------------------------------------------------------
# the mapping between the dataclasses and JSON, from their field types


def _to_json(record: Any) -> Any:
    if isinstance(record, MethodConfig):
        return record.as_dict()
    if is_dataclass(record):
        return {f.name: _to_json(getattr(record, f.name)) for f in fields(record)
                if f.metadata.get("json", True)}
    if isinstance(record, tuple):
        return [_to_json(item) for item in record]
    return record


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_json(cls: type, data: Any, where: str) -> Any:
    """An instance of the dataclass `cls` from the JSON object `data`, every field of it
    present and of its type (a field with a default may be absent); `where` prefixes the
    field names in messages ("blocks[2].")."""
    if not isinstance(data, dict):
        raise _Damage(f"{where.rstrip('.') or 'the manifest'} is not an object")
    values = {}
    for f in fields(cls):
        if not f.metadata.get("json", True):
            continue
        if f.name not in data and (f.default is not MISSING or f.default_factory is not MISSING):
            continue
        values[f.name] = _value(_types(cls)[f.name], data.get(f.name), where + f.name)
    return cls(**values)


_NAMES = {str: "str", int: "int", float: "number", dict: "dict", list: "list"}


def _value(kind: Any, value: Any, where: str) -> Any:
    args = typing.get_args(kind)
    if type(None) in args:  # `T | None`: null, or a T
        return None if value is None else _value(args[0], value, where)
    if typing.get_origin(kind) is tuple:  # `tuple[T, ...]`: a JSON list
        if not isinstance(value, list):
            raise _Damage(f"{where} is missing or not a list")
        if args[0] in _NAMES:  # plain values (line_tokens: thousands): one pass
            if all(_is(args[0], item) for item in value):
                return tuple(value)
            bad = next(i for i, item in enumerate(value) if not _is(args[0], item))
            raise _Damage(f"{where}[{bad}] is not a {_NAMES[args[0]]}")
        return tuple(_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if is_dataclass(kind):
        return _from_json(kind, value, where + ".")
    if not _is(kind, value):
        raise _Damage(f"{where} is missing or not a {_NAMES[kind]}")
    return value


def _is(kind: type, value: Any) -> bool:
    """`value` is a JSON value of `kind` (a number for float; never a bool for a number)."""
    return isinstance(value, (int, float) if kind is float else kind) \
        and not isinstance(value, bool)
