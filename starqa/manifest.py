"""A context's manifest.json: its one writer and its one reader, which checks every field
the commands use (a damaged manifest is named, never half-read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from starqa.errors import ShardError

MANIFEST = "manifest.json"
FORMAT = 3  # 2: files carry line_tokens (sources); 3: query_position


def block_file(index: int) -> str:
    return f"block_{index:05d}.safetensors"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write `manifest` as `folder/manifest.json`, atomically (its `_dir` left out)."""
    write_json_atomic(folder / MANIFEST, {k: v for k, v in manifest.items() if k != "_dir"})


# The fields every command relies on, with their types: a manifest missing one, or of the
# wrong shape, is damaged (one bad context must never crash `list` or `ask` for the others).
_FIELDS = {"key": str, "name": str, "created": (int, float), "sources": list, "command": str,
           "model": dict, "dtype": str, "method": dict, "n_tokens": int, "query_position": int,
           "blocks": list, "files": list, "skipped": list}
_MODEL_FIELDS = {"name": str, "digest": str, "path": str, "spec": str, "window": int}
_METHOD_FIELDS = {"name": str, "block_size": int, "anchor_size": int}
_BLOCK_FIELDS = {"index": int, "start": int, "end": int, "file": str, "bytes": int,
                 "sha256": str}
_FILE_FIELDS = {"path": str, "token_start": int, "token_end": int, "lines": int, "bytes": int}
_SKIPPED_FIELDS = {"path": str, "reason": str}


def read_manifest(folder: Path) -> dict:
    """The manifest of the context in `folder`, checked for every field the commands use;
    ShardError naming what is wrong otherwise."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ShardError(f"{folder} has no {MANIFEST}", hint=_remove_hint(folder)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardError(f"{folder / MANIFEST} is not valid JSON ({err})",
                         hint=_remove_hint(folder)) from None
    except OSError as err:
        raise ShardError(f"{folder / MANIFEST} cannot be read ({err.strerror})",
                         hint=_remove_hint(folder)) from None
    if not isinstance(manifest, dict):
        raise ShardError(f"{folder / MANIFEST} is not a JSON object (it is "
                         f"{type(manifest).__name__})", hint=_remove_hint(folder))
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{folder} was written by an incompatible starqa (format "
                         f"{manifest.get('format')!r}, expected {FORMAT})",
                         hint=_remove_hint(folder))
    if problem := _manifest_problem(manifest, folder.name):
        raise ShardError(f"{folder / MANIFEST} is damaged: {problem}", hint=_remove_hint(folder))
    manifest["_dir"] = str(folder)
    return manifest


def _manifest_problem(manifest: dict, key: str) -> str | None:
    """What makes a manifest unusable (a missing or mistyped field, a shard name that is not
    the block's own), or None."""
    checks = [("", manifest, _FIELDS), ("model.", manifest.get("model"), _MODEL_FIELDS),
              ("method.", manifest.get("method"), _METHOD_FIELDS)]
    for list_name, fields in (("blocks", _BLOCK_FIELDS), ("files", _FILE_FIELDS),
                              ("skipped", _SKIPPED_FIELDS)):
        items = manifest.get(list_name)
        checks += [(f"{list_name}[{i}].", item, fields)
                   for i, item in enumerate(items if isinstance(items, list) else [])]
    for where, part, fields in checks:
        if not isinstance(part, dict):
            return f"{where.rstrip('.')} is not an object"
        for field, kind in fields.items():
            value = part.get(field)
            if not isinstance(value, kind) or isinstance(value, bool):
                return f"{where}{field} is missing or not a {getattr(kind, '__name__', 'number')}"
    if manifest["key"] != key:
        return f"its key {manifest['key']!r} is not its folder's name"
    for i, block in enumerate(manifest["blocks"]):
        if block["index"] != i or block["file"] != block_file(i):  # never a path elsewhere
            return f"blocks[{i}] names {block['file']!r}, not {block_file(i)!r}"
    return None


def _remove_hint(folder: Path) -> str:
    return (f"remove it (starqa rm {folder.name}, or starqa cache --clean) and re-ingest the "
            "sources it was made from: starqa ingest PATH")
