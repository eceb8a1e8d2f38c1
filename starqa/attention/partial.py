"""Attention math: partial attention with its log-sum-exp, and the exact LSE merge.

Pure tensor functions, no I/O and no distributed code. Layout everywhere is the one
transformers hands to attention functions:

    query: [B, Hq,  M, D]     key, value: [B, Hkv, N, D]     Hq = G * Hkv (GQA)

Query head `h` reads KV head `h // G` (transformers' `repeat_kv` order). Outputs are fp32:

    out: [B, Hq, M, D]        lse: [B, Hq, M]   (natural log of the softmax denominator)

A partial result `(out, lse)` over one slice of the keys merges with the others exactly
(`merge`), so attention over a sharded cache equals attention over the concatenated cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from starqa.attention.kvint8 import attend_int8_parts, is_int8
from starqa.core.blocks import split_at
from starqa.native import ops as native

# Scores are materialised for this many query rows at a time: [B, Hkv, G*rows, N] fp32.
DEFAULT_QUERY_CHUNK = 256


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    *,
    causal: bool = False,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `query` over `key`/`value`, with the LSE, computed in fp32.

    causal=False: every query sees every key (a cached shard lying wholly before the query).
    causal=True: the mask is aligned bottom-right, i.e. the M queries are the *last* M of the
    N keys' positions: query i sees key j iff j <= i + (N - M). (SDPA's `is_causal` aligns
    top-left, which is wrong whenever N > M.)

    Returns (out [B, Hq, M, D] fp32, lse [B, Hq, M] fp32). A query row that sees no key at all
    gets out = 0 and lse = -inf, so it carries zero weight in `merge`.
    """
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_attn_func()
        if flash is not None:
            return _attend_flash(flash, query, key, value, scale, causal)

    batch, q_heads, m, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} not a multiple of KV heads {kv_heads}")
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    if n == 0:
        return (query.new_zeros(query.shape, dtype=torch.float32),
                query.new_full((batch, q_heads, m), -math.inf, dtype=torch.float32))

    # [B, Hkv, G, M, D]: grouping the query heads avoids repeating K/V G times; each chunk
    # is flattened to [B, Hkv, G*c, D] so the score matmul is a plain batched GEMM.
    q = query.reshape(batch, kv_heads, groups, m, dim).float()
    k_t = key.float().transpose(-1, -2)  # [B, Hkv, D, N]
    v = value.float()
    outs, lses = [], []
    for start in range(0, m, query_chunk):
        stop = min(start + query_chunk, m)
        rows = stop - start
        q_chunk = q[:, :, :, start:stop].reshape(batch, kv_heads, groups * rows, dim)
        scores = torch.matmul(q_chunk, k_t).mul_(scale)  # [B, Hkv, G*c, N]
        if causal:
            last_key = torch.arange(start, stop, device=query.device) + (n - m)  # [c]
            hidden = torch.arange(n, device=query.device)[None, :] > last_key[:, None]
            scores.masked_fill_(hidden.repeat(groups, 1), -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G*c]
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp_(scores.sub_(safe.unsqueeze(-1)))
        outs.append(torch.matmul(probs, v).view(batch, kv_heads, groups, rows, dim))
        lses.append(lse.view(batch, kv_heads, groups, rows))
    out = torch.cat(outs, dim=3).reshape(batch, q_heads, m, dim)
    lse = torch.cat(lses, dim=3).reshape(batch, q_heads, m)
    return out, lse


