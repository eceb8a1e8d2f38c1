"""The oracles the exactness tests compare with, CPU and CUDA alike: plain softmax attention
in fp64, and the checks built on it."""

import math

import torch

from starqa.attention import attend, merge


def reference(query, key, value, causal=False):
    """Plain fp64 softmax attention with repeat_kv, the oracle."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if causal:
        m, n = query.shape[2], key.shape[2]
        mask = torch.ones(m, n, dtype=torch.bool).tril(diagonal=n - m)
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


FUSED_SHAPES = [  # (q_heads, kv_heads, m, n, chunk, head): batch 1, as Phase 2 runs
    (9, 3, 1, 7 * 128 + 37, 128, 0),   # SmolLM2's GQA, a decode token, a partial last chunk
    (12, 2, 1, 3 * 64, 64, 21),        # Qwen2.5's GQA, keys before the documents
    (9, 3, 5, 300, 300, 0),            # one chunk, several query rows (the question)
    (4, 4, 3, 50, 128, 0),             # fewer keys than one chunk
]


def check_chunk_parts(q, k, v, outs, lses, chunk, head, want, budget):
    """`partial_chunks`' parts (on any device) against the fp64 reference on q, k, v: one
    part per `chunk` keys after the `head` keys (plus one for them), each part's LSE its own
    keys' LSE, and their merge within `budget` of `want`. Returns the parts concatenated,
    on the CPU."""
    q_heads, m, n = q.shape[1], q.shape[2], k.shape[2]
    outs, lses = torch.cat(outs).cpu(), torch.cat(lses).cpu()
    bounds = ([0, head] if head else [0]) + list(range(head + chunk, n, chunk)) + [n]
    assert outs.shape[0] == lses.shape[0] == len(bounds) - 1
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        _, part_lse = reference(q, k[:, :, a:b], v[:, :, a:b])
        torch.testing.assert_close(lses[i].reshape(1, q_heads, m).double(), part_lse,
                                   rtol=0, atol=1e-4)
    merged, _ = merge(outs, lses)
    assert (merged.reshape(1, q_heads, m, q.shape[3]).double() - want).abs().max().item() <= budget
    return outs, lses


def exact_part(q, key, value, scale, dtype=torch.float32):
    """attention.attend's partial over a shard, q [Hkv, R, D], in `dtype`: (out, lse)."""
    hkv, r, d = q.shape
    out, lse = attend(q.to(dtype)[None].reshape(1, hkv, r, d), key[None].to(dtype),
                      value[None].to(dtype), scale)
    return out.double(), lse.double()
