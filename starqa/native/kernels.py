"""starqa's compiled CPU kernels, bound through ctypes on raw addresses: no torch here.

The library (`_attend*.so`: starqa/native/_attend.c exact attention, _topk.c top-k attention,
_int4.c int4 weights, _rows.c RMSNorm, RoPE, SiLU·mul and adds, _layer.c a decoder layer's
steps on either side of its attention) is built by `pip install` where a C compiler is
found. starqa.native.ops calls it on torch tensors; starqa.coldstart.firsttoken on numpy arrays,
before torch is imported. `library()` is None where it was not built.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from collections.abc import Sequence
from pathlib import Path

from starqa.core.errors import StarqaError

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# name: (restype, argtypes)
_SIGNATURES = {
    "starqa_attend": (_INT, [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64,
                             _I64, _I64, _I64, _F32, _INT]),
    "starqa_topk_attend": (_INT, [_INT, _INT, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR,
                                  _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                                  _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT, _PTR, _PTR, _I64,
                                  _I64, _F32, _PTR, _PTR, _INT, _INT]),
    "starqa_topk_select": (_INT, [_INT, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR,
                                  _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT]),
    "starqa_int4_fast": (_INT, []),
    "starqa_int4_mm": (_INT, [_INT, _PTR, _I64, _I64, _PTR, _I64, _INT, _PTR, _INT, _INT]),
    "starqa_rms_norm": (None, [_INT, _PTR, _I64, _I64, _PTR, _F32, _PTR]),
    "starqa_rope": (_INT, [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "starqa_rope_table": (None, [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR]),
    "starqa_silu_mul": (None, [_INT, _PTR, _I64, _I64, _PTR]),
    "starqa_add": (None, [_INT, _PTR, _I64, _I64, _PTR, _I64]),
    "starqa_layer_before": (_INT, [_INT, _PTR, _I64, _I64, _PTR, _F32, _PTR, _I64, _PTR, _I64,
                                   _I64, _PTR, _PTR, _PTR, _INT]),
    "starqa_layer_after": (_INT, [_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _F32,
                                  _PTR, _I64, _PTR, _PTR, _PTR, _INT]),
    "starqa_decode_layers": (_INT, [_I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR,
                                    _INT]),
    "starqa_step_words": (_I64, [_INT]),
}


# STARQA_SIMD caps the kernels' hand-written paths (read by _simd.h's simd_cap): unset or
# avx512 what the CPU has, avx2 no AVX-512, none the portable C; tests run each on one CPU.
SIMD_CAPS = ("", "avx512", "avx2", "none")


def load(path: str | Path) -> ctypes.CDLL:
    """A build of the kernels at `path` with every function's signature set (OSError: not
    loadable here; AttributeError: a build without some function). `library` loads the
    package's own; benchmarks load other builds to compare them."""
    found = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(found, name)
        function.restype, function.argtypes = restype, argtypes
    return found


@functools.cache
def library():
    """The compiled library with every function's signature set, or None (not built, built
    for another platform, damaged, or an older build without some function)."""
    simd = os.environ.get("STARQA_SIMD", "")
    if simd not in SIMD_CAPS:
        raise StarqaError(f"STARQA_SIMD={simd!r} is not one of {', '.join(SIMD_CAPS[1:])}.",
                          hint="run: unset STARQA_SIMD (the kernels then take the widest "
                               "paths the CPU has; avx2 or none cap them, for tests and "
                               "benchmarks)")
    folder = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_attend{suffix}"
        if path.exists():
            try:
                return load(path)
            except (OSError, AttributeError):
                return None
    return None


@functools.cache
def int4_path() -> int:
    """Which fast path `starqa_int4_mm` runs here: 2 AVX-512 VNNI, 1 AVX2, 0 none (not
    built, or neither: starqa.models.decoder then keeps int4 weights in torch's packed format)."""
    found = library()
    return 0 if found is None else int(found.starqa_int4_fast())


def int4_fast() -> bool:
    """Whether `starqa_int4_mm` runs a fast path here (`int4_path`), so starqa.models.decoder
    keeps int4 weights in its tiles."""
    return int4_path() > 0


def int8_gemm_fast() -> bool:
    """Whether torch's int8 GEMM (`torch._int_mm`, the W8A8 prefill of starqa.models.decoder)
    runs a fast kernel here: where the CPU has AVX-512 VNNI. Without it torch 2.13 runs a
    plain loop, ~20x slower than the int4 tiles' AVX2 path (2-core Zen 3, 22 rows times
    17920x1536: 199 ms against 10.5), so prefills stay on the tiles."""
    return int4_path() == 2


def cpu_threads() -> int:
    """The threads a world of one runs its kernels on: STARQA_THREADS, else every CPU this
    process may run on (what torch uses by default on Linux)."""
    if (threads := os.environ.get("STARQA_THREADS", "").strip()).isdigit() and int(threads):
        return int(threads)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


class KeyTable:
    """Key and value buffers for `starqa_attend`, laid out once (a shard's blocks, which
    never change), with a slot after them for one that changes at every call (the
    question's own KV): the table the kernel reads is built here, not per call (that cost
    ~25 µs a layer with a shard of five blocks: 0.7 ms of SmolLM2's 12 ms decode step).

    A buffer is (key address, value address, keys, key head stride, value head stride),
    strides in elements; its heads hold `keys` rows of D contiguous elements each."""

    def __init__(self, buffers: Sequence[tuple[int, int, int, int, int]], keep=()):
        self._keep = keep  # what the addresses point into, kept alive with the table
        self.count = count = len(buffers) + 1
        # starts (count + 1), then key and value addresses and key and value head strides
        self._table = (ctypes.c_int64 * (5 * count + 1))()
        self.keys = 0  # the laid-out buffers' keys, and where the changing one starts
        for index, buffer in enumerate(buffers):
            self._set(index, *buffer)
            self.keys += buffer[2]
        size = ctypes.sizeof(ctypes.c_int64)
        base = ctypes.addressof(self._table)
        # the addresses of its starts, key and value addresses and head strides (the slot
        # after the laid-out buffers is filled by each call: `attend`, starqa/native/_step.c)
        self.addresses = (base, *(base + (k * count + 1) * size for k in range(1, 5)))

    def _set(self, index: int, key: int, value: int, keys: int, key_stride: int,
             value_stride: int) -> None:
        table, count = self._table, self.count
        table[index + 1] = self.keys + keys  # (table[index] is self.keys already)
        table[count + 1 + index] = key
        table[2 * count + 1 + index] = value
        table[3 * count + 1 + index] = key_stride
        table[4 * count + 1 + index] = value_stride

    def attend(self, bf16: bool, q: int, heads: int, rows: int, dim: int, out: int, lse: int,
               scale: float, own_buffer: tuple[int, int, int, int, int] | None = None,
               own: int = 0, threads: int = 1) -> int:
        """`starqa_attend` (starqa/native/_attend.c) of fp32 queries at `q` [heads, rows, dim] over
        the laid-out buffers, then `own_buffer` if given (`own` of its keys the queries'
        own, causally), into fp32 `out` [heads, rows, dim] and `lse` [heads, rows]. Returns
        the kernel's code: 0, 1 for impossible shapes, 2 out of memory."""
        pieces = self.count - 1
        if own_buffer is not None:
            self._set(pieces, *own_buffer)
            pieces += 1
        return library().starqa_attend(int(bf16), q, pieces, *self.addresses, out, lse,
                                       heads, rows, dim, own, scale, threads)
