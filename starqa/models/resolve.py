"""A `--model` spec made a local Hugging Face folder (`resolve_model`): an embedded name, a
GGUF file, a model of ollama's store, a local folder or a hub id; and how a manifest records
the spec so that the model can be found, or rebuilt, again."""

from __future__ import annotations

import os
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.models.embedded import DEFAULT_MODEL, EMBEDDED, embedded_model, ensure_embedded


HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model(spec: str | None, ui: UI | None = None) -> Path:
    """Local model folder for `spec` (None → $STARQA_MODEL → DEFAULT_MODEL).

    An embedded name or alias is fetched and converted on first use; so is a GGUF file (a
    path ending .gguf, or a file starting with GGUF's magic) and a model of ollama's store
    (`ollama:NAME[:TAG]`), by the file's sha256 (starqa.models.gguf); an existing folder with
    a config.json is used as is; anything else is tried as a hub id (weights, configs,
    tokenizer). Any of them followed by `+yarnN` is that model with YaRN at factor N
    (starqa.models.scaled), a folder made once beside the others.
    """
    import starqa.models.gguf as gguf
    import starqa.models.ollama as ollama
    import starqa.models.scaled as scaled

    spec = spec or os.environ.get("STARQA_MODEL") or DEFAULT_MODEL
    base, factor = scaled.split(spec)
    if factor is not None:
        return scaled.ensure(resolve_model(base, ui), factor)
    if model := embedded_model(spec):
        return ensure_embedded(model, ui)
    if ollama.is_ollama(spec):
        found = ollama.find(spec)
        return gguf.ensure_gguf(gguf.GgufSource(found.blob, found.spec, found.sha256,
                                                f"download it again: `{found.refetch}`"), ui)
    local = Path(spec).expanduser()
    if gguf.names_gguf(local):
        return gguf.ensure_gguf(gguf.GgufSource(local, local.name), ui)
    if local.is_dir():
        if (local / "config.json").is_file():
            return local.resolve()
        raise StarqaError(f"Model not found: {spec!r}", hint=f"{local} has no config.json; pass "
                          "a Hugging Face model folder (config.json, *.safetensors, tokenizer)")
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(spec, allow_patterns=HUB_PATTERNS))
        if not (folder / "config.json").is_file():
            raise FileNotFoundError("no config.json in snapshot")
        return folder
    except Exception as e:
        raise StarqaError(
            f"Model not found: {spec!r}",
            hint=f"pass an embedded name ({', '.join(m.name for m in EMBEDDED)}), a local "
            "Hugging Face folder, a .gguf file, ollama:NAME[:TAG] (a model of ollama's "
            "store), or a hub id reachable from this machine",
        ) from e


def recorded_spec(spec: str) -> str:
    """`spec` as a manifest records it: a local file or folder by its absolute path, so a
    question asked from another folder finds the same model (with its +yarnN); any other
    spec as given."""
    import starqa.models.ollama as ollama
    import starqa.models.scaled as scaled

    base, factor = scaled.split(spec)
    if factor is not None:
        return scaled.with_yarn(recorded_spec(base), factor)
    local = Path(spec).expanduser()
    if embedded_model(spec) or ollama.is_ollama(spec) or not local.exists():
        return spec
    return str(local.resolve())


def rebuildable(spec: str) -> bool:
    """Whether `resolve_model(spec)` can make the model's folder again once it is deleted:
    an embedded model (fetched again), ollama's model or a GGUF file (converted again), and
    any of them or a local folder with +yarnN (its links made again)."""
    import starqa.models.gguf as gguf
    import starqa.models.ollama as ollama
    import starqa.models.scaled as scaled

    base, factor = scaled.split(spec)
    if factor is not None:
        return rebuildable(base) or Path(base).expanduser().is_dir()
    local = Path(spec).expanduser()
    return bool(embedded_model(spec)) or ollama.is_ollama(spec) or (
        local.is_file() and gguf.names_gguf(local))
