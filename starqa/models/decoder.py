"""Phase 2's model: a lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2),
over weights read straight from the model folder's safetensors.

Why not transformers' module tree: a decode step is ~20 small kernels per layer, and at one
token the per-module Python work of `LlamaForCausalLM.forward` costs as much as the math.
Here q/k/v are one matmul and gate/up another, RoPE is two fused multiply-adds, and nothing
but tensors flows between layers. transformers stays the reference: `tests/test_decoder.py`
compares this forward with its logits, and Phase 1 still runs through its attention
registry (starqa.phase1.hooks). No transformers import here, so a cold `ask` does not pay for it.

Shapes (batch 1 throughout, dropped where it would only be noise):

    ids, positions: [M]       hidden: [M, H]        per layer, to `attention`:
    query [1, Hq, M, D]   key, value [1, Hkv, M, D] (RoPE applied)  →  out [1, Hq, M, D]

Weights are `Linear`s: dense in the compute dtype, or weight-only int8 (per output channel)
or int4 (groups of 32 along the input, asymmetric). int8 runs torch's CPU kernel
(`_weight_int8pack_mm`); int4 runs starqa's (`native.int4_mm`, starqa/native/_int4.c: the weights
in its own tiles, the activations in 14 bits per group of 32, AVX-512 VNNI) where the CPU has
VNNI, else torch's (`_weight_int4pack_mm_for_cpu`, in torch's packed layout). Those kernels
are built for decode's few rows (every weight read once per token: bytes rule); on a 2-core
Zen 5 starqa's reads 1.2-2.9x the bytes per second from memory that torch's does. A forward of several rows (the question's prefill) is
compute-bound instead, and there int8 activations times int8 weights (`torch._int_mm`,
VNNI on x86) run about 4x faster than torch's int4 kernel: quantised formats keep an int8
copy for it (int8: the weight itself), see `Linear.__call__`. On the CPU, RMSNorm and RoPE
are starqa's kernels too (starqa/native/_rows.c, one call each where torch runs ~8 operators), and
where every linear is in starqa's int4 tiles a layer's steps before and after its attention
are one call each (starqa/native/_layer.c: the same kernels, the same bits, without ~10 calls'
overhead a layer: SmolLM2's step at one row 10-13 -> 7.4-9.5 ms on a 2-core Zen 3).
The model's part of a forward with starqa's kernels against torch's: 1.4-1.6x faster for
SmolLM2 and Qwen2.5-Coder-1.5B at one row and at four (benchmarks/dev/decode_step.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from starqa.native import ops as native
from starqa.core.errors import StarqaError
from starqa.models import WEIGHT_FORMATS, weight_files
from starqa.models.prepared import (INT4_GROUP, W8A8_MIN_ROWS, W8A8_MIN_ROWS_TILES, DecoderConfig,
    prepared_file, prepared_stamp)

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepPlan:
    """A forward's attention as starqa/native/_step.c takes it (`native.decode_layers`): words [L,
    A] int64, the own keys written `before` this forward's, and where each layer's folded
    query rows [L, Hkv, G * M, D] and their LSE [L, Hkv, G * M] (fp32) go."""
    words: torch.Tensor
    before: int
    q_rows: torch.Tensor
    lse: torch.Tensor


# (rows M, the model's dtype, query heads, KV heads, head size) → the attention's StepPlan
# for a forward of M rows, or None for the layer-by-layer loop
Compiled = Callable[[int, torch.dtype, int, int, int], "StepPlan | None"]


class Linear:
    """y = x Wᵀ (+ b) for x [M, K]: `weight` [N, K] dense, or weight-only int8 (`weight`
    int8 [N, K], `scale` [N]) or int4: starqa's tiles (`weight` uint8 [N / 16, K / 32, 320],
    scales and zeros inside, `scale` None; starqa/native/_int4.c) or torch's packed CPU layout
    (`scale` the scales and zeros [K / 32, N, 2]). Quantised formats also hold `w8` (int8
    [N, K]) and `w8_scale` (fp32 [N]): the weight per output channel in int8, for forwards
    of `w8a8_rows` rows or more (for int8 these are the weight and its scale).

    release: given where the weights are memory-mapped (`tensorfile.FileMap.release`). An
    int4 layer's int8 copy serves a question's prefill only, so its pages are released
    after each forward that read it: a process that answers holds the decode's int4
    weights, not both (SmolLM2: 99 MiB of int8 copies, Qwen2.5-Coder-1.5B: 1.3 GB); the
    next prefill maps them again from the page cache."""

    def __init__(self, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, w8: torch.Tensor | None = None,
                 w8_scale: torch.Tensor | None = None,
                 release: Callable[[torch.Tensor], None] | None = None):
        if fmt != "dense":
            # The packed kernels read past 64-byte alignment assumptions: a tensor mapped
            # from a safetensors file at an unaligned offset crashes _weight_int8pack_mm.
            weight = _aligned(weight)
            scale = None if scale is None else _aligned(scale)
        if fmt == "int8":
            w8, w8_scale = weight, scale.float()
        self.format, self.weight, self.scale, self.bias = fmt, weight, scale, bias
        self.w8 = None if w8 is None else _aligned(w8)
        self.w8_scale = w8_scale
        self._release = release if fmt == "int4" else None  # int8's w8 is its decode weight
        # forwards of this many rows or more run W8A8 (where there is an int8 copy); with
        # the tiles, none where torch's int8 GEMM is slow (`native.int8_gemm_fast`)
        tiles = fmt == "int4" and scale is None
        self.w8a8_rows = W8A8_MIN_ROWS if not tiles else \
            W8A8_MIN_ROWS_TILES if native.int8_gemm_fast() else None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 dtype: torch.dtype, rows: bool = True) -> Linear:
        """`weight` [N, K] in format `fmt`; dense where the CPU kernels do not apply (CUDA;
        int4 needs K a multiple of 32 and N of 16). int4 is starqa's tiles where its fast
        kernel runs (`native.int4_fast`), else torch's layout. rows=False: only ever called
        on one row (the LM head, on the last position), so int4 keeps no int8 copy."""
        bias = None if bias is None else bias.to(dtype)
        n, k = weight.shape
        if weight.device.type != "cpu" or fmt == "int4" and (k % INT4_GROUP or n % 16):
            fmt = "dense"
        if fmt == "int8":
            q, scale = _int8_per_channel(weight)
            return cls(fmt, q, scale.to(dtype), bias)
        if fmt == "int4":
            copy = _int8_per_channel(weight) if rows else (None, None)
            if native.int4_fast():
                return cls(fmt, _int4_tiles(weight.float()), None, bias, *copy)
            return cls(fmt, *_int4_pack(weight.float(), dtype), bias, *copy)
        return cls("dense", weight.to(dtype).contiguous(), None, bias)

    def __call__(self, x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """rowwise: compute every row as a forward of that row alone would, bit for bit
        (no W8A8; torch's int8/int4 kernels are row-independent), so a forward that checks
        drafted tokens picks exactly the tokens one-token steps would."""
        if (self.w8 is not None and self.w8a8_rows is not None and x.shape[0] >= self.w8a8_rows
                and not rowwise):
            y = _w8a8(x, self.w8, self.w8_scale)
            if self._release is not None:
                self._release(self.w8)
        elif self.format == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        elif self.format == "int4" and self.scale is None:  # starqa's tiles
            y = native.int4_mm(x, self.weight)
        elif self.format == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scale)
        else:
            return F.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        found = {"weight": self.weight, "scale": self.scale, "bias": self.bias}
        if self.format == "int4":
            found.update(w8=self.w8, w8_scale=self.w8_scale)
        return {f"{prefix}.{k}": v for k, v in found.items() if v is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str,
                     release: Callable[[torch.Tensor], None] | None = None) -> Linear:
        weight = tensors[f"{prefix}.weight"]
        fmt = {torch.uint8: "int4", torch.int8: "int8"}.get(weight.dtype, "dense")
        return cls(fmt, weight, *(tensors.get(f"{prefix}.{k}")
                                  for k in ("scale", "bias", "w8", "w8_scale")), release)

    def nbytes(self) -> int:
        """Bytes of the weights a decode step reads (the W8A8 copy serves prefill only)."""
        return sum(t.nbytes for t in (self.weight, self.scale, self.bias) if t is not None)


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight [N, K] ≈ q · scale[:, None]. Returns q int8
    [N, K] and scale fp32 [N]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def _w8a8(x: torch.Tensor, w8: torch.Tensor, w8_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] Wᵀ with x quantised to int8 per row (dynamic, symmetric) and W int8 per
    output channel: one int8 x int8 → int32 GEMM, rescaled by both scales, in x's dtype."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp_(min=1e-12)  # [M, 1]
    xq = torch.round(xf / x_scale).to(torch.int8)
    acc = torch._int_mm(xq, w8.t())  # [M, N] int32
    return (acc.float().mul_(x_scale).mul_(w8_scale)).to(x.dtype)


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def _int4_levels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of INT4_GROUP along K: w ≈ (q - 8) · scale + zero, where
    zero = min + 8 · scale, so q = 0..15 spans [min, max] of the group. Returns q [N, K]
    (int32), scale and zero [N, K / group] (fp32)."""
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.int32).view(n, k), scale, low + 8 * scale