def fold_gqa(query: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """query [1, Hq, M, D] → [1, Hkv, G*M, D]: the G = Hq / Hkv query heads of a KV head as
    rows, so unmasked GQA attention needs no repeated K/V (every row sees every key)."""
    _, q_heads, m, dim = query.shape
    return query.to(dtype).reshape(1, kv_heads, q_heads // kv_heads * m, dim)


def fold_result(out: torch.Tensor, lse: torch.Tensor, kv_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`'s (out [1, Hq, M, D], lse [1, Hq, M]) as one part in `fold_gqa`'s layout:
    ([1, Hkv, G*M, D], [1, Hkv, G*M]), the layout of `partial_chunks`' parts."""
    return out.reshape(1, kv_heads, -1, out.shape[-1]), lse.reshape(1, kv_heads, -1)


def partial_chunks(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                   chunk: int, head: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Unmasked partial attentions of folded queries q [1, Hkv, R, D] over each run of
    `chunk` consecutive keys of key/value [1, Hkv, N, D] (N >= 1), in the keys' dtype; with
    `head`, the first `head` keys are one part of their own and the runs start after them.

    The keys are viewed (no copy) as C = N // chunk batch entries [C, Hkv, chunk, D] of one
    fused kernel call, which also spreads a single question's work over every core (a call
    over [1, Hkv, N, D] has only Hkv work items); a last partial chunk is one more call.
    Returns the parts as lists (one entry per kernel call, to be concatenated once with the
    caller's other parts): outs [c_i, Hkv, R, D] in the keys' dtype and lses [c_i, Hkv, R]
    fp32, in key order, (head > 0) + ceil((N - head) / chunk) parts in all.
    """
    outs, lses = [], []
    if head:
        out, lse = _fused(q, key[:, :, :head], value[:, :, :head], scale)
        outs.append(out), lses.append(lse)
        key, value = key[:, :, head:], value[:, :, head:]
    kv_heads, n, dim = key.shape[1], key.shape[2], key.shape[3]
    count, full = n // chunk, n // chunk * chunk
    if count:
        k = key[0, :, :full].view(kv_heads, count, chunk, dim).transpose(0, 1)  # [C,Hkv,c,D]
        v = value[0, :, :full].view(kv_heads, count, chunk, dim).transpose(0, 1)
        out, lse = _fused(q.expand(count, -1, -1, -1), k, v, scale)
        outs.append(out), lses.append(lse)
    if full < n:
        out, lse = _fused(q, key[:, :, full:], value[:, :, full:], scale)
        outs.append(out), lses.append(lse)
    return outs, lses


def partial_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of folded queries q [Hkv, R, D] (R = G*M rows, M fastest, see
    `fold_gqa`) over key/value [Hkv, N, D] (N >= 1; rows contiguous, heads any distance
    apart, so a slice of a longer buffer is read in place).

    own = M > 0: the last M keys are the M queries' own, attended causally (query i sees
    the first i + 1 of them); every other key is seen by every query. Returns out
    [Hkv, R, D] and lse [Hkv, R], fp32, for `merge`.

    On CPU, starqa's compiled kernel (starqa/native/_attend.c: one pass over the keys, fp32
    scores, softmax and output; see there why) where it was built, else `attend_gemm`."""
    return partial_parts(q, [(key, value)], scale, own)


def partial_parts(q: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  scale: float, own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_rows` over the keys of several buffers (key, value) [Hkv, N_i, D] in order,
    as if they were one (the own keys, if any, are the last `own` of them all): a shard's
    blocks read where they lie, then the question's own keys. A buffer may be int8 rows
    (`kvint8.Int8Rows`: int8 KV), the own keys then all in the last buffer. One kernel
    call; without the compiled kernel, `attend_gemm` over their concatenation (int8 rows:
    `kvint8.attend_int8_parts`, a chunk of keys dequantised at a time)."""
    if _native_fits(parts) and not (own and is_int8(parts[-1][0])):
        return native.attend(q, [_native_part(*part) for part in parts], scale, own)
    if any(is_int8(key) for key, _ in parts):
        return attend_int8_parts(q, parts, scale, own)
    if len(parts) == 1:
        return attend_gemm(q, *parts[0], scale, own)
    return attend_gemm(q, torch.cat([key for key, _ in parts], dim=1),
                       torch.cat([value for _, value in parts], dim=1), scale, own)


class Pieces:
    """Buffers (key, value) [Hkv, N_i, D] attended as one sequence of keys: those given here,
    which never change (a shard's blocks, read where they lie), then at each call one more
    that does (the question's own KV). `attend` is `partial_parts` over them; with the
    compiled kernel their table is laid out once (`native.Layout`), not at every call.
    bias: added to the score of every key of the buffers given here but their first
    `unbiased` keys, never to the buffer given at each call (Phase 2's context bias,
    `methods.ContextBias`: the shard's keys at shared positions weigh e^bias each; the
    keys before them, held once, and the own keys 1)."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], bias: float = 0.0,
                 unbiased: int = 0):
        before, after = split_at(parts, unbiased if bias else 0)
        self.parts, self.split = before + after, len(before)
        self.bias = bias
        self.biases = [0.0] * len(before) + [bias] * len(after)  # each part's
        # the compiled kernel's table (None: torch's code), read by starqa/native/_step.c too
        self.layout = native.Layout([_native_part(*part) for part in self.parts],
                                    self.biases) if _native_fits(self.parts) else None

    def attend(self, q: torch.Tensor, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None, scale: float = 1.0, own: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`partial_parts` of folded queries q [Hkv, R, D] over these buffers, then over
        key/value [Hkv, M, D] if given (`own` of its keys the queries' own)."""
        layout = self.layout
        if layout is not None and (key is None or layout.dtype in (None, key.dtype)
                                   and native.supports(key, value)):
            return layout.attend(q, key, value, scale, own)
        if not self.bias or not self.parts:
            return partial_parts(q, self.parts + ([(key, value)] if key is not None else []),
                                 scale, own)
        # torch's code: the unbiased buffers a part, the biased ones another, the own keys a
        # third, merged
        split, outs, lses = self.split, [], []
        for parts, bias in ((self.parts[:split], 0.0), (self.parts[split:], self.bias)):
            if parts:
                out, lse = partial_parts(q, parts, scale)
                outs.append(out), lses.append(lse + bias)
        if key is not None:
            out, lse = partial_parts(q, [(key, value)], scale, own)
            outs.append(out), lses.append(lse)
        return merge(outs, lses) if len(outs) > 1 else (outs[0], lses[0])

    def batched(self, owns: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether `attend_batch` takes these own buffers (key, value) [Hkv, N, D]: the
        compiled kernel, each of the laid-out buffers' dtype."""
        layout = self.layout
        return layout is not None and all(
            layout.dtype in (None, key.dtype) and native.supports(key, value)
            for key, value in owns) and len({key.dtype for key, _ in owns}) == 1

    def attend_batch(self, q: torch.Tensor, owns: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                                 int]],
                     rows: Sequence[int], scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several questions' folded rows q [Hkv, R, D] (`rows[s]` each, in order) over these
        buffers, read once, each then over its own key/value (`owns[s]`: [Hkv, N_s, D] and
        how many are its rows' own), where `batched`: each row what `attend` gives it
        alone, bit for bit."""
        return self.layout.attend_batch(q, owns, rows, scale)


def _native_fits(parts: Sequence[tuple]) -> bool:
    """Whether the compiled kernel takes these buffers (key, value): float ones of one dtype
    that `native.supports` takes, and int8 rows that `native.supports_int8` takes."""
    floats = [(key, value) for key, value in parts if not is_int8(key)]
    return native.available() and len({key.dtype for key, _ in floats}) <= 1 and \
        all(native.supports(key, value) for key, value in floats) and \
        all(native.supports_int8(key.data, key.scale, value.data, value.scale)
            for key, value in parts if is_int8(key))


def _native_part(key, value) -> tuple:
    """A buffer as `native.Layout` takes it: (key, value), or int8 rows (data, data, key
    scales, value scales)."""
    if is_int8(key):
        return key.data, value.data, key.scale, value.scale
    return key, value


def attend_gemm(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_rows` by two GEMMs in the keys' dtype (any device). The GEMMs accumulate in
    fp32, but the scores leave the first one rounded to the keys' dtype (as transformers'
    eager attention in that dtype rounds them) and the probabilities are rounded to it for
    the second (as torch's flash kernel does); softmax and LSE are fp32. In fp32 nothing
    is rounded."""
    # Scores head by head: each head's keys [:N] are contiguous even when they are a slice
    # of a longer buffer, which one batched GEMM over the slice would first copy.
    heads, rows, n = key.shape[0], q.shape[1], key.shape[1]
    q = q.to(key.dtype)  # bf16 rows over fp32 keys (top-k's sink) are widened exactly
    raw = q.new_empty(heads, rows, n, dtype=key.dtype)
    for head in range(heads):
        torch.mm(q[head], key[head].t(), out=raw[head])
    scores = raw.float().mul_(scale)  # [Hkv, R, N]
    if own > 1:
        hidden = torch.ones(own, own, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., -own:].masked_fill_(hidden.repeat(rows // own, 1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, R]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_().to(value.dtype)
    return torch.matmul(probs, value).float(), lse


def attend_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float | None = None, chunk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` without a mask, in the keys' dtype, by the fused kernel (CPU: torch's flash
    kernel, which returns its LSE; CUDA: flash-attn), over chunks of `chunk` keys merged by
    their LSE (default: one chunk). query [1, Hq, M, D], key/value [1, Hkv, N, D] (N >= 1).
    Returns out [1, Hq, M, D] fp32 and lse [1, Hq, M] fp32, equal to `attend`'s up to the
    kernel's rounding."""
    _, q_heads, m, dim = query.shape
    scale = dim**-0.5 if scale is None else scale
    q = fold_gqa(query, key.shape[1], key.dtype)
    outs, lses = partial_chunks(q, key, value, scale, chunk or key.shape[2])
    out, lse = merge(torch.cat(outs), torch.cat(lses))
    return out.reshape(1, q_heads, m, dim), lse.reshape(1, q_heads, m)


def fused_available(query: torch.Tensor) -> bool:
    """Whether `partial_chunks` has a fused kernel for tensors like `query` (CPU and CUDA:
    always, by torch's own kernels where flash-attn is missing)."""
    return query.device.type in ("cpu", "cuda")


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused non-causal attention call, [B, H, M, D] over [B, H, N, D] (same H), with
    its LSE [B, H, M] fp32 (natural log); `causal` (CPU, M = N only): the causal mask.

    CPU: torch's flash kernel. CUDA: flash-attn when installed, else torch's flash kernel
    (fp16/bf16, head dim <= 256), else torch's memory-efficient kernel (any dtype), each of
    which returns its LSE."""
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    half = q.dtype in (torch.float16, torch.bfloat16)
    flash = _flash_attn_func() if half else None
    if flash is not None:
        return _attend_flash(flash, q, k, v, scale, False)
    if half and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads its LSE's rows to a multiple of 32


def merge(outs: list[torch.Tensor] | torch.Tensor, lses: list[torch.Tensor] | torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attentions over disjoint key sets.

    outs: P tensors [..., M, D] (or one stacked [P, ..., M, D]); lses: P tensors [..., M].

        lse = logsumexp_p(lse_p)          out = sum_p exp(lse_p - lse) * out_p

    Parts whose lse is -inf (no keys) get weight 0; rows with no keys anywhere stay 0 / -inf.
    Returns fp32. (Written out with the running maximum rather than torch.logsumexp: on a
    decode step this runs once per layer on tiny tensors, where each op's fixed cost rules.)
    """
    out_stack = torch.stack(list(outs)) if isinstance(outs, (list, tuple)) else outs
    lse_stack = torch.stack(list(lses)) if isinstance(lses, (list, tuple)) else lses
    # A row with no keys anywhere has top = -inf: the clamp keeps its weights exp(-inf) = 0
    # instead of exp(-inf + inf) = nan; its total is then 0 and its lse log(0) = -inf.
    top = lse_stack.amax(dim=0).float().clamp_(min=torch.finfo(torch.float32).min)
    weights = torch.exp(lse_stack - top)  # [P, ..., M], the largest part's weight is 1
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * out_stack).sum(dim=0)
    out.div_(total.clamp(min=1e-30).unsqueeze(-1))
    return out, total.log_().add_(top)


def key_mass(query: torch.Tensor, key: torch.Tensor, scale: float, lse: torch.Tensor) -> torch.Tensor:
    """Attention probability each key receives, summed over query heads and rows.

    query [B, Hq, M, D], key [B, Hkv, N, D], lse [B, Hq, M]: the *global* log-normaliser
    (after the merge), so a shard's keys get their true share of the whole cache's mass.
    Returns [N] fp32: sum over b, h, m of exp(q_bhm · k_n * scale - lse_bhm).
    """
    batch, q_heads, m, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, groups * m, dim)
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*M, N]
    norm = lse.float().reshape(batch, kv_heads, groups * m, 1)
    return torch.exp_(scores.sub_(norm)).sum(dim=(0, 1, 2))


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Plain causal self-attention for Phase 1 (queries are the last M of N keys).

    Uses the fastest kernel available (flash-attn on CUDA, else torch SDPA in the input
    dtype); no LSE. Returns [B, Hq, M, D] in the input dtype.
    """
    m, n = query.shape[2], key.shape[2]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_attn_func()
        if flash is not None:
            out = flash(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        softmax_scale=scale, causal=True)
            return out.transpose(1, 2)
    groups = query.shape[1] // key.shape[1]
    if m == n:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=groups > 1)
    if query.device.type == "cpu" and query.shape[0] == 1:
        return after_prefix(query, key, value, scale).to(query.dtype)
    # SDPA's is_causal aligns top-left; spell out the bottom-right mask instead.
    mask = torch.ones(m, n, dtype=torch.bool, device=query.device).tril(diagonal=n - m)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def after_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of M queries that are the last M of N keys (N > M), on the CPU, as
    two fused calls merged by their LSE: every query over the N - M keys before them (no
    mask, the GQA heads folded into rows) and over its own M keys causally (where the
    kernel's top-left mask is the right one). SDPA with the bottom-right mask spelled out
    computes every score and costs more than the causal attention of all N rows; this
    computes only the M (N - M) + M^2 / 2 scores (a Phase 1 block after its anchor, or
    after the blocks before it). query [1, Hq, M, D], key/value [1, Hkv, N, D]; returns
    [1, Hq, M, D] fp32."""
    _, q_heads, m, dim = query.shape
    kv_heads, before = key.shape[1], key.shape[2] - m
    scale = dim**-0.5 if scale is None else scale
    q = fold_gqa(query, kv_heads, key.dtype)
    prefix_out, prefix_lse = _fused(q, key[:, :, :before], value[:, :, :before], scale)
    own_out, own_lse = _fused(query.to(key.dtype), key[:, :, before:], value[:, :, before:],
                              scale, causal=True)  # maps query head h to KV head h // G
    out, _ = merge([prefix_out.reshape(own_out.shape), own_out],
                   [prefix_lse.reshape(own_lse.shape), own_lse])
    return out


# ---------------------------------------------------------------------------------------
# flash-attn (optional, CUDA only), imported lazily


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _attend_flash(flash, query, key, value, scale, causal):
    # flash-attn layout is [B, T, H, D]; it maps GQA heads itself and aligns `causal`
    # bottom-right, which is what `attend` promises. LSE comes back as [B, H, M] fp32.
    out, lse, _ = flash(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2).float(), lse.float()
