"""ollama's local model store as a source of GGUFs: `--model ollama:NAME[:TAG]`.

The store is `$OLLAMA_MODELS`, else `~/.ollama/models`. A model's manifest is JSON at
`manifests/registry.ollama.ai/library/NAME/TAG` (`ns/NAME` and `host/ns/NAME` as ollama
spells them); its layer of media type `application/vnd.ollama.image.model` names the GGUF,
stored as `blobs/sha256-<hex>`. starqa only reads the store: the blob is used through
starqa.models.gguf like any GGUF, its sha256 checked against its name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from starqa.core.errors import StarqaError

PREFIX = "ollama:"
REGISTRY = "registry.ollama.ai"
NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class OllamaModel:
    """A model of ollama's store: its name as ollama shows it, tag included, and its GGUF
    blob with the sha256 the blob's name promises."""

    name: str  # "llama3.2:latest", "user/model:q4"
    blob: Path
    sha256: str

    @property
    def spec(self) -> str:
        """How `--model` names it."""
        return PREFIX + self.name

    @property
    def refetch(self) -> str:
        """The commands that download the model again."""
        return f"ollama rm {self.name} && ollama pull {self.name}"


def is_ollama(spec: str) -> bool:
    """Whether a `--model` spec names a model of ollama's store."""
    return spec.startswith(PREFIX)


def store() -> Path:
    """ollama's model store: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def find(spec: str) -> OllamaModel:
    """The model `spec` ("ollama:NAME[:TAG]") names, from its manifest in the store."""
    root, name, tag, folder = _locate(spec)
    manifests = root / "manifests"
    if not manifests.is_dir():
        source = " (from OLLAMA_MODELS)" if os.environ.get("OLLAMA_MODELS") else ""
        raise StarqaError(
            f"No ollama model store at {root}{source}.",
            hint=f"pull the model with ollama: `ollama pull {name}:{tag}`; or, where ollama "
                 "keeps its models elsewhere (`ollama serve` runs with OLLAMA_MODELS set), "
                 "name that folder: `export OLLAMA_MODELS=/path/to/models`")
    models = folder.parent
    if not models.is_dir():
        present = [f"--model {PREFIX}{m}" for m in list_models(root)]
        also = f"; or one the store has: {', '.join(present)}" if present else ""
        raise StarqaError(f"ollama's store ({root}) has no model {name}.",
                          hint=f"`ollama pull {name}:{tag}`{also}")
    if not folder.is_file():
        tags = sorted(p.name for p in models.iterdir() if p.is_file())
        pull = f"`ollama pull {name}:{tag}`"
        have = " or ".join(f"--model {PREFIX}{name}:{t}" for t in tags)
        raise StarqaError(f"ollama's store ({root}) has {name} but not {name}:{tag}.",
                          hint=f"use a tag it has: {have}; or {pull}" if tags else pull)
    digest = _model_layer(folder, f"{name}:{tag}")
    model = OllamaModel(name=f"{name}:{tag}", blob=root / "blobs" / f"sha256-{digest}",
                        sha256=digest)
    if not model.blob.is_file():
        raise StarqaError(f"The GGUF of {model.spec} ({model.blob}) is missing from the store.",
                          hint=f"download it again: `{model.refetch}`")
    return model


def list_models(root: Path) -> list[str]:
    """Every NAME:TAG of the store at `root`, as ollama lists them."""
    found = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if manifest.is_file():
            host, namespace, name, tag = manifest.relative_to(root / "manifests").parts
            prefix = "" if host == REGISTRY else f"{host}/"
            prefix += "" if host == REGISTRY and namespace == NAMESPACE else f"{namespace}/"
            found.append(f"{prefix}{name}:{tag}")
    return sorted(found)


def _locate(spec: str) -> tuple[Path, str, str, Path]:
    """(store, NAME as written, TAG, the manifest's path) for `spec`."""
    ref = spec.removeprefix(PREFIX).strip()
    path, _, last = ref.rpartition("/")
    base, _, tag = last.partition(":")
    parts = [*path.split("/"), base] if path else [base]
    if not base or len(parts) > 3 or not all(parts) or any(p in (".", "..") for p in parts):
        raise StarqaError(f"{spec!r} is not an ollama model name.",
                          hint=f"name one as ollama does: --model {PREFIX}llama3.2 or "
                               f"--model {PREFIX}qwen2.5-coder:1.5b (`ollama list` shows them)")
    tag = tag or DEFAULT_TAG
    if tag in (".", ".."):
        raise StarqaError(f"{spec!r} is not an ollama model name.",
                          hint=f"name a tag as ollama does: --model {PREFIX}{base}:latest")
    full = {1: [REGISTRY, NAMESPACE], 2: [REGISTRY], 3: []}[len(parts)] + parts
    name = "/".join(parts)
    root = store()
    return root, name, tag, root.joinpath("manifests", *full, tag)


def _model_layer(manifest: Path, name: str) -> str:
    """The hex sha256 of the manifest's GGUF layer."""
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER]
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise StarqaError(f"Cannot read ollama's manifest of {name} ({manifest}): {e}",
                          hint=f"download it again: `ollama rm {name} && ollama pull {name}`"
                          ) from None
    algorithm, _, digest = (digests[0] if digests else "").partition(":")
    if algorithm != "sha256" or len(digest) != 64 or not all(c in "0123456789abcdef"
                                                                for c in digest):
        raise StarqaError(f"ollama's manifest of {name} ({manifest}) names no GGUF layer "
                          f"({MODEL_LAYER}).",
                          hint=f"download it again: `ollama rm {name} && ollama pull {name}`")
    return digest
