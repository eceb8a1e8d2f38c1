"""Models: a `--model` spec resolved to a local folder and loaded.

In data-flow order: `embedded.py` (the models fetched by name from PyPI wheels, pinned by
sha256, and the default), `resolve.py` (a spec made a local folder: an embedded name, a GGUF
file through `gguf.py`, ollama's store through `ollama.py`, a folder, a hub id; each GGUF
converted once by `conversion.py`), `identity.py` (a folder's fingerprint, which caches
built from it record), `devices.py` (the device, the CPU's flags, the memory, the dtypes and
Phase 2 weight formats chosen for them), `loading.py` (model, tokenizer, stop tokens,
window), `rope.py` (RoPE scaling as the config declares it); then Phase 2's own forward: `linear.py` (dense, int8 and int4 linear layers),
`decoder.py` (the lean Llama/Mistral/Qwen2 decoder), `decoder_io.py` (a decoder loaded, its
prepared weights built once and mapped after) and `prepared.py` (what those prepared
weights hold, without torch).
"""

from starqa.models.conversion import MODEL_INFO
from starqa.models.embedded import (DEFAULT_MODEL, EMBEDDED, EmbeddedModel, WheelPart,
    embedded_model, ensure_embedded, fetch_gguf)
from starqa.models.resolve import (HUB_PATTERNS, rebuildable, recorded_spec, resolve_model)
from starqa.models.devices import (BF16_FLAGS, DTYPES, PHASE2_WEIGHTS, WEIGHT_FORMATS,
    available_memory, cpu_description, cuda_available, parse_dtype, phase1_dtype,
    phase2_weights)
from starqa.models.loading import (FastTokenizer, context_window, json_field,
    load_fast_tokenizer, load_model, load_tokenizer, stop_ids)
from starqa.models.identity import (SIDECAR, TOKENIZER_FILES, VOLATILE_CONFIG_KEYS,
    fingerprint, hash_files, weight_files, weights_digest)

__all__ = ["BF16_FLAGS", "DEFAULT_MODEL", "DTYPES", "EMBEDDED", "EmbeddedModel",
           "FastTokenizer", "HUB_PATTERNS", "MODEL_INFO", "PHASE2_WEIGHTS", "SIDECAR",
           "TOKENIZER_FILES", "VOLATILE_CONFIG_KEYS", "WEIGHT_FORMATS", "WheelPart",
           "available_memory", "context_window", "cpu_description", "cuda_available",
           "embedded_model", "ensure_embedded", "fetch_gguf", "fingerprint", "hash_files",
           "json_field", "load_fast_tokenizer", "load_model", "load_tokenizer",
           "parse_dtype", "phase1_dtype", "phase2_weights", "rebuildable", "recorded_spec",
           "resolve_model", "stop_ids", "weight_files", "weights_digest"]
