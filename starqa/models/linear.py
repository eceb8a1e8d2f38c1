"""Phase 2's linear layers (`Linear`): dense in the compute dtype, or weight-only int8 (per
output channel) or int4 (groups of 32 along the input, asymmetric). int8 runs torch's CPU kernel
(`_weight_int8pack_mm`); int4 runs starqa's (`native.int4_mm`, starqa/native/_int4.c: the weights
in its own tiles, the activations in 14 bits per group of 32, AVX-512 VNNI) where the CPU has
VNNI, else torch's (`_weight_int4pack_mm_for_cpu`, in torch's packed layout). Those kernels
are built for decode's few rows (every weight read once per token: bytes rule); on a 2-core
Zen 5 starqa's reads 1.2-2.9x the bytes per second from memory that torch's does. A forward
of several rows (the question's prefill) is compute-bound instead, and there int8 activations times int8 weights (`torch._int_mm`,
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

from collections.abc import Callable

import torch
import torch.nn.functional as F

from starqa.native import ops as native
from starqa.models.prepared import INT4_GROUP, W8A8_MIN_ROWS, W8A8_MIN_ROWS_TILES


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
