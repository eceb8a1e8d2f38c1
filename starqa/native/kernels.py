"""starqa's compiled CPU kernels, bound through ctypes on raw addresses: no torch here.

The library (`_attend*.so`, built from starqa/native/*.c by `pip install` where a C
compiler is found: starqa/native/build.py) declares its entry points and the structs they
take once, in starqa/native/_kernels.h. This module mirrors each struct once as a
`ctypes.Structure` of the same name and each prototype as a signature (`SIGNATURES`);
tests/test_kernel_boundary.py checks the mirror against the header. starqa.native.ops calls
the kernels on torch tensors; starqa.coldstart.firsttoken on numpy arrays, before torch is
imported. `library()` is None where the library is missing or stale (`status()` says which,
and the commands warn); STARQA_REQUIRE_KERNELS=1 makes either an error.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.native import build

_I32, _I64, _INT, _F32, _PTR = (ctypes.c_int32, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                ctypes.c_void_p)

# ---------------------------------------------------------------------------------------
# _kernels.h's structs, in its order: the same names, fields and C types (a pointer to a
# struct as POINTER(it), any other pointer as an address)


class starqa_queries(ctypes.Structure):
    _fields_ = [("q", _PTR), ("heads", _I64), ("rows", _I64), ("d", _I64)]


class starqa_outputs(ctypes.Structure):
    _fields_ = [("scale", _F32), ("out", _PTR), ("lse", _PTR)]


class starqa_key_table(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("pieces", _I64), ("starts", _PTR), ("keys", _PTR),
                ("values", _PTR), ("key_strides", _PTR), ("value_strides", _PTR),
                ("key_scales", _PTR), ("value_scales", _PTR), ("biases", _PTR)]


class starqa_attend_args(ctypes.Structure):
    _fields_ = [("table", starqa_key_table), ("queries", starqa_queries), ("own", _I64),
                ("result", starqa_outputs), ("threads", _INT)]


class starqa_attend_batch_args(ctypes.Structure):
    _fields_ = [("table", starqa_key_table), ("queries", starqa_queries), ("segments", _I64),
                ("row_starts", _PTR), ("own_keys", _PTR), ("own_values", _PTR),
                ("own_lengths", _PTR), ("own_key_strides", _PTR),
                ("own_value_strides", _PTR), ("own", _PTR), ("result", starqa_outputs),
                ("threads", _INT)]


class starqa_buffers(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("count", _I64), ("start", _PTR), ("ptr", _PTR),
                ("stride", _PTR)]


class starqa_lists(ctypes.Structure):
    _fields_ = [("count", _I64), ("centroids", _PTR), ("offsets", _PTR), ("probes", _I64),
                ("tail", _PTR), ("tail_lists", _PTR)]


class starqa_topk_table(ctypes.Structure):
    _fields_ = [("n", _I64), ("keys", starqa_buffers), ("map", _PTR), ("inv", _PTR),
                ("values", starqa_buffers), ("lists", starqa_lists), ("drop", _INT)]


class starqa_own_keys(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("k", _PTR), ("v", _PTR), ("stride", _I64), ("before", _I64)]


class starqa_topk_args(ctypes.Structure):
    _fields_ = [("table", ctypes.POINTER(starqa_topk_table)), ("queries", starqa_queries),
                ("tokens", _I64), ("k", _I64), ("skip", _I64), ("bias", _F32),
                ("unbiased", _I64), ("own", starqa_own_keys), ("result", starqa_outputs),
                ("threads", _INT)]


class starqa_select_args(ctypes.Structure):
    _fields_ = [("table", ctypes.POINTER(starqa_topk_table)), ("queries", starqa_queries),
                ("k", _I64), ("skip", _I64), ("rows", _PTR), ("scores", _PTR),
                ("threads", _INT)]


class starqa_int4_args(ctypes.Structure):
    _fields_ = [("x_bf16", _INT), ("x", _PTR), ("m", _I64), ("k", _I64), ("w", _PTR),
                ("n", _I64), ("y_bf16", _INT), ("y", _PTR), ("fast", _INT), ("threads", _INT)]


class starqa_linear(ctypes.Structure):
    _fields_ = [("tiles", _PTR), ("bias", _PTR)]


class starqa_before_args(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("hidden", _PTR), ("m", _I64), ("h", _I64), ("norm", _PTR),
                ("eps", _F32), ("qkv", starqa_linear), ("n", _I64), ("rotated", _I64),
                ("d", _I64), ("cos", _PTR), ("sin", _PTR), ("out", _PTR), ("threads", _INT)]


class starqa_after_args(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("hidden", _PTR), ("m", _I64), ("h", _I64), ("attn", _PTR),
                ("k", _I64), ("out", starqa_linear), ("norm", _PTR), ("eps", _F32),
                ("gate_up", starqa_linear), ("inner", _I64), ("down", starqa_linear),
                ("threads", _INT)]


class starqa_step_model(ctypes.Structure):
    _fields_ = [("bf16", _INT), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("dim", _I64), ("inner", _I64), ("eps", _F32), ("attn_norm", _PTR),
                ("qkv", _PTR), ("qkv_bias", _PTR), ("out", _PTR), ("out_bias", _PTR),
                ("mlp_norm", _PTR), ("gate_up", _PTR), ("gate_up_bias", _PTR),
                ("down", _PTR), ("down_bias", _PTR)]


class starqa_step_attention(ctypes.Structure):
    _fields_ = [("kind", _INT), ("scale", _F32), ("own_k", _PTR), ("own_v", _PTR),
                ("capacity", _I64), ("exact", ctypes.POINTER(starqa_key_table)),
                ("topk", ctypes.POINTER(starqa_topk_table)), ("k", _I64), ("skip", _I64),
                ("release", _PTR), ("releases", _I64), ("bias", _F32), ("unbiased", _I64)]


class starqa_decode_args(ctypes.Structure):
    _fields_ = [("layers", _I64), ("model", ctypes.POINTER(starqa_step_model)),
                ("attention", ctypes.POINTER(starqa_step_attention)), ("hidden", _PTR),
                ("m", _I64), ("cos", _PTR), ("sin", _PTR), ("before", _I64),
                ("q_rows", _PTR), ("lse", _PTR), ("threads", _INT)]


class starqa_simd_report(ctypes.Structure):
    _fields_ = [("cap", _INT), ("written", _INT), ("cloned", _INT), ("taken", _INT)]


# _kernels.h's constants (STARQA_*): starqa_step_attention's kinds, starqa_topk_table's drop
STEP_EXACT, STEP_TOPK = 0, 1
DROP_KEYS = 1


def _takes(struct: type[ctypes.Structure]) -> list:
    return [ctypes.POINTER(struct)]


# _kernels.h's prototypes: name → (restype, argtypes)
SIGNATURES = {
    "starqa_attend": (_INT, _takes(starqa_attend_args)),
    "starqa_attend_batch": (_INT, _takes(starqa_attend_batch_args)),
    "starqa_topk_attend": (_INT, _takes(starqa_topk_args)),
    "starqa_topk_select": (_INT, _takes(starqa_select_args)),
    "starqa_int4_mm": (_INT, _takes(starqa_int4_args)),
    "starqa_int4_fast": (_INT, []),
    "starqa_rms_norm": (None, [_INT, _PTR, _I64, _I64, _PTR, _F32, _PTR]),
    "starqa_rope": (_INT, [_INT, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "starqa_rope_table": (None, [_INT, _PTR, _I64, _PTR, _I64, _F32, _PTR, _PTR]),
    "starqa_silu_mul": (None, [_INT, _PTR, _I64, _I64, _PTR]),
    "starqa_add": (None, [_INT, _PTR, _I64, _I64, _PTR, _I64]),
    "starqa_layer_before": (_INT, _takes(starqa_before_args)),
    "starqa_layer_after": (_INT, _takes(starqa_after_args)),
    "starqa_decode_layers": (_INT, _takes(starqa_decode_args)),
    "starqa_simd_paths": (None, _takes(starqa_simd_report)),
    "starqa_source_hash": (ctypes.c_char_p, []),
}

# ---------------------------------------------------------------------------------------
# the library: found, loaded, checked

# STARQA_SIMD caps the kernels' paths (read by _simd.h's simd_cap): unset or avx512 what
# the CPU has, avx2 no AVX-512, none the portable C; tests run each on one CPU.
SIMD_CAPS = ("", "avx512", "avx2", "none")
# a build of the kernels elsewhere, loaded instead of the package's (checked alike): the
# sanitizers' build of .ci/kernels
PATH_VARIABLE = "STARQA_KERNELS_PATH"


def load(path: str | Path) -> ctypes.CDLL:
    """A build of the kernels at `path` with every function's signature set (OSError: not
    loadable here; AttributeError: a build without some function). `library` loads the
    package's own; benchmarks load other builds to compare them."""
    found = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(found, name)
        function.restype, function.argtypes = restype, argtypes
    return found


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled kernels are here and current: state "ok", "missing" (not built,
    or not loadable here) or "stale" (built from sources other than those beside it); path:
    the library looked at (None: none found); detail: why not ok."""
    state: str
    path: Path | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def message(self) -> str:
        """One line for the user: what is wrong and what it costs."""
        what = "missing" if self.state == "missing" else "stale"
        cost = "STARQA_REQUIRE_KERNELS=1 asks for them" if build.required() else \
            "attention and decoding take torch's slower paths"
        return f"starqa's compiled CPU kernels are {what} ({self.detail}): {cost}."

    def hint(self) -> str:
        """The fix to paste: rebuild the library from the sources beside it (where they
        are), or reinstall starqa with a C compiler."""
        folder = Path(__file__).parent
        if build.source_hash(folder) is None:
            return ("install a C compiler (cc), then: pip install --force-reinstall --no-deps "
                    "starqa")
        package = folder / f"_attend{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        target = self.path or package
        fix = f"{shlex.quote(sys.executable)} -m starqa.native.build {shlex.quote(str(target))}"
        root = folder.parent.parent
        if target.parent == folder and (root / "setup.py").exists():  # a checkout's own
            fix += f"  (or: cd {shlex.quote(str(root))} && pip install -e .)"
        return "run: " + fix


def _library_path() -> Path | None:
    """STARQA_KERNELS_PATH, else the package's build (None: not built)."""
    if chosen := os.environ.get(PATH_VARIABLE):
        return Path(chosen)
    folder = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := folder / f"_attend{suffix}").exists():
            return path
    return None


