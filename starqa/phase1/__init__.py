"""Phase 1: the context encoded blockwise into per-block KV, one module per method.

Pure compute on one worker: which blocks it encodes is decided by the caller (the method
registry, starqa.methods, picks the method and its blocks). Each block's KV comes out as
(k, v) tensors [L, Hkv, T, D] with RoPE applied at the tokens' original positions, ready to
be stored as a shard. docs/methods.md §1-2.

`blockwise.py` is the forward and per-layer KV recorder every method shares; `star.py` and
`dense.py` hold those two methods, `ring.py`, `pulsar.py` and `apb.py` the others;
`hooks.py` is the bridge into transformers.
"""

from starqa.phase1.dense import encode_dense
from starqa.phase1.star import encode_star

__all__ = ["encode_dense", "encode_star"]
