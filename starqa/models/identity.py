"""A model folder's identity: hashes of its config, weights and tokenizer, and their
digest, so that caches built from it can tell when the model changed (the weights' hash
cached beside them)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from starqa.models.conversion import MODEL_INFO
from starqa.models.loading import json_field


SIDECAR = ".starqa-fingerprint.json"  # cached weights hash, keyed by file sizes and mtimes


VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype"}
)


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt",
)


def fingerprint(path: Path) -> dict[str, str]:
    """Identity of a model folder: hashes of its config, weights and tokenizer, and their digest."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    canonical = json.dumps(_strip_volatile(config), sort_keys=True, separators=(",", ":"))
    config_sha = hashlib.sha256(canonical.encode()).hexdigest()
    weights_sha = _weights_sha256(path)
    tokenizer_sha = hash_files([path / n for n in TOKENIZER_FILES if (path / n).is_file()])
    digest = hashlib.sha256(f"{config_sha}\n{weights_sha}\n{tokenizer_sha}".encode()).hexdigest()
    return {"name": _display_name(path), "config_sha256": config_sha, "weights_sha256": weights_sha,
            "tokenizer_sha256": tokenizer_sha, "digest": digest}


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_volatile(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, list):
        return [_strip_volatile(v) for v in value]
    return value


def _display_name(path: Path) -> str:
    # Hub snapshots live in .../models--org--name/snapshots/<revision>: show "org/name".
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    # A converted GGUF's folder is named by its sha256: show the name it was converted as.
    if (name := json_field(path / MODEL_INFO, "name")) and isinstance(name, str):
        return name
    return path.resolve().name


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files, in order; hidden ones are starqa's own derived files
    (Phase 2's prepared weights), never part of the model."""
    return sorted(f for f in Path(path).glob("*.safetensors") if not f.name.startswith("."))


def weights_digest(path: Path) -> str:
    """sha256 of a model folder's weights (remembered by file names, sizes and mtimes)."""
    return _weights_sha256(Path(path))


def _weights_sha256(path: Path) -> str:
    files = weight_files(path)
    stats = [f.stat() for f in files]
    key = [[f.name, st.st_size, st.st_mtime_ns] for f, st in zip(files, stats)]
    sidecar = path / SIDECAR
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(sidecar.read_text())
        if cached["files"] == key:
            return cached["weights_sha256"]
    sha = hash_files(files)
    with contextlib.suppress(OSError):  # read-only folder: just don't cache
        fd, tmp = tempfile.mkstemp(prefix=SIDECAR, dir=path)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(fd, 0o644)  # mkstemp makes it 0600; others sharing the folder may read it
                json.dump({"files": key, "weights_sha256": sha}, f)
            os.replace(tmp, sidecar)
        except OSError:
            os.unlink(tmp)
            raise
    return sha


def hash_files(files: list[Path], *, with_names: bool = True) -> str:
    """sha256 over the files in order; with names, "name\\0size\\0" precedes each file's bytes."""
    h = hashlib.sha256()
    for f in files:
        if with_names:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()