@functools.cache
def _loaded() -> tuple[KernelStatus, ctypes.CDLL | None]:
    """The library and its status, found and checked once per process."""
    path = _library_path()
    if path is None:
        return KernelStatus("missing", None, "not built"), None
    try:
        found = load(path)
    except (OSError, AttributeError) as error:  # another platform's, damaged, or older
        return KernelStatus("missing", path, f"{path.name} not loadable here: {error}"), None
    built, sources = found.starqa_source_hash().decode(), build.source_hash()
    if sources is not None and built != sources:
        return KernelStatus("stale", path, f"{path.name} was built from other sources than "
                                           f"those in {Path(__file__).parent}"), None
    return KernelStatus("ok", path), found


def status() -> KernelStatus:
    """Whether the compiled kernels are here and current (the commands warn where not)."""
    return _loaded()[0]


def require() -> KernelStatus:
    """`status()`; with STARQA_REQUIRE_KERNELS=1, a StarqaError (with the fix) unless ok."""
    found = status()
    if not found.ok and build.required():
        raise StarqaError(found.message(), hint=found.hint())
    return found


@functools.cache
def library():
    """The compiled library with every function's signature set, or None where it is
    missing or stale (see `status`; STARQA_REQUIRE_KERNELS=1: an error instead)."""
    simd = os.environ.get("STARQA_SIMD", "")
    if simd not in SIMD_CAPS:
        raise StarqaError(f"STARQA_SIMD={simd!r} is not one of {', '.join(SIMD_CAPS[1:])}.",
                          hint="run: unset STARQA_SIMD (the kernels then take the widest "
                               "paths the CPU has; avx2 or none cap them, for tests and "
                               "benchmarks)")
    require()
    return _loaded()[1]


