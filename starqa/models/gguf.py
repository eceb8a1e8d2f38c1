"""Any GGUF file as a model: `--model ./x.gguf`, and ollama's blobs (starqa.models.ollama).

A GGUF of an architecture Phase 2 runs is converted once into the model cache, the same
one the embedded models use, in a folder named by the file's sha256
(`$STARQA_HOME/models/gguf-<sha256>`): the same file under another name or path is the same
model, converted once. The sha256 of a file is remembered by path, size and mtime
(`$STARQA_HOME/models/.gguf-sha256/`), so a second use does not read a large file again.
The converted folder is built in a hidden staging folder and renamed into place whole.

Only the GGUF header is read here (the architecture, before any conversion); the tensors
are transformers' to read (starqa.models.conversion).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from starqa.core.hashing import sha256_file
from starqa.core.errors import StarqaError, disk_full
from starqa.core.paths import models_dir
from starqa.core.progress import UI
from starqa.models.conversion import MODEL_INFO, convert_gguf, install, readable_by_all

MAGIC = b"GGUF"
# GGUF's `general.architecture` → the transformers class its conversion yields: the ones
# Phase 2's decoder runs (starqa.models.prepared.ARCHITECTURES; tests keep the two equal).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
DIGESTS = ".gguf-sha256"  # under models_dir(): one small JSON per GGUF path hashed
SUPPORTED = "Llama, Mistral and Qwen2 (GGUF architectures llama, mistral, qwen2)"
OTHER_MODELS = ("`ollama pull qwen2.5-coder:1.5b` then --model ollama:qwen2.5-coder:1.5b, "
                "or an embedded model: --model smollm2-135m")


@dataclass(frozen=True)
class GgufSource:
    """A GGUF to use as a model: the file, the name it is shown by, and where it comes from
    a store that names files by content (ollama), the sha256 it must have and the command
    that fetches it again."""

    path: Path
    name: str
    sha256: str | None = None
    refetch: str | None = None  # hint for a file whose content does not match `sha256`


def names_gguf(path: Path) -> bool:
    """Whether a `--model` path means a GGUF: its name ends .gguf, or the file starts with
    GGUF's magic."""
    return path.suffix.lower() == ".gguf" or (path.is_file() and _has_magic(path))


