"""The shard store: one safetensors file per block, a JSON manifest, atomic commits.

Layout under `$STARQA_HOME/contexts/`:

    <key>/manifest.json             model fingerprint, method + settings, hashes, spans
    <key>/block_00000.safetensors   k, v: [L, Hkv, T, D] contiguous, RoPE applied
    .staging-<key>-<pid>/           a context being written (never read)

A context is written into a staging folder and renamed into place only when every shard
is there and hashed, so a crash or Ctrl-C mid-ingest leaves the previous cache intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from starqa.errors import ShardError, StarqaError

MANIFEST = "manifest.json"
FORMAT = 1


def block_file(index: int) -> str:
    return f"block_{index:05d}.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)


def staging_dir(root: Path, key: str, shared: bool = False) -> Path:
    """A fresh folder for this process's ingest, or (`shared`, a multi-machine ingest) the
    one folder every machine's workers write into."""
    if shared:
        path = root / f".staging-{key}-shared"
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = root / f".staging-{key}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def save_block(folder: Path, index: int, k, v, metadata: dict[str, str]) -> Path:
    """Write one block's KV ([L, Hkv, T, D] each) as safetensors; returns the file."""
    from safetensors.torch import save_file

    path = folder / block_file(index)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"k": k.contiguous(), "v": v.contiguous()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def commit(staging: Path, final: Path, manifest: dict) -> None:
    """Hash every block into the manifest, write it, and swap `staging` into `final`."""
    for block in manifest["blocks"]:
        path = staging / block["file"]
        if not path.exists():
            raise ShardError(f"worker did not write {block['file']}; nothing was cached")
        block["bytes"] = path.stat().st_size
        block["sha256"] = sha256_file(path)
    write_json_atomic(staging / MANIFEST, manifest)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ShardError(f"{folder} has no {MANIFEST}") from None
    except json.JSONDecodeError as err:
        raise ShardError(f"{folder / MANIFEST} is not valid JSON ({err})",
                         hint="re-ingest the sources it was made from: starqa ingest PATH") from None
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{folder} was written by an incompatible starqa (format "
                         f"{manifest.get('format')}, expected {FORMAT})", hint=_fix(manifest))
    manifest["_dir"] = str(folder)
    return manifest


def list_contexts(root: Path) -> list[dict]:
    """Every committed context, newest first (by last use, then creation)."""
    found = []
    if root.is_dir():
        for folder in root.iterdir():
            if folder.name.startswith(".") or not (folder / MANIFEST).exists():
                continue
            try:
                found.append(read_manifest(folder))
            except ShardError:
                continue
    return sorted(found, key=lambda m: _last_used(Path(m["_dir"])), reverse=True)


def find_context(root: Path, name: str | None) -> dict:
    """The context called `name` (its name or a key prefix), or the latest one used."""
    contexts = list_contexts(root)
    if not contexts:
        raise StarqaError("No ingested context yet.", hint="run: starqa ingest PATH")
    if name is None:
        return contexts[0]
    matches = [m for m in contexts if m["name"] == name] or \
              [m for m in contexts if m["key"].startswith(name)]
    if not matches:
        known = ", ".join(sorted({m["name"] for m in contexts}))
        raise StarqaError(f"No context named {name!r}.", hint=f"known contexts: {known}")
    return matches[0]


def touch(manifest: dict) -> None:
    """Mark a context as used now, so `ask` without --context picks it next time."""
    (Path(manifest["_dir"]) / ".last_used").write_text(str(time.time()))


def verify_block(manifest: dict, index: int, checksum: bool = True) -> Path:
    """Path of block `index` after checking it exists, has its size and (unless
    `checksum=False`, a quick look) matches its checksum."""
    block = manifest["blocks"][index]
    path = Path(manifest["_dir"]) / block["file"]
    if not path.exists():
        raise ShardError(f"Shard {path} is missing.", hint=_fix(manifest))
    if path.stat().st_size != block["bytes"] or (checksum and sha256_file(path) != block["sha256"]):
        raise ShardError(f"Shard {path} fails its checksum (corrupt or modified).",
                         hint=_fix(manifest))
    return path


def load_block(manifest: dict, index: int, device="cpu"):
    """(k, v) of block `index`, each [L, Hkv, T, D], checksum-verified."""
    from safetensors.torch import load_file

    tensors = load_file(str(verify_block(manifest, index)), device=str(device))
    return tensors["k"], tensors["v"]


def _last_used(folder: Path) -> float:
    stamp = folder / ".last_used"
    return stamp.stat().st_mtime if stamp.exists() else (folder / MANIFEST).stat().st_mtime


def _fix(manifest: dict) -> str:
    command = manifest.get("command") or "starqa ingest " + " ".join(manifest.get("sources", ["PATH"]))
    return f"re-ingest to rebuild it: {command}"


def load_shard(manifest: dict, indices, device="cpu"):
    """The KV of blocks `indices` (contiguous, in order) as one shard: per layer (k, v), each
    [1, Hkv, N, D] in fp32 (Phase 2 attends in fp32; converting once here, not per step).
    None when `indices` is empty."""
    import torch

    parts = [load_block(manifest, i, device=device) for i in indices]
    if not parts:
        return None
    k = torch.cat([p[0] for p in parts], dim=2).float()  # [L, Hkv, N, D]
    v = torch.cat([p[1] for p in parts], dim=2).float()
    return [(k[layer][None], v[layer][None]) for layer in range(k.shape[0])]
