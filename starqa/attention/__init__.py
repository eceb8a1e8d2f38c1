"""Attention math, pure tensor functions with their layouts in the docstrings: partial
attention with its log-sum-exp and the exact LSE merge (`partial.py`, whose docstring gives
the layout every function shares); the mass an answer's rows put on keys of the same token
(`copymass.py`); the top-k math (`topk.py`)."""

from starqa.attention.partial import (DEFAULT_QUERY_CHUNK, Pieces, attend, attend_fused,
    attend_gemm, causal_attention, fold_gqa, fold_result, fused_available, key_mass, merge,
    partial_chunks, partial_parts, partial_rows)

__all__ = ["DEFAULT_QUERY_CHUNK", "Pieces", "attend", "attend_fused", "attend_gemm",
           "causal_attention", "fold_gqa", "fold_result", "fused_available", "key_mass", "merge",
           "partial_chunks", "partial_parts", "partial_rows"]