def ensure_gguf(source: GgufSource, ui: UI | None = None) -> Path:
    """Folder of the converted model for `source`, converting it on first use (each step
    shown through `ui`). Refuses a file that is missing, not a GGUF, of an architecture
    Phase 2 does not run, or (with `source.sha256`) whose content does not match."""
    ui = ui or UI()
    _check_file(source)
    digest = file_sha256(source.path, ui, source.name)
    if source.sha256 is not None and digest != source.sha256:
        raise StarqaError(
            f"{source.path} does not match its name: its sha256 is {digest}, not "
            f"{source.sha256}.", hint=source.refetch or "the file is damaged; fetch it again")
    final = models_dir() / f"gguf-{digest}"
    if (final / "config.json").is_file():
        return final
    architecture = _metadata(source.path, ("general.architecture",)).get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise _unsupported(source, str(architecture))
    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a hidden staging folder; only a complete folder is renamed in.
    with tempfile.TemporaryDirectory(prefix=f".gguf-{digest[:12]}-", dir=final.parent) as tmp:
        work = Path(tmp)
        out = _convert(source, work, ui)
        _check_converted(source, out)
        info = {"name": source.name, "gguf_sha256": digest, "gguf_file": str(source.path),
                "size": source.path.stat().st_size, "architecture": architecture}
        (out / MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")
        readable_by_all(out)
        install(out, final)
    ui.note(f"✓ {source.name} ready in {final}")
    return final


def file_sha256(path: Path, ui: UI | None = None, name: str | None = None) -> str:
    """sha256 of the file at `path`, hashed once and remembered by its resolved path, size
    and mtime under the model cache (a cache that cannot be written only forgets)."""
    path = Path(path).resolve()
    st = path.stat()
    key = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = models_dir() / DIGESTS / f"{hashlib.sha256(str(path).encode()).hexdigest()}.json"
    try:
        remembered = json.loads(memo.read_text())
        if {k: remembered.get(k) for k in key} == key:
            return remembered["sha256"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    with (ui or UI()).status(f"Hashing {name or path.name} ({st.st_size / 1e9:.2f} GB, once) …"):
        digest = sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", dir=memo.parent)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o644)  # mkstemp makes it 0600; others sharing the cache may read it
            json.dump({**key, "sha256": digest}, f)
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


# ---------------------------------------------------------------------------- checks


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _check_file(source: GgufSource) -> None:
    path = source.path
    if not path.is_file():
        where = shlex.quote(str(path.parent))
        raise StarqaError(f"No GGUF file at {path}.",
                          hint=f"check the path (ls {where}), or pass a Hugging Face model "
                               "folder or an embedded model: --model smollm2-135m")
    if not _has_magic(path):
        raise StarqaError(f"{path} is not a GGUF file (it does not start with GGUF's magic).",
                          hint="pass a .gguf file as llama.cpp writes it, or a Hugging Face "
                               "model folder (config.json, *.safetensors, tokenizer)")


def _unsupported(source: GgufSource, architecture: str) -> StarqaError:
    return StarqaError(
        f"{source.name} is a {architecture} model; starqa answers with {SUPPORTED} models.",
        hint=f"use a GGUF of one of those: {OTHER_MODELS}")


def _check_converted(source: GgufSource, out: Path) -> None:
    """What Phase 2 reads from the converted config: a class it runs, with plain RoPE (a
    GGUF of a supported architecture may still carry scaled RoPE)."""
    config = json.loads((out / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if arch not in ARCHITECTURES.values():
        raise _unsupported(source, arch)
    if rope_type != "default":
        raise _unsupported(source, f"{arch} with {rope_type} RoPE scaling")


def _convert(source: GgufSource, work: Path, ui: UI) -> Path:
    """The converted folder, under `work`. transformers finds a GGUF by its name's .gguf
    (a blob named sha256-... would be read as a pickle), so it sees the file through a link."""
    gguf_dir, out = work / "gguf", work / "out"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").symlink_to(source.path.resolve())
    with ui.status(f"Converting {source.name} → safetensors (one time) …"):
        try:
            convert_gguf(gguf_dir, "model.gguf", out)
        except OSError as e:
            if full := disk_full(e, f"Converting {source.name}"):
                raise full from None
            raise
        except (ValueError, KeyError, NotImplementedError, TypeError) as e:
            raise StarqaError(f"transformers could not convert {source.name}: {e}",
                              hint="its quantisation or tokenizer may be one transformers' "
                                   f"GGUF loader does not read; {OTHER_MODELS}") from e
    return out


# ---------------------------------------------------------------------------- the header

# GGUF value types (gguf's GGUFValueType): fixed-size ones by struct format; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _metadata(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The header's values for `keys` (strings and numbers; arrays are skipped), read until
    all are found: GGUF v2/v3, magic, version, tensor count, key count, then the keys."""
    found: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            magic, version, _, count = struct.unpack("<4sIQQ", f.read(24))
            if magic != MAGIC or version < 2:
                raise ValueError(f"GGUF version {version}")
            for _ in range(count):
                key = _string(f)
                kind = _unpack(f, "<I")
                if kind == _ARRAY:
                    _skip_array(f)
                else:
                    value = _value(f, kind)
                    if key in keys:
                        found[key] = value
                if len(found) == len(keys):
                    break
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise StarqaError(f"Cannot read the GGUF header of {path}: {e}",
                          hint="the file is truncated or not a GGUF; fetch it again") from None
    return found


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the header ends early")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    size = _unpack(f, "<Q")
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the header ends early")
    return data.decode()


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind not in _SCALARS:
        raise ValueError(f"unknown value type {kind}")
    return _unpack(f, _SCALARS[kind])


def _skip_array(f: BinaryIO) -> None:
    kind, count = _unpack(f, "<I"), _unpack(f, "<Q")
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]) * count, os.SEEK_CUR)
    elif kind == _STRING:
        for _ in range(count):
            f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif kind == _ARRAY:
        for _ in range(count):
            _skip_array(f)
    else:
        raise ValueError(f"unknown array type {kind}")