@dataclass(frozen=True)
class SimdPaths:
    """The paths the kernels take in this process (`starqa_simd_paths`): levels 2 AVX-512,
    1 AVX2, 0 portable C. cap: STARQA_SIMD's; written: the widest hand-written path
    allowed here; cloned: the build of the multi-versioned loops dispatched to (-1: the
    compiler built one); taken: the levels of those that have run so far."""
    cap: int
    written: int
    cloned: int
    taken: frozenset[int]


def simd_paths() -> SimdPaths | None:
    """What the library reports of its SIMD paths (None: no library)."""
    found = library()
    if found is None:
        return None
    report = starqa_simd_report()
    found.starqa_simd_paths(report)
    return SimdPaths(report.cap, report.written, report.cloned,
                     frozenset(level for level in range(3) if report.taken >> level & 1))


@functools.cache
def int4_path() -> int:
    """Which fast path `starqa_int4_mm` runs here: 2 AVX-512 VNNI, 1 AVX2, 0 none (not
    built, or neither: starqa.models.linear then keeps int4 weights in torch's packed format)."""
    found = library()
    return 0 if found is None else int(found.starqa_int4_fast())


def int4_fast() -> bool:
    """Whether `starqa_int4_mm` runs a fast path here (`int4_path`), so starqa.models.linear
    keeps int4 weights in its tiles."""
    return int4_path() > 0