def _int4_pack(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`_int4_levels` in torch's packed CPU layout, and scales_and_zeros [K / group, N, 2]."""
    q, scale, zero = _int4_levels(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _int4_tiles(w: torch.Tensor) -> torch.Tensor:
    """`_int4_levels` in starqa/native/_int4.c's tiles (its docstring draws them): uint8 [N / 16,
    K / 32, 320], per tile and group 256 bytes of nibbles, 16 bf16 scales, 16 bf16 zeros."""
    q, scale, zero = _int4_levels(w)
    n, k = q.shape
    tiles, groups = n // 16, k // INT4_GROUP
    # q[16 t + lane, 32 g + 16 h + 4 c + j] → nibble h of byte (t, g, 64 c + 4 lane + j)
    q = q.to(torch.uint8).view(tiles, 16, groups, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(tiles, groups, 256)

    def per_tile(x: torch.Tensor) -> torch.Tensor:  # [N, G] → bf16 bytes [T, G, 32]
        return x.to(torch.bfloat16).view(tiles, 16, groups).transpose(1, 2).contiguous() \
            .view(torch.uint8)

    return torch.cat([nibbles, per_tile(scale), per_tile(zero)], dim=-1).contiguous()


LINEARS = ("qkv", "out", "gate_up", "down")


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    out: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class Decoder:
    """The model for Phase 2: `forward` runs every layer, calling `attention` for each."""

    def __init__(self, config: DecoderConfig, embed: torch.Tensor, layers: list[Layer],
                 norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype, weights: str,
                 inv_freq: torch.Tensor | None = None):
        self.config, self.embed, self.layers = config, embed, layers
        self.norm, self.lm_head, self.dtype, self.weights = norm, lm_head, dtype, weights
        d = config.head_dim
        # transformers' default RoPE: inv_freq in fp32, angles position · inv_freq in fp32
        # (kept in the prepared file, so starqa.coldstart.firsttoken has these very bits)
        self.inv_freq = (1.0 / (config.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)) if inv_freq is None
                         else inv_freq.float()).to(embed.device)
        self.scale = d ** -0.5
        self.native_rows = (native.rows_supported(embed.device, dtype) and d % 2 == 0
                            and d <= 512 and all(t.is_contiguous() for t in self._norms()))
        # each layer's steps around its attention in one compiled call each
        # (starqa/native/_layer.c): where every linear is starqa's int4 tiles; a forward of
        # `layer_rows` rows or more (not rowwise) takes the W8A8 copies instead
        linears = [lin for layer in layers for lin in (layer.qkv, layer.out, layer.gate_up,
                                                       layer.down)]
        self.layer_kernels = self.native_rows and all(
            lin.format == "int4" and lin.scale is None and lin.weight.is_contiguous()
            and (lin.bias is None or lin.bias.is_contiguous()) for lin in linears)
        self.layer_rows = min((lin.w8a8_rows for lin in linears
                               if lin.w8 is not None and lin.w8a8_rows is not None),
                              default=float("inf"))
        # every layer of a forward in one call where the attention offers its words
        # (`forward`'s `compiled`; starqa/native/_step.c): the layers' words, laid out once
        self.step_words = native.step_words([(
            dtype == torch.bfloat16, config.hidden, config.heads, config.kv_heads, d,
            layer.gate_up.weight.shape[0] * 8, float(config.eps), layer.attn_norm,
            layer.qkv.weight, layer.qkv.bias, layer.out.weight, layer.out.bias,
            layer.mlp_norm, layer.gate_up.weight, layer.gate_up.bias, layer.down.weight,
            layer.down.bias) for layer in layers]) if self.layer_kernels else None

    def _norms(self) -> list[torch.Tensor]:
        return [self.norm, *(w for layer in self.layers for w in (layer.attn_norm,
                                                                   layer.mlp_norm))]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [M, 1, D] in the compute dtype for `positions` [M]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [M, D/2]
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                rowwise: bool = False, compiled: Compiled | None = None) -> torch.Tensor:
        """Hidden states [M, H] after the final norm, for token `ids` [M] at `positions` [M].
        rowwise: each row's arithmetic is that of a one-token forward (see `Linear`): for
        checking drafted tokens (starqa.phase2.decode.generate), not for a question's prefill.
        compiled: the attention as words of starqa/native/_step.c for a forward of M rows (a
        `StepPlan`; None where it has none: `decode.ShardAttention.compiled`): where each
        layer's steps run in one call, every layer of the forward is then one call, the
        same kernels in the same order (the same bits) without the ~20 tensor operations
        and ctypes calls a layer between them."""
        c = self.config
        m = ids.shape[0]
        q_size = c.heads * c.head_dim
        # on the CPU RMSNorm, RoPE and SiLU·mul are starqa's kernels (starqa/native/_rows.c: one
        # call each where torch runs several operators, transformers' roundings; the same
        # bits as starqa.coldstart.firsttoken's forward)
        if self.native_rows:
            norm, rotate, silu_mul = native.rms_norm, native.rope_, native.silu_mul
            cos, sin = native.rope_table(positions, self.inv_freq, self.dtype)
        else:
            norm, rotate, silu_mul = _rms_norm, _rotate, _silu_mul
            cos, sin = self.rope(positions)
        hidden = self.embed[ids]  # [M, H], this forward's own (updated in place when fused)
        fused = self.layer_kernels and (rowwise or m < self.layer_rows)
        plan = None if not fused or compiled is None or self.step_words is None else \
            compiled(m, self.dtype, c.heads, c.kv_heads, c.head_dim)
        if plan is not None:
            native.decode_layers(self.step_words, plan.words, hidden, cos, sin, plan.before,
                                 plan.q_rows, plan.lse)
            return norm(hidden, self.norm, c.eps)
        for index, layer in enumerate(self.layers):
            if fused:  # the same kernels in the same order, one call: the same bits
                qkv = qk = native.layer_before(hidden, layer.attn_norm, c.eps,
                                               (layer.qkv.weight, layer.qkv.bias),
                                               c.heads + c.kv_heads, c.head_dim, cos, sin)
            else:
                x = norm(hidden, layer.attn_norm, c.eps)
                qkv = layer.qkv(x, rowwise).view(m, c.heads + 2 * c.kv_heads, c.head_dim)
                qk = rotate(qkv, c.heads + c.kv_heads, cos, sin)  # RoPE on q and k at once
            q, k = qk[:, :c.heads], qk[:, c.heads:c.heads + c.kv_heads]
            v = qkv[:, c.heads + c.kv_heads:]
            out = attention(index, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                            v.transpose(0, 1)[None])  # [1, Hq, M, D]
            attended = out[0].transpose(0, 1).reshape(m, q_size).to(self.dtype)
            if fused:
                native.layer_after(hidden, attended.contiguous(), (layer.out.weight,
                                   layer.out.bias), layer.mlp_norm, c.eps,
                                   (layer.gate_up.weight, layer.gate_up.bias),
                                   (layer.down.weight, layer.down.bias))
                continue
            hidden = hidden + layer.out(attended, rowwise)
            x = norm(hidden, layer.mlp_norm, c.eps)
            hidden = hidden + layer.down(silu_mul(layer.gate_up(x, rowwise)), rowwise)
        return norm(hidden, self.norm, c.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, vocab] logits for hidden states [M, H]."""
        return self.lm_head(hidden)

    def nbytes(self) -> int:
        linears = [self.lm_head, *(lin for layer in self.layers
                                   for lin in (layer.qkv, layer.out, layer.gate_up, layer.down))]
        return self.embed.nbytes + sum(lin.nbytes() for lin in linears)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every prepared weight by name (what `prepared_cache` saves)."""
        out = {"embed": self.embed, "norm": self.norm, "inv_freq": self.inv_freq.cpu(),
               **self.lm_head.tensors("lm_head")}
        for i, layer in enumerate(self.layers):
            out[f"{i}.attn_norm"], out[f"{i}.mlp_norm"] = layer.attn_norm, layer.mlp_norm
            for name in LINEARS:
                out.update(getattr(layer, name).tensors(f"{i}.{name}"))
        if self.lm_head.weight is self.embed:  # tied and dense: one tensor, stored once
            del out["lm_head.weight"]
        return out

    @classmethod
    def from_tensors(cls, config: DecoderConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype, weights: str,
                     release: Callable[[torch.Tensor], None] | None = None) -> Decoder:
        """The decoder of `Decoder.tensors`' tensors; release: where they are memory-mapped,
        what drops a tensor's pages (`Linear`)."""
        tensors.setdefault("lm_head.weight", tensors["embed"])
        layers = [Layer(attn_norm=tensors[f"{i}.attn_norm"], mlp_norm=tensors[f"{i}.mlp_norm"],
                        **{n: Linear.from_tensors(tensors, f"{i}.{n}", release)
                           for n in LINEARS})
                  for i in range(config.layers)]
        return cls(config, tensors["embed"], layers, tensors["norm"],
                   Linear.from_tensors(tensors, "lm_head"), dtype, weights,
                   tensors.get("inv_freq"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel scales before rounding to the input dtype: bf16 results may
    # differ from transformers' LlamaRMSNorm (and starqa's CPU kernel) by one rounding.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on heads [0, heads) of x [M, H, D] (transformers' rotate_half convention),
    returned as [M, heads, D]: each product and the sum rounded to the dtype."""
    x = x[:, :heads]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def load_decoder(folder: Path, dtype: torch.dtype, weights: str = "dense",
                 device: torch.device | str = "cpu") -> Decoder:
    """The model in `folder` for Phase 2, with its linear layers in `weights` format.

    Quantised weights are prepared once and kept next to the model, in
    `.starqa-phase2-<weights>-<dtype>.safetensors` (keyed by the weights' hash, the torch
    version, whose packed int4 layout may change, and for int4 whose layout it holds), so
    later loads only map them; `ingest` prepares them as it ends (`prepare_weights`), so the
    first `ask` finds them. A load that finds none builds them (waiting for a process that
    is building them already); a folder starqa may not write to is quantised at every load
    instead."""
    _check_format(weights)
    config = DecoderConfig.read(folder)
    if weights == "dense" or torch.device(device).type != "cpu":
        return _build(folder, config, dtype, weights, device)
    target = _Prepared.of(folder, weights, dtype)
    if (decoder := target.load(config, dtype, weights)) is not None:
        return decoder
    with target.lock():
        if (decoder := target.load(config, dtype, weights)) is not None:
            return decoder  # another process built it while this one waited
        decoder = _build(folder, config, dtype, weights, device)
        target.save(decoder)
    return decoder


def prepare_weights(folder: Path, dtype: torch.dtype, weights: str,
                    on_build: Callable[[], contextlib.AbstractContextManager] | None = None
                    ) -> bool:
    """Write the model's prepared weights for `weights` and `dtype` beside it, unless
    current ones are there already: what `ingest` runs as it ends, so that the first `ask`
    maps them instead of building them before its answer. `on_build()`: a context shown
    while they are built (the caller's progress status). Returns whether they were built.
    Dense weights (nothing to prepare) and an architecture Phase 2 does not run return
    False (ask says why); a folder starqa may not write to, False too (ask quantises)."""
    _check_format(weights)
    if weights == "dense":
        return False
    try:
        config = DecoderConfig.read(folder)
    except StarqaError:
        return False
    target = _Prepared.of(folder, weights, dtype)
    if target.load(config, dtype, weights) is not None:
        return False
    with target.lock():
        if target.load(config, dtype, weights) is not None:
            return False  # a concurrent ingest or ask built them while this one waited
        with on_build() if on_build is not None else contextlib.nullcontext():
            return target.save(_build(folder, config, dtype, weights, "cpu"))


def _check_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise StarqaError(f"Unknown weight format {weights!r}.",
                          hint=f"choose one of: {', '.join(WEIGHT_FORMATS)}")


@dataclass(frozen=True)
class _Prepared:
    """One prepared weights file: where it lives and the stamp its metadata must carry.

    Written whole or not at all: into a staging file beside it (`<name>.<random>.tmp`),
    then renamed over it, so a reader maps the old file or the whole new one, and a crash
    leaves only a staging file, never used, removed by the next build. Builders take the
    file's lock (`<name>.lock`, an exclusive `flock`), so two processes that find none
    build it once: the second waits, then maps the first one's."""

    path: Path
    stamp: dict

    @classmethod
    def of(cls, folder: Path, weights: str, dtype: torch.dtype) -> _Prepared:
        return cls(prepared_file(folder, weights, str(dtype).removeprefix("torch.")),
                   prepared_stamp(folder, weights, torch.__version__, native.int4_fast()))

    def load(self, config: DecoderConfig, dtype: torch.dtype, weights: str) -> Decoder | None:
        """The decoder of the file when it is there, whole and current; else None."""
        from starqa.core import tensorfile
        from starqa.core.errors import ShardError

        try:
            # Memory-mapped, not read: the file keeps every tensor 64-byte aligned (what the
            # packed kernels want), so nothing is copied, a page is read only when used (a
            # question's prefill reads the int8 copies, decode the int4 weights) and every
            # process on the machine shares one copy in the page cache. Reading Qwen2.5-
            # Coder-1.5B's 2.7 GB took 2 s of a cold ask; mapping it takes milliseconds.
            if tensorfile.header(self.path)[1].get("__metadata__") == self.stamp:
                tensors, _, mapped = tensorfile.map_file(self.path)
                return Decoder.from_tensors(config, tensors, dtype, weights, mapped.release)
        except (OSError, ValueError, KeyError, RuntimeError, ShardError):  # absent, damaged
            pass
        return None

    @contextlib.contextmanager
    def lock(self):
        """Hold the builders' lock (none where the folder is read-only: nothing is written
        there, so there is nothing to race on); staging files a crash left are removed."""
        try:
            handle = open(self.path.with_suffix(".lock"), "a")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                for leftover in self.path.parent.glob(f"{self.path.stem}.*.tmp"):
                    leftover.unlink(missing_ok=True)
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def save(self, decoder: Decoder) -> bool:
        """Write `decoder`'s tensors as this file (staged, then renamed in). Returns whether
        it was written (False: a folder starqa may not write to)."""
        from starqa.core import tensorfile

        try:
            fd, tmp = tempfile.mkstemp(prefix=f"{self.path.stem}.", suffix=".tmp",
                                       dir=self.path.parent)
        except OSError:  # read-only model folder: quantise again next time
            return False
        os.close(fd)
        try:
            tensorfile.save_aligned(decoder.tensors(), Path(tmp), self.stamp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except OSError:  # a full disk: the next load builds again
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True


def _build(folder: Path, config: DecoderConfig, dtype: torch.dtype, weights: str,
           device: torch.device | str) -> Decoder:
    """The decoder from the model's own safetensors, quantising as `weights` says."""
    from safetensors import safe_open


    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise StarqaError(f"{folder} has no weight {name}.", hint="is it a complete model?")
        return tensors.pop(name).to(device)

    def maybe(name: str) -> torch.Tensor | None:
        return tensors.pop(name).to(device) if name in tensors else None

    def linear(names: list[str]) -> Linear:
        weight = torch.cat([get(n + ".weight") for n in names])
        biases = [maybe(n + ".bias") for n in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return Linear.quantize(weight, bias, weights, dtype)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        layers.append(Layer(
            attn_norm=get(p + "input_layernorm.weight").to(dtype),
            qkv=linear([p + f"self_attn.{x}_proj" for x in "qkv"]),
            out=linear([p + "self_attn.o_proj"]),
            mlp_norm=get(p + "post_attention_layernorm.weight").to(dtype),
            gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
            down=linear([p + "mlp.down_proj"])))
    embed = get("model.embed_tokens.weight").to(dtype)
    head = embed if config.tied else get("lm_head.weight")
    return Decoder(config, embed, layers, get("model.norm.weight").to(dtype),
                   Linear.quantize(head, None, weights, dtype, rows=False), dtype, weights)
