"""The model as Phase 2 runs it, without torch: its shape (`DecoderConfig`), the prepared
weights file beside it (name and stamp) and which kernel multiplies how many rows.

starqa.models.decoder_io builds and loads the prepared file with torch; starqa.coldstart.firsttoken
maps it with numpy, before torch is imported. Both read these, so they agree on what a file holds.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.models.embedded import EMBEDDED
from starqa.models.identity import weights_digest
from starqa.models.rope import Rope

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
INT4_GROUP = 32  # the GGUF Q4 block: re-quantising a Q4_1/Q4_K tensor in groups of 32 keeps it
# From this many rows on, a quantised Linear multiplies int8 activations by int8 weights
# (measured on a 2-core Xeon, 1536x8960: torch's int4 kernel 1.6 ms at 8 rows and 7.1 ms at
# 32, int8 x int8 1.0 and 1.6 ms; at one row int4 reads half the bytes and wins). starqa's
# int4 tiles keep up longer (2-core Zen 5, a whole forward: SmolLM2 at 21 rows 14 ms against
# W8A8's 19, at 48 rows 28 against 24, at 64 37 against 35; Qwen2.5-Coder-1.5B at 29 rows
# 135 against 140, at 56 251 against 177). Up to 63 rows they stay: a question then runs as
# its answer does (14-bit activations), and starqa.coldstart.firsttoken can answer its first token
# before torch is imported (it has no int8 GEMM); Qwen's prefill of 32-63 rows pays for it.
W8A8_MIN_ROWS = 4
W8A8_MIN_ROWS_TILES = 64
# The prepared file's layout: a file of another layout is rebuilt (2: int8 copies for W8A8;
# 3: every tensor 64-byte aligned in the file, so it is memory-mapped in place; 4: RoPE's
# inv_freq in it, which starqa.coldstart.firsttoken reads without torch).
PREPARED_LAYOUT = "4"


@dataclass(frozen=True)
class DecoderConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    tied: bool
    rope: Rope = Rope()  # its scaling as the config declares it (starqa.models.rope)

    @classmethod
    def read(cls, folder: Path) -> DecoderConfig:
        config = json.loads((Path(folder) / "config.json").read_text())
        arch = (config.get("architectures") or ["?"])[0]
        try:
            rope = Rope.read(config)
        except ValueError as err:
            raise StarqaError(f"Phase 2 does not run {folder}: {err}.",
                              hint="use an embedded model: " + " or ".join(
                                  f"--model {m.name}" for m in EMBEDDED)) from None
        if arch not in ARCHITECTURES:
            raise StarqaError(
                f"Phase 2 supports {', '.join(ARCHITECTURES)}; {folder} is {arch}.",
                hint="use an embedded model: " + " or ".join(f"--model {m.name}"
                                                             for m in EMBEDDED))
        heads = config["num_attention_heads"]
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"],
                   heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   vocab=config["vocab_size"], eps=config.get("rms_norm_eps", 1e-6),
                   rope_theta=rope.parameters["rope_theta"],
                   tied=bool(config.get("tie_word_embeddings", False)), rope=rope)


def prepared_file(folder: Path, weights: str, dtype: str) -> Path:
    """Where the model in `folder` keeps its weights prepared in format `weights` for
    compute dtype `dtype` ("bfloat16", ...)."""
    return Path(folder) / f".starqa-phase2-{weights}-{dtype}.safetensors"


def prepared_stamp(folder: Path, weights: str, torch_version: str, int4_tiles: bool) -> dict:
    """What a prepared file's metadata must say to be used: the model's weights, the torch
    version (whose packed int4 layout may change), the layout, for int4 whose layout it
    holds (a folder shared with a CPU without VNNI rebuilds), and a scaled RoPE's
    parameters (the file keeps its frequencies: a config given YaRN, or whose scaling
    changed, beside the same weights rebuilds; plain RoPE's files name none)."""
    stamp = {"weights_sha256": weights_digest(folder), "torch": torch_version,
             "layout": PREPARED_LAYOUT}
    if weights == "int4":
        stamp["int4"] = "tiles" if int4_tiles else "torch"
    try:
        rope = Rope.of(folder)
    except ValueError:  # a RoPE starqa does not run: the decoder refuses it when it loads
        return stamp
    if rope.kind != "default":
        stamp["rope"] = json.dumps(rope.parameters, sort_keys=True)
    return stamp


def installed_torch_version() -> str | None:
    """`torch.__version__` without importing torch (its torch/version.py, read), or None."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        if found := re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M):
            return found.group(1)
    return None