def int8_gemm_fast() -> bool:
    """Whether torch's int8 GEMM (`torch._int_mm`, the W8A8 prefill of starqa.models.linear)
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


# ---------------------------------------------------------------------------------------
# exact attention's key table, laid out once


class KeyTable:
    """Key and value buffers for `starqa_attend`, laid out once (a shard's blocks, which
    never change), with a slot after them for one that changes at every call (the
    question's own KV): the `starqa_key_table` the kernel reads is built here, not per call
    (that cost ~25 µs a layer with a shard of five blocks: 0.7 ms of SmolLM2's 12 ms decode
    step).

    A buffer is (key address, value address, keys, key head stride, value head stride[,
    key scales' address, value scales' address]), strides in elements; its heads hold
    `keys` rows of D contiguous elements each. With scales (not 0), its rows are int8 with
    an fp32 scale each, laid out as the rows: [H, >= keys], a head stride / D apart.

    biases: added to the score of every key of each laid-out buffer, in order (Phase 2's
    context bias, `methods.ContextBias`; 0 for the buffers past them), never to the changing
    one's (the own keys)."""

    def __init__(self, buffers: Sequence[tuple[int, ...]], keep=(),
                 biases: Sequence[float] = ()):
        self._keep = keep  # what the addresses point into, kept alive with the table
        self.count = count = len(buffers) + 1
        # starts (count + 1), then key and value addresses, key and value head strides, and
        # key and value scales' addresses
        self._arrays = (ctypes.c_int64 * (7 * count + 1))()
        # each buffer's score bias: the laid-out ones', then the changing slot's, 0
        given = list(biases)[:count - 1]
        self._biases = (ctypes.c_float * count)(*given, *[0.0] * (count - len(given)))
        self.keys = 0  # the laid-out buffers' keys, and where the changing one starts
        for index, buffer in enumerate(buffers):
            self._set(index, *buffer)
            self.keys += buffer[2]
        size = ctypes.sizeof(ctypes.c_int64)
        base = ctypes.addressof(self._arrays)
        # the slot after the laid-out buffers is filled by each call (`attend`, and
        # starqa/native/_step.c)
        self.table = starqa_key_table(0, count - 1, base,
                                      *(base + (k * count + 1) * size for k in range(1, 7)),
                                      ctypes.addressof(self._biases))
        self.address = ctypes.addressof(self.table)

    def _set(self, index: int, key: int, value: int, keys: int, key_stride: int,
             value_stride: int, key_scales: int = 0, value_scales: int = 0) -> None:
        arrays, count = self._arrays, self.count
        arrays[index + 1] = self.keys + keys  # (arrays[index] is self.keys already)
        arrays[count + 1 + index] = key
        arrays[2 * count + 1 + index] = value
        arrays[3 * count + 1 + index] = key_stride
        arrays[4 * count + 1 + index] = value_stride
        arrays[5 * count + 1 + index] = key_scales
        arrays[6 * count + 1 + index] = value_scales

    def attend(self, bf16: bool, queries: starqa_queries, result: starqa_outputs,
               own_buffer: tuple[int, ...] | None = None, own: int = 0,
               threads: int = 1) -> int:
        """`starqa_attend` (starqa/native/_attend.c) of fp32 `queries` [heads, rows, dim]
        over the laid-out buffers, then `own_buffer` if given (`own` of its keys the
        queries' own, causally), into `result` (fp32 out [heads, rows, dim] and lse [heads,
        rows]). Returns the kernel's code: 0, 1 for impossible shapes, 2 out of memory."""
        args = starqa_attend_args(self.table, queries, own, result, threads)
        args.table.bf16 = int(bf16)
        if own_buffer is not None:
            self._set(self.count - 1, *own_buffer)
            args.table.pieces = self.count
        return library().starqa_attend(args)

    def attend_batch(self, bf16: bool, queries: starqa_queries, result: starqa_outputs,
                     segments: Sequence[tuple[int, tuple[int, ...]]], threads: int = 1) -> int:
        """`starqa_attend_batch`: `queries` [heads, rows, dim] in segments, each (its rows,
        its own buffer as `attend` takes one, its own keys among them) after the other,
        over the laid-out buffers and each segment's own one."""
        count = len(segments)
        column = lambda values: (ctypes.c_int64 * len(values))(*values)  # noqa: E731
        starts = [0]
        for rows, _, _ in segments:
            starts.append(starts[-1] + rows)
        arrays = [column(starts), *(column([buffer[i] for _, buffer, _ in segments])
                                    for i in (0, 1, 2, 3, 4)),
                  column([own for _, _, own in segments])]
        args = starqa_attend_batch_args(self.table, queries, count,
                                        *(ctypes.addressof(a) for a in arrays), result, threads)
        args.table.bf16 = int(bf16)
        return library().starqa_attend_batch(args)
