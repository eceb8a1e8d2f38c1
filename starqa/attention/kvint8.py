"""int8 keys and values, scaled per row: the quantisation, and partial attention over it.

Each key row and each value row (D elements of one layer, KV head and token) is stored as
int8 with one fp32 scale, symmetric absmax (per-token quantisation, as in KVQuant, Hooper
et al. 2024, and FlexGen, Sheng et al. 2023; KIVI, Liu et al. 2024, quantises keys per
channel instead, which needs grouping over tokens that a block's rows do not give):

    x [..., N, D]  ≈  data [..., N, D] int8 · scale [..., N, 1]      scale = max|x| / 127

so |x - data · scale| <= scale / 2 = max|x| / 254 element by element, half a step.
Attention needs no dequantised copy of the keys: a score is q · (s_t k_t) = s_t (q · k_t),
and the output Σ_t p_t s^v_t v_t. `attend_int8` is the torch reference (any device),
dequantising a chunk of keys at a time in fp32; starqa/native/_attend.c reads the same
rows on the CPU (`starqa.native.ops.supports`).

Layouts are partial.py's folded ones: q [Hkv, R, D] (R = G*M rows, the position fastest),
key, value [Hkv, N, D]; results out [Hkv, R, D] and lse [Hkv, R], fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KEY_CHUNK = 1024  # keys dequantised at a time by `attend_int8`: [Hkv, 1024, D] fp32


@dataclass(frozen=True)
class Int8Rows:
    """Rows of D int8 elements, each with its fp32 scale: data int8 [..., N, D], scale fp32
    [..., N]; `dtype`, the float dtype they stand for (the cache's: what Phase 2 computes
    in). Indexing indexes the leading dimensions of both (never D), so a layer, a head or a
    range of rows is a view, as for a tensor."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index) -> Int8Rows:
        return Int8Rows(self.data[index], self.scale[index], self.dtype)

    def float(self) -> torch.Tensor:
        """The rows dequantised, fp32."""
        return self.data.float().mul_(self.scale.float().unsqueeze(-1))

    def to(self, *args, **kwargs) -> torch.Tensor:
        """The rows dequantised, then `Tensor.to(*args)` (a dtype, a device or both)."""
        return self.float().to(*args, **kwargs)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` along `dim` (a leading dimension), dequantised: fp32."""
        return Int8Rows(self.data.index_select(dim, index), self.scale.index_select(dim, index)
                        ).float()

    def contiguous(self) -> Int8Rows:
        return Int8Rows(self.data.contiguous(), self.scale.contiguous(), self.dtype)

    def nbytes(self) -> int:
        """Bytes held: the int8 rows and their scales."""
        return self.data.numel() + self.scale.numel() * self.scale.element_size()


def quantize_rows(x: torch.Tensor) -> Int8Rows:
    """x [..., D] (any float dtype) as int8 rows with fp32 scales: scale = max|x| / 127 per
    row, data = round(x / scale) in [-127, 127]; a row of zeros has scale 0. `dtype` is x's."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1) / 127.0  # [...]
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    data = (wide * inverse.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)  # x kept
    return Int8Rows(data, scale, x.dtype)


def is_int8(x) -> bool:
    """Whether `x` is int8 rows (`Int8Rows`), not a float tensor."""
    return isinstance(x, Int8Rows)


def cat_rows(xs: Sequence, dim: int):
    """`torch.cat` of tensors, or of `Int8Rows` (data and scales alike) along a leading
    dimension."""
    if not is_int8(xs[0]):
        return torch.cat(list(xs), dim=dim)
    return Int8Rows(torch.cat([x.data for x in xs], dim=dim),
                    torch.cat([x.scale for x in xs], dim=dim), xs[0].dtype)


def rows_of(x, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of x [H, N, D] (int8 rows or a float tensor) in fp32."""
    part = x[:, start:stop]
    return part.float()


def attend_int8(q: torch.Tensor, key, value, scale: float, own: int = 0,
                chunk: int = KEY_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of folded queries q [Hkv, R, D] over key/value [Hkv, N, D], each
    `Int8Rows` or a float tensor, in fp32: `chunk` keys dequantised at a time, the chunks'
    partial results merged by their LSE as they come (nothing the size of the keys is
    made). own = M > 0: the last M keys are the queries' own, attended causally (row r sees
    the keys before N - M + r % M + 1), as `partial.partial_rows`. Returns out [Hkv, R, D]
    and lse [Hkv, R], fp32 (a row that sees no key: 0 and -inf)."""
    heads, rows, dim = q.shape
    n = key.shape[1]
    qf = q.float()
    out = qf.new_zeros(heads, rows, dim)
    lse = qf.new_full((heads, rows), -math.inf)
    limit = None
    if own:  # each row's first hidden key
        limit = n - own + torch.arange(rows, device=q.device) % own + 1  # [R]
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        scores = torch.matmul(qf, rows_of(key, start, stop).transpose(1, 2)).mul_(scale)
        if limit is not None and stop > n - own:
            hidden = torch.arange(start, stop, device=q.device)[None, :] >= limit[:, None]
            scores.masked_fill_(hidden, -math.inf)  # [R, c] over every head
        part_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, R]
        safe = torch.where(torch.isinf(part_lse), torch.zeros_like(part_lse), part_lse)
        probs = scores.sub_(safe.unsqueeze(-1)).exp_()
        out, lse = merge_two(out, lse, torch.matmul(probs, rows_of(value, start, stop)),
                             part_lse)
    return out, lse


def attend_int8_parts(q: torch.Tensor, parts: Sequence[tuple], scale: float, own: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_int8` over the keys of several buffers (key, value) [Hkv, N_i, D] in order
    (each `Int8Rows` or a float tensor), as if they were one; the own keys, if any, are the
    last `own` of the last buffer. Returns out [Hkv, R, D] and lse [Hkv, R], fp32."""
    if own and (not parts or parts[-1][0].shape[1] < own):
        raise ValueError(f"int8 attention: {own} own keys past the last buffer's")
    heads, rows, dim = q.shape
    out = q.new_zeros(heads, rows, dim, dtype=torch.float32)
    lse = q.new_full((heads, rows), -math.inf, dtype=torch.float32)
    for index, (key, value) in enumerate(parts):
        last = index == len(parts) - 1
        out, lse = merge_two(out, lse, *attend_int8(q, key, value, scale, own if last else 0))
    return out, lse


def merge_two(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
              part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge (`partial.merge`) of two partial results: out [..., R, D], lse
    [..., R], fp32; a part with lse -inf weighs nothing."""
    top = torch.maximum(lse, part_lse).clamp_(min=torch.finfo(torch.float32).min)
    first, second = torch.exp(lse - top), torch.exp(part_lse - top)
    total = first + second
    merged = (first.unsqueeze(-1) * out + second.unsqueeze(-1) * part_out)
    merged.div_(total.clamp(min=1e-30).unsqueeze(-1))
    return merged, total.log_().add_(top)
