"""Where and in what a model runs: the device (a GPU, found without importing torch), the
CPU's description and flags, the memory available, and the dtypes and Phase 2 weight
formats chosen for them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TYPE_CHECKING

from starqa.core.errors import StarqaError
from starqa.models.embedded import DEFAULT_MODEL, embedded_model
from starqa.models.identity import weight_files

if TYPE_CHECKING:
    import torch


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


# Phase 2's weight format on CPU when --weights is not given, per embedded model, chosen by
# measurement (docs/models.md, docs/results.md): the fastest format whose accuracy against the
# dense bf16 reference keeps retention >= 0.97 in benchmarks/weights_accuracy.py. int4 for
# both measured: Qwen2.5-Coder-1.5B answered 15 of 15 like dense (every token the same);
# SmolLM2 answered 34 of dense's 34 on 120 paired samples (two seeds of 60, 10 per cell).
# Qwen2.5-Coder-0.5B: int4 as its 1.5B sibling (the same family and Q4_K_M), not yet
# measured on its own. The GGUFs are 4-bit at source, which int4 in groups of 32 keeps to
# within 0.2%. Other models, and CUDA devices (the int kernels are CPU ones), use dense.
PHASE2_WEIGHTS = {"smollm2-135m": "int4", "qwen2.5-coder-0.5b": "int4",
                  "qwen2.5-coder-1.5b": "int4"}


WEIGHT_FORMATS = ("dense", "int8", "int4")


def phase2_weights(requested: str | None, spec: str | None, device: Any = "cpu") -> str:
    """The weight format Phase 2 runs `spec`'s model with: `requested`, else the default."""
    if requested is not None:
        if requested not in WEIGHT_FORMATS:
            raise StarqaError(f"Unknown weight format {requested!r}.",
                              hint=f"choose one of: {', '.join(WEIGHT_FORMATS)}")
        return requested
    if str(device).startswith("cuda") or (device == "auto" and cuda_available()):
        return "dense"
    from starqa.models.scaled import split

    embedded = embedded_model(split(spec or DEFAULT_MODEL)[0])  # +yarnN: the same weights
    return PHASE2_WEIGHTS.get(embedded.name, "dense") if embedded else "dense"


_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD ROCm, WSL2


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch on a Linux machine that has no
    GPU device node at all (where torch would find none either): a cold ask's command line
    decides where Phase 2 runs while its head start imports torch (starqa.coldstart.headstart)."""
    if sys.platform.startswith("linux") and not any(map(os.path.exists, _GPU_NODES)):
        return False
    import torch

    return torch.cuda.is_available()


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


# x86 flags behind fast bf16 matrix products on the CPU (oneDNN's AVX-512 BF16 and AMX
# kernels); without either, torch's bf16 GEMMs are emulated in fp32 and slower than fp32's.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_description() -> tuple[str, set[str]]:
    """The CPU's model name and flags (Linux /proc/cpuinfo; "unknown" and none elsewhere)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def available_memory() -> int | None:
    """Bytes of memory available (Linux /proc/meminfo's MemAvailable), or None where
    unknown."""
    return _meminfo("MemAvailable:")


def total_memory() -> int | None:
    """Bytes of memory the machine has (/proc/meminfo's MemTotal), or None where unknown:
    what a choice that must not change from one run to the next is sized by."""
    return _meminfo("MemTotal:")


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def phase1_dtype(dtype: str, device: Any, model_path: Path | str, local_workers: int = 1) -> str:
    """The dtype Phase 1's model computes in (torch's name: "float32"), for a cache stored
    in `dtype` ("bfloat16", ...; the KV is rounded to it as each block is saved): fp32 for a
    bf16 cache on an x86 CPU without bf16 matrix instructions (`BF16_FLAGS`: AVX2-only CPUs,
    most laptops), where torch's bf16 products are emulated: SmolLM2 over 1,024 tokens took
    33.8 s in bf16 and 7.5 in fp32 on a Zen 3, and `ingest samples/` encoded ~5x faster
    (docs/models.md); the cache is the same size, its
    keys and values rounded once instead of computed in bf16 throughout. Blocks that dense
    and ring continue from on a re-ingest are read back as stored, so there a bf16 cache
    matches a full encoding within bf16's rounding of the kept blocks, not bit for bit (fp32
    caches: bit for bit). Kept in `dtype` elsewhere, and where the fp32 weights of this
    machine's `local_workers` would take more than half the memory available (a 1.5B model:
    ~6 GB a worker). No torch import: the launcher decides once for its workers (`ingest`)."""
    if dtype != "bfloat16" or str(device).split(":")[0] != "cpu":
        return dtype
    _, flags = cpu_description()
    if "avx2" not in flags or any(flag in flags for flag in BF16_FLAGS):
        return dtype  # not x86 as known here, or bf16 products in hardware
    weights = sum(f.stat().st_size for f in weight_files(model_path))
    available = available_memory()
    if available is None or 2 * weights * local_workers > available / 2:  # bf16 files → fp32
        return dtype
    return "float32"
