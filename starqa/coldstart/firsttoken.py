"""A cold ask's first token, computed before torch is imported.

A cold `ask` on one machine answers in its head start (starqa.coldstart.headstart), and `import
torch` alone takes 0.65-1.05 s on a 2-core CPU, more than llama.cpp's whole cold
answer. Yet nothing a CPU forward of the question needs is torch's: the prepared int4 weights
and the shard are files to map, and every kernel of the forward is starqa's own C
(starqa/native/_int4.c, _rows.c, _attend.c, through starqa.native.kernels). So the head start runs
the question's forward here, on numpy arrays (bf16 held as its 16 bits), streams the first
token, and only then imports torch; the torch path (`starqa.phase2.decode.Batch`, given the
`Prefill`) adopts the question's KV and goes on from the second token, exactly where its own
forward of the question would have left it.

The forward is `starqa.models.decoder.Decoder.forward` on the CPU, step for step: the same
kernels, in the same order, on the same bits (embedding rows, RMSNorm, the int4 product
with 14-bit activations, its bias, RoPE from the prepared file's inv_freq and attention factor
(a scaled RoPE's, starqa.models.rope; a context whose length gives other frequencies, dynamic
past its window or longrope past its original one, is the torch path's), attention over
the shard's blocks and the question's own keys, the fp32 → bf16 rounding of its output,
the residual adds, SiLU·mul, the final norm, the LM head), so the question's KV, the first
token and the rows kept for source attribution are the very ones the torch path computes
(tests/test_firsttoken.py compares them bit for bit). It applies where that forward is the
one Phase 2 runs: a world of one on the CPU, bf16, int4 weights in starqa's tiles (AVX-512
VNNI), exact attention, a question of fewer than W8A8_MIN_ROWS_TILES tokens (longer ones
run W8A8, torch's int8 GEMM) and a prepared file already written (a context whose blocks
share positions too: its `Manifest.context_bias` lies in the shard's key tables, as in
the torch path's). Elsewhere `prefill` returns None and the torch path answers from the
start, as before. STARQA_FIRST_TOKEN=0 turns it off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from starqa.native import kernels
from starqa.core import tensorfile
from starqa.core.blocks import split_at
from starqa.cache.manifest import Manifest, block_file, read_manifest
from starqa.models import cuda_available
from starqa.models.prepared import (W8A8_MIN_ROWS_TILES, DecoderConfig, installed_torch_version,
    prepared_file, prepared_stamp)
from starqa.cache.shards import verify_checksums
from starqa.runtime.protocol import AskJob, Event, Job, Token


@dataclass
class Prefill:
    """The question's forward, for the torch path to go on from (`ShardAttention.adopt`).
    Arrays hold bf16 bits (uint16) unless said otherwise."""

    ids: list[int]  # the question's token ids
    hidden: np.ndarray  # [1, H]: the last row's hidden state after the final norm
    keys: list[np.ndarray]  # per layer the question's keys [Hkv, M, D] (RoPE applied)
    values: list[np.ndarray]  # per layer its values [Hkv, M, D]
    queries: list[np.ndarray]  # per layer its queries folded [Hkv, G, M, D] (sources)
    lses: list[np.ndarray]  # per layer their LSE [Hkv, G, M], fp32
    token: int  # the token the last row picked
    emitted: list[int]  # what was streamed: [token], or [] for a stop token
    started: float  # time.perf_counter() when the forward started, and when it
    picked: float  # picked the token


@dataclass
class _Linear:
    tiles: np.ndarray  # uint8 [N / 16, K / 32, 320] (starqa/native/_int4.c)
    bias: np.ndarray | None  # [N]

    @property
    def outputs(self) -> int:
        return self.tiles.shape[0] * 16


class _Model:
    """The prepared int4 weights, memory-mapped (`starqa.models.decoder.Decoder.tensors` names)."""

    def __init__(self, config: DecoderConfig, arrays: dict):
        self.config, self.arrays = config, arrays
        self.embed, self.norm, self.inv_freq = arrays["embed"], arrays["norm"], arrays["inv_freq"]
        # a RoPE scaling's factor on cos and sin (yarn, longrope), kept where it is not 1
        self.rope_attention = float(arrays["rope_attention"][0]) \
            if "rope_attention" in arrays else 1.0
        self.lm_head = self.linear("lm_head")

    def linear(self, prefix: str) -> _Linear:
        return _Linear(self.arrays[f"{prefix}.weight"], self.arrays.get(f"{prefix}.bias"))


def applies(job: Job) -> bool:
    """Whether the job is a question this module can start (the rest is `prefill`'s to
    check: the files)."""
    library = kernels.library()
    return (os.environ.get("STARQA_FIRST_TOKEN", "1") != "0" and library is not None
            and kernels.int4_fast() and isinstance(job, AskJob) and not job.topk
            and job.weights == "int4" and job.dtype == "bfloat16"
            and job.device in ("auto", "cpu") and not _gpu_device(job)
            and 0 < len(job.query_ids) < W8A8_MIN_ROWS_TILES)


def _gpu_device(job: AskJob) -> bool:
    return job.device != "cpu" and cuda_available()


def prefill(job: Job, emit: Callable[[Event], None], threads: int | None = None
            ) -> Prefill | None:
    """Run the question's forward for `job` (a head start's ask) on `threads` threads
    (default `kernels.cpu_threads()`) and `emit(Token(...))` its first token unless that is
    a stop token; None (nothing emitted) where this path does not apply or the prepared
    weights are not there yet. Errors in the context's files (a corrupt shard) raise what
    the torch path would."""
    if not applies(job):
        return None
    manifest = read_manifest(Path(job.context_dir))
    model = _load_model(Path(job.model_path))
    if model is None or model.config.rope.key(manifest.query_position) is not None:
        return None  # no file yet; or RoPE frequencies of this context's length, not the file's
    result = _forward(model, _shard_tables(manifest, model.config), list(job.query_ids),
                      manifest.query_position, threads or kernels.cpu_threads())
    if result.token not in set(job.stop_ids):
        emit(Token(id=result.token))
        result.emitted = [result.token]
    return result


def _load_model(folder: Path) -> _Model | None:
    """The prepared int4 weights (tiles) of the model in `folder`, mapped; None when there
    is no such file with the stamp the torch path would check (it then builds it)."""
    version = installed_torch_version()
    path = prepared_file(folder, "int4", "bfloat16")
    if version is None or not path.exists():
        return None
    try:
        arrays, metadata = tensorfile.map_arrays(path)
    except (OSError, ValueError, KeyError):
        return None
    if metadata != prepared_stamp(folder, "int4", version, int4_tiles=True):
        return None
    config = DecoderConfig.read(folder)
    linears = ["lm_head", *(f"{i}.{name}" for i in range(config.layers)
                            for name in ("qkv", "out", "gate_up", "down"))]
    if any(arrays[f"{name}.weight"].dtype != np.uint8 or arrays[f"{name}.weight"].ndim != 3
           for name in linears):  # a shape the tiles do not take stayed dense
        return None
    return _Model(config, arrays)


def _shard_tables(manifest: Manifest, config: DecoderConfig) -> list[kernels.KeyTable]:
    """Per layer the kernel's table of every block's keys and values (all the context's
    blocks: a world of one), mapped in place, checksums verified first; their keys' scores
    moved by the context's bias (`Manifest.context_bias`: not those before the shared
    positions, a block holding both cut in two there), the own keys' not."""
    indices = list(range(len(manifest.blocks)))
    verify_checksums(manifest, indices, contents=True)
    blocks = [tensorfile.map_arrays(manifest.folder / block_file(i))[0] for i in indices]
    bias = manifest.context_bias
    tables = []
    for layer in range(config.layers):
        parts = []
        for block in blocks:
            k, v = block["k"][layer], block["v"][layer]  # [Hkv, T, D]
            if k.dtype == np.int8 and v.dtype == np.int8:  # int8 KV: rows and their scales
                parts.append((k, v, block["k_scale"][layer], block["v_scale"][layer]))
            elif k.dtype != np.uint16 or v.dtype != np.uint16:
                raise ValueError("a shard that is not bf16")
            else:
                parts.append((k, v))
        before, after = split_at(parts, bias.unbiased(0))
        tables.append(kernels.KeyTable([_buffer(*part) for part in before + after],
                                       keep=blocks,
                                       biases=[0.0] * len(before) + [bias.value] * len(after)))
    return tables


