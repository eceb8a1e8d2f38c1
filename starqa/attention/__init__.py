"""Attention math: partial attention with its log-sum-exp, and the exact LSE merge
(`partial.py`); the mass an answer's rows put on keys of the same token (`copymass.py`); the
top-k math (`topk.py`).

Pure tensor functions, no I/O and no distributed code. Layout everywhere is the one
transformers hands to attention functions:

    query: [B, Hq,  M, D]     key, value: [B, Hkv, N, D]     Hq = G * Hkv (GQA)

Query head `h` reads KV head `h // G` (transformers' `repeat_kv` order). Outputs are fp32:

    out: [B, Hq, M, D]        lse: [B, Hq, M]   (natural log of the softmax denominator)

A partial result `(out, lse)` over one slice of the keys merges with the others exactly
(`merge`), so attention over a sharded cache equals attention over the concatenated cache.
"""

from starqa.attention.partial import (DEFAULT_QUERY_CHUNK, Pieces, attend, attend_fused,
    attend_gemm, causal_attention, fold_gqa, fold_result, fused_available, key_mass, merge,
    partial_chunks, partial_parts, partial_rows)

__all__ = ["DEFAULT_QUERY_CHUNK", "Pieces", "attend", "attend_fused", "attend_gemm",
           "causal_attention", "fold_gqa", "fold_result", "fused_available", "key_mass", "merge",
           "partial_chunks", "partial_parts", "partial_rows"]