def _buffer(k: np.ndarray, v: np.ndarray, k_scale: np.ndarray | None = None,
            v_scale: np.ndarray | None = None) -> tuple[int, ...]:
    """A `kernels.KeyTable` buffer of a block's keys and values [Hkv, T, D] (bf16 bits, or
    int8 rows with their scales [Hkv, T])."""
    if k_scale is None:
        return k.ctypes.data, v.ctypes.data, k.shape[1], k.strides[0] // 2, v.strides[0] // 2
    return (k.ctypes.data, v.ctypes.data, k.shape[1], k.strides[0], v.strides[0],
            k_scale.ctypes.data, v_scale.ctypes.data)


def _forward(model: _Model, tables: Sequence[kernels.KeyTable], ids: list[int], start: int,
             threads: int) -> Prefill:
    """`Decoder.forward` of `ids` at positions from `start`, then the last row's token."""
    library, c = kernels.library(), model.config
    started = time.perf_counter()
    m, d, heads, kv = len(ids), c.head_dim, c.heads, c.kv_heads
    group = heads // kv

    def linear(x: np.ndarray, lin: _Linear) -> np.ndarray:
        y = np.empty((x.shape[0], lin.outputs), dtype=np.uint16)
        code = library.starqa_int4_mm(kernels.starqa_int4_args(
            1, x.ctypes.data, x.shape[0], x.shape[1], lin.tiles.ctypes.data, lin.outputs, 1,
            y.ctypes.data, 1, threads))
        if code:
            raise MemoryError() if code == 2 else ValueError("int4 kernel: impossible shapes")
        if lin.bias is not None:
            library.starqa_add(1, y.ctypes.data, y.shape[0], y.shape[1], lin.bias.ctypes.data, 0)
        return y

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        y = np.empty_like(x)
        library.starqa_rms_norm(1, x.ctypes.data, x.shape[0], x.shape[1], weight.ctypes.data,
                                c.eps, y.ctypes.data)
        return y

    def address(lin: _Linear) -> kernels.starqa_linear:
        bias = None if lin.bias is None else lin.bias.ctypes.data
        return kernels.starqa_linear(lin.tiles.ctypes.data, bias)

    def check(code: int) -> None:
        if code:
            raise MemoryError() if code == 2 else ValueError("decoder layer: impossible shapes")

    positions = np.arange(start, start + m, dtype=np.int64)
    cos, sin = np.empty((m, d), dtype=np.uint16), np.empty((m, d), dtype=np.uint16)
    inv_freq = np.ascontiguousarray(model.inv_freq, dtype=np.float32)
    library.starqa_rope_table(1, positions.ctypes.data, m, inv_freq.ctypes.data, d,
                              model.rope_attention, cos.ctypes.data, sin.ctypes.data)
    hidden = np.ascontiguousarray(model.embed[np.asarray(ids, dtype=np.int64)])  # [M, H]
    keys, values, queries, lses = [], [], [], []
    for layer in range(c.layers):
        prefix = f"{layer}."
        # the layer before its attention, one call (starqa/native/_layer.c, as Decoder.forward)
        qkv = np.empty((m, heads + 2 * kv, d), dtype=np.uint16)
        check(library.starqa_layer_before(kernels.starqa_before_args(
            1, hidden.ctypes.data, m, hidden.shape[1],
            model.arrays[prefix + "attn_norm"].ctypes.data, c.eps,
            address(model.linear(prefix + "qkv")), qkv.shape[1] * d, heads + kv, d,
            cos.ctypes.data, sin.ctypes.data, qkv.ctypes.data, threads)))
        key = np.ascontiguousarray(qkv[:, heads:heads + kv].transpose(1, 0, 2))  # [Hkv, M, D]
        value = np.ascontiguousarray(qkv[:, heads + kv:].transpose(1, 0, 2))
        # query heads of a KV head as rows (attention.fold_gqa): [Hkv, G M, D]
        folded = np.ascontiguousarray(qkv[:, :heads].transpose(1, 0, 2)).reshape(
            kv, group * m, d)
        q = _widen(folded)
        out = np.empty((kv, group * m, d), dtype=np.float32)
        lse = np.empty((kv, group * m), dtype=np.float32)
        own = (key.ctypes.data, value.ctypes.data, m, m * d, m * d)
        code = tables[layer].attend(
            True, kernels.starqa_queries(q.ctypes.data, kv, group * m, d),
            kernels.starqa_outputs(d**-0.5, out.ctypes.data, lse.ctypes.data), own, m, threads)
        if code:
            raise MemoryError() if code == 2 else ValueError("attention kernel: shapes")
        attended = _narrow(out.reshape(heads, m, d).transpose(1, 0, 2).reshape(m, heads * d))
        # the layer after it, one call
        gate_up = model.linear(prefix + "gate_up")
        check(library.starqa_layer_after(kernels.starqa_after_args(
            1, hidden.ctypes.data, m, hidden.shape[1], attended.ctypes.data, attended.shape[1],
            address(model.linear(prefix + "out")), model.arrays[prefix + "mlp_norm"].ctypes.data,
            c.eps, address(gate_up), gate_up.outputs // 2,
            address(model.linear(prefix + "down")), threads)))
        keys.append(key), values.append(value)
        queries.append(folded.reshape(kv, group, m, d)), lses.append(lse.reshape(kv, group, m))
    last = norm(np.ascontiguousarray(hidden[-1:]), model.norm)
    logits = _widen(linear(last, model.lm_head))[0]
    token = int(np.argmax(logits))  # the first of equal maxima, as torch's argmax
    return Prefill(ids=ids, hidden=last, keys=keys, values=values, queries=queries, lses=lses,
                   token=token, emitted=[], started=started, picked=time.perf_counter())


def _widen(x: np.ndarray) -> np.ndarray:
    """bf16 bits → fp32, exactly."""
    return (x.astype(np.uint32) << 16).view(np.float32)


def _narrow(x: np.ndarray) -> np.ndarray:
    """fp32 → bf16 bits, to nearest even (torch's rounding; finite values)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
