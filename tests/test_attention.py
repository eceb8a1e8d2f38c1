"""The exact LSE merge: attention over N shards merged equals attention over all keys."""

import math

import pytest
import torch

from starqa.attention import attend, causal_attention, merge

from oracles import FUSED_SHAPES, check_chunk_parts, reference  # tests/oracles.py


SHAPES = [  # (batch, q_heads, kv_heads, m, n, dim)
    (1, 4, 4, 7, 33, 16),
    (2, 9, 3, 5, 100, 64),   # SmolLM2's GQA 9/3
    (1, 12, 2, 1, 257, 32),  # Qwen2.5's GQA 12/2, one decode token
    (1, 8, 1, 300, 40, 8),   # MQA, more queries than one chunk
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_merge_over_shards_equals_full_attention(shape, shards):
    b, hq, hkv, m, n, d = shape
    g = torch.Generator().manual_seed(hash((shape, shards)) % 2**31)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h, t in ((hq, m), (hkv, n), (hkv, n)))
    cuts = torch.linspace(0, n, shards + 1).round().long().tolist()
    parts = [attend(q, k[:, :, s:e], v[:, :, s:e], query_chunk=64) for s, e in zip(cuts, cuts[1:])]
    out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = reference(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_shard_before_causal_tail_equals_causal_attention(shape):
    """Phase 2 layout: a cached shard (no mask) + the query's own KV (causal, bottom-right)."""
    b, hq, hkv, m, n, d = shape
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, m, d, generator=g)
    k, v = torch.randn(b, hkv, n + m, d, generator=g), torch.randn(b, hkv, n + m, d, generator=g)
    shard = attend(q, k[:, :, :n], v[:, :, :n])
    own = attend(q, k[:, :, n:], v[:, :, n:], causal=True, query_chunk=16)
    out, lse = merge([shard[0], own[0]], [shard[1], own[1]])
    ref_out, ref_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_empty_shard_has_no_weight():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    empty = attend(q, k[:, :, :0], v[:, :, :0])
    assert torch.all(empty[1] == -math.inf) and torch.all(empty[0] == 0)
    full = attend(q, k, v)
    out, lse = merge([empty[0], full[0]], [empty[1], full[1]])
    torch.testing.assert_close(out, full[0])
    torch.testing.assert_close(lse, full[1])


def test_causal_attention_matches_reference_in_fp32():
    q, k, v = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    torch.testing.assert_close(causal_attention(q, k, v).double(), reference(q, k, v, True)[0],
                               rtol=1e-5, atol=1e-5)
    # more keys than queries: bottom-right alignment
    k2, v2 = torch.randn(1, 2, 15, 8), torch.randn(1, 2, 15, 8)
    torch.testing.assert_close(causal_attention(q, k2, v2).double(),
                               reference(q, k2, v2, True)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("before, m", [(1, 9), (40, 17), (300, 300)])
def test_causal_attention_after_a_prefix_in_bf16_is_as_close_as_sdpa(before, m):
    """Phase 1 after past KV (star's anchor, dense's earlier blocks), on the CPU: two fused
    calls merged by their LSE; its error against fp64 within twice that of SDPA with the
    bottom-right mask spelled out (both round their output to bf16)."""
    g = torch.Generator().manual_seed(before + m)
    q = torch.randn(1, m, 12, 64, generator=g).transpose(1, 2)  # strided, as transformers'
    k, v = (torch.randn(1, 2, before + m, 64, generator=g) for _ in range(2))
    ref = reference(q, k, v, True)[0]
    got = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
    mask = torch.ones(m, before + m, dtype=torch.bool).tril(diagonal=before)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, scale=0.125, enable_gqa=True)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + 1e-3


def test_bf16_inputs_are_computed_in_fp32():
    """bf16 K/V/Q in, fp32 out: the error is the inputs' rounding, not the math's."""
    q, k, v = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 50, 32), torch.randn(1, 2, 50, 32)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = attend(qb, kb, vb)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, _ = reference(qb.float(), kb.float(), vb.float())
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,m,n,chunk,head", FUSED_SHAPES)
def test_fused_chunks_within_the_reference_error(dtype, q_heads, kv_heads, m, n, chunk, head):
    """The fused kernel over chunks of the keys, merged by LSE, against fp64: its error is
    bounded by twice that of a plain computation in the same dtype (SDPA's math path, which
    rounds scores and probabilities as the dtype does), as flash-attention's tests bound it."""
    from starqa.attention import attend_fused, fold_gqa, partial_chunks

    torch.manual_seed(n)
    q = torch.randn(1, q_heads, m, 64, dtype=dtype)
    k, v = torch.randn(1, kv_heads, n, 64, dtype=dtype), torch.randn(1, kv_heads, n, 64, dtype=dtype)
    want, want_lse = reference(q, k, v)
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(q_heads // kv_heads, 1), v.repeat_interleave(q_heads // kv_heads, 1))
    budget = 2 * (plain.double() - want).abs().max().item() + 1e-6
    out, lse = attend_fused(q, k, v, chunk=chunk)
    assert out.dtype == lse.dtype == torch.float32
    assert (out.double() - want).abs().max().item() <= budget
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-4)
    # The parts themselves: one per chunk (plus the head), each an exact partial attention.
    outs, lses = partial_chunks(fold_gqa(q, kv_heads, dtype), k, v, 64 ** -0.5, chunk, head)
    outs, lses = check_chunk_parts(q, k, v, outs, lses, chunk, head, want, budget)


ROW_SHAPES = [  # (q_heads, kv_heads, m, n, dim, own): batch 1, as Phase 2 runs
    (9, 3, 1, 7 * 512 + 37, 64, 0),  # SmolLM2 decode: several kernel tasks, partial blocks
    (12, 2, 1, 1000, 128, 1),        # Qwen2.5 decode, the last key the token's own
    (9, 3, 5, 300, 64, 5),           # a question's prefill after a shard: causal tail
    (9, 3, 5, 300, 64, 0),           # the same rows on a worker without the question
    (12, 2, 13, 13, 128, 13),        # only the question's own keys
    (4, 4, 3, 50, 32, 0),            # another head size: the portable loops
    (8, 2, 2, 70, 80, 2),            # a head size that is no multiple of 16
]


@pytest.mark.parametrize("kernel", ["native", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,m,n,dim,own", ROW_SHAPES)
def test_partial_rows_within_the_reference_error(kernel, dtype, q_heads, kv_heads, m, n, dim,
                                                 own):
    """Phase 2's CPU attention over a slice of a longer buffer (the shard, then the
    question's keys), against fp64. starqa's kernel computes in fp32 from the inputs, so
    its error is fp32 rounding (1e-5) whatever the dtype; the GEMM fallback rounds scores
    and probabilities to the dtype, so it is bounded by twice the error of transformers'
    eager attention in that dtype, which rounds them the same way."""
    from starqa.native import ops as native
    from starqa.attention import attend_gemm, fold_gqa, partial_rows

    if kernel == "native" and not native.available():
        pytest.skip("starqa's kernel is not built here")
    torch.manual_seed(n + dim)
    q = torch.randn(1, q_heads, m, dim, dtype=dtype)
    buffer = torch.randn(2, kv_heads, n + 7, dim, dtype=dtype)  # room after the keys
    k, v = buffer[0, :, :n], buffer[1, :, :n]
    want, want_lse = reference(q, k[None], v[None], causal=own > 0)
    groups = q_heads // kv_heads
    scores = q @ k[None].repeat_interleave(groups, 1).transpose(-1, -2) * dim ** -0.5
    if own:
        scores = scores.masked_fill(~torch.ones(m, n, dtype=torch.bool).tril(n - m), -math.inf)
    eager = torch.softmax(scores, -1, dtype=torch.float32).to(dtype) @ \
        v[None].repeat_interleave(groups, 1)
    budget = 2 * (eager.double() - want).abs().max().item() + 1e-6
    rows = fold_gqa(q, kv_heads, dtype)[0]
    out, lse = (partial_rows if kernel == "native" else attend_gemm)(rows, k, v, dim ** -0.5,
                                                                     own)
    assert out.shape == (kv_heads, groups * m, dim) and lse.shape == (kv_heads, groups * m)
    assert out.dtype == lse.dtype == torch.float32
    error = (out.reshape(1, q_heads, m, dim).double() - want).abs().max().item()
    assert error <= (1e-5 if kernel == "native" else budget)
    torch.testing.assert_close(lse.reshape(1, q_heads, m).double(), want_lse, rtol=0,
                               atol=1e-5 if kernel == "native" else 1e-2)


@pytest.mark.parametrize("kernel", ["native", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("own", [0, 4])
def test_partial_parts_reads_its_buffers_as_one(kernel, dtype, own, monkeypatch):
    """The shard's blocks where they lie, then the question's own keys: pieces of unequal
    lengths (one shorter than a kernel task, one longer, one empty), each a slice of its
    own buffer with its own head stride, attended as the one buffer they make, against
    fp64: within fp32 rounding for the kernel, as `partial_rows` is; the fallback (no
    compiled kernel) concatenates them for `attend_gemm`."""
    from starqa.native import ops as native
    from starqa.attention import attend_gemm, fold_gqa, partial_parts

    if kernel == "native" and not native.available():
        pytest.skip("starqa's kernel is not built here")
    if kernel == "gemm":
        monkeypatch.setattr(native, "supports", lambda key, value=None: False)
    torch.manual_seed(own)
    q_heads, kv_heads, m, dim = 9, 3, 4, 64
    lengths = [37, 0, 1300, own or 5]
    buffers = [torch.randn(2, kv_heads, n + 3 * i, dim, dtype=dtype)
               for i, n in enumerate(lengths)]  # each with room of its own after its keys
    parts = [(b[0, :, :n], b[1, :, :n]) for b, n in zip(buffers, lengths)]
    k = torch.cat([key for key, _ in parts], dim=1)
    v = torch.cat([value for _, value in parts], dim=1)
    q = torch.randn(1, q_heads, m, dim, dtype=dtype)
    want, want_lse = reference(q, k[None], v[None], causal=own > 0)
    rows = fold_gqa(q, kv_heads, dtype)[0]
    out, lse = partial_parts(rows, parts, dim ** -0.5, own)
    if kernel == "gemm":  # exactly the fallback over the concatenation
        for got, expected in zip((out, lse), attend_gemm(rows, k, v, dim ** -0.5, own)):
            assert torch.equal(got, expected)
        return
    error = (out.reshape(1, q_heads, m, dim).double() - want).abs().max().item()
    assert error <= 1e-5
    torch.testing.assert_close(lse.reshape(1, q_heads, m).double(), want_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", ["native", "gemm"])
def test_pieces_laid_out_once_attend_as_partial_parts(kernel, monkeypatch):
    """`Pieces` (a shard's blocks laid out once, then a buffer that changes at each call, as
    a decode step's own KV grows) gives bit for bit what `partial_parts` gives over the same
    buffers, call after call, with and without the changing buffer."""
    from starqa.native import ops as native
    from starqa.attention import Pieces, fold_gqa, partial_parts

    if kernel == "native" and not native.available():
        pytest.skip("starqa's kernel is not built here")
    if kernel == "gemm":
        monkeypatch.setattr(native, "available", lambda: False)
    torch.manual_seed(1)
    kv_heads, dim = 3, 64
    blocks = [torch.randn(2, kv_heads, n, dim, dtype=torch.bfloat16) for n in (600, 45)]
    fixed = [(b[0], b[1]) for b in blocks]
    own = torch.randn(2, kv_heads, 40, dim, dtype=torch.bfloat16)  # capacity 40
    pieces = Pieces(fixed)
    for length, m in ((5, 5), (6, 1), (9, 3)):  # a question, then tokens, then drafts
        rows = fold_gqa(torch.randn(1, 9, m, dim), kv_heads, torch.bfloat16)[0]
        mine = (own[0, :, :length], own[1, :, :length])
        for got, want in zip(pieces.attend(rows, *mine, scale=0.125, own=m),
                             partial_parts(rows, fixed + [mine], 0.125, m)):
            assert torch.equal(got, want)
    for got, want in zip(pieces.attend(rows, scale=0.125), partial_parts(rows, fixed, 0.125)):
        assert torch.equal(got, want)


def test_the_kernel_is_built_where_a_compiler_is():
    """`pip install` builds starqa's attention kernel wherever a C compiler is found (it is
    optional, so a failed build would otherwise go unnoticed and every answer slow)."""
    import os
    import shutil

    from starqa.native import ops as native

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: starqa attends with torch's GEMMs")
    assert native.available()
    assert native.supports(torch.zeros(2, 5, 64, dtype=torch.bfloat16))
    assert not native.supports(torch.zeros(2, 5, 64, dtype=torch.float16))  # → GEMMs


# ---------------------------------------------------------------------------------------
# a context bias: the shard's keys weigh e^b each, the own keys 1


def biased_reference(rows, parts, own_kv, scale, own, bias, unbiased=0):
    """fp64: folded rows [H, R, D] over the keys of `parts` [(k, v) [H, N_i, D]], each score
    + bias but the first `unbiased` keys', then own_kv's (k, v) [H, L, D] (no bias; the last
    `own` causal, rows G blocks of `own`). Returns out [H, R, D] and lse [H, R]."""
    keys = torch.cat([k for k, _ in parts] + [own_kv[0]], 1).double()
    values = torch.cat([v for _, v in parts] + [own_kv[1]], 1).double()
    scores = rows.double() @ keys.transpose(-1, -2) * scale  # [H, R, N + L]
    context, n = sum(k.shape[1] for k, _ in parts), keys.shape[1]
    scores[..., unbiased:context] += bias
    if own:
        r = torch.arange(rows.shape[1])
        hidden = torch.arange(n)[None, :] > (n - own + r % own)[:, None]  # [R, N + L]
        scores = scores.masked_fill(hidden, -math.inf)
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ values, lse


def bias_inputs(dtype, dim, own, seed=0):
    """Folded rows [2, 3 * M, D] (3 query heads per KV head, M = max(own, 1) positions),
    two shard blocks [2, 600 | 45, D] read as slices of longer buffers, own keys [2, 7, D]."""
    g = torch.Generator().manual_seed(seed)
    m = max(own, 1)
    rows = torch.randn(2, 3 * m, dim, generator=g)
    blocks = [tuple(torch.randn(2, t + 4, dim, generator=g).to(dtype)[:, 2:t + 2]
                    for _ in range(2)) for t in (600, 45)]
    mine = tuple(torch.randn(2, 7, dim, generator=g).to(dtype) for _ in range(2))
    return rows, blocks, mine


@pytest.mark.parametrize("kernel", ["native", "gemm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128, 48])
@pytest.mark.parametrize("own", [0, 3])
@pytest.mark.parametrize("bias", [math.log(0.25), 1.5])
def test_a_bias_on_the_pieces_is_the_fp64_softmax(kernel, dtype, dim, own, bias, monkeypatch):
    """`Pieces` with a bias (starqa/native/_attend.c's table biases; torch's code without the
    kernel): the shard's scores + b and the own keys' as they are, under one softmax, equal
    to fp64 within fp32 rounding, relative to the reference's own size; the shard alone is
    its unbiased part with lse + b."""
    from starqa.attention import Pieces
    from starqa.native import ops as native

    if kernel == "native" and not native.available():
        pytest.skip("starqa's kernel is not built here")
    if kernel == "gemm":
        monkeypatch.setattr(native, "available", lambda: False)
    rows, blocks, mine = bias_inputs(dtype, dim, own)
    rows = rows.to(dtype)

    def errors(b: float) -> tuple[float, float]:
        """`Pieces`' error against fp64 with bias b, relative to the reference's size."""
        out, lse = Pieces(blocks, b).attend(rows, *mine, dim ** -0.5, own)
        want, want_lse = biased_reference(rows, blocks, mine, dim ** -0.5, own, b)
        return (((out.double() - want).abs().max() / want.abs().max()).item(),
                ((lse.double() - want_lse).abs().max() / want_lse.abs().max()).item())

    pieces = Pieces(blocks, bias)
    assert (pieces.layout is not None) == (kernel == "native")
    # fp32 rounding; torch's GEMMs in bf16 round scores and weights to bf16 (`attend_gemm`):
    # there no more than twice their error without a bias
    unbiased = errors(0.0)
    for error, plain in zip(errors(bias), unbiased):
        assert error <= max(1e-5, 2 * plain if kernel == "gemm" else 0.0)
    alone, alone_lse = pieces.attend(rows, scale=dim ** -0.5)
    plain, plain_lse = Pieces(blocks).attend(rows, scale=dim ** -0.5)
    assert torch.equal(alone, plain) if kernel == "gemm" else \
        (alone - plain).abs().max() <= 1e-6 * plain.abs().max()
    assert (alone_lse - (plain_lse + bias)).abs().max() <= 1e-5 * plain_lse.abs().max()


@pytest.mark.parametrize("kernel", ["native", "gemm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("unbiased", [250, 600, 620, 645])
def test_the_keys_before_the_shared_positions_carry_no_bias(kernel, dtype, unbiased,
                                                            monkeypatch):
    """`Pieces` with its first `unbiased` keys left out of the bias (the anchor's, held
    once: `methods.ContextBias`), inside a block (cut there into two views), at a block's
    end, or over every key: the fp64 softmax with those keys' scores as they are, the rest
    + b, within the rounding of the same call without a bias."""
    from starqa.attention import Pieces
    from starqa.native import ops as native

    if kernel == "native" and not native.available():
        pytest.skip("starqa's kernel is not built here")
    if kernel == "gemm":
        monkeypatch.setattr(native, "available", lambda: False)
    rows, blocks, mine = bias_inputs(dtype, 64, 3)
    rows, bias, scale = rows.to(dtype), math.log(0.1), 64 ** -0.5

    def error(b: float, first: int) -> float:
        out, _ = Pieces(blocks, b, first).attend(rows, *mine, scale, 3)
        want, _ = biased_reference(rows, blocks, mine, scale, 3, b, first)
        return ((out.double() - want).abs().max() / want.abs().max()).item()

    pieces = Pieces(blocks, bias, unbiased)
    assert [k.shape[1] for k, _ in pieces.parts] == \
        {250: [250, 350, 45], 600: [600, 45], 620: [600, 20, 25], 645: [600, 45]}[unbiased]
    assert pieces.biases == [0.0] * pieces.split + [bias] * (len(pieces.parts) - pieces.split)
    assert error(bias, unbiased) <= max(1e-5, 2 * error(0.0, 0))
    # and it is not the bias on every key
    everywhere = Pieces(blocks, bias).attend(rows, *mine, scale, 3)[0]
    assert (everywhere - pieces.attend(rows, *mine, scale, 3)[0]).abs().max() > 1e-3


@pytest.mark.parametrize("cap", ["avx2", "none"])
def test_a_bias_on_the_pieces_on_every_simd_path(cap):
    """The same under STARQA_SIMD=avx2 and none (a process each: the cap is read once): each
    path's scores, whichever it is, take the pieces' bias alike."""
    import os
    import subprocess
    import sys

    from starqa.native import ops as native

    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    script = (
        "import math, torch\n"
        "from starqa.attention import Pieces\n"
        "from starqa.native import kernels\n"
        "from test_attention import bias_inputs, biased_reference\n"
        "worst = 0.0\n"
        "for dtype in (torch.bfloat16, torch.float32):\n"
        "    for dim in (64, 128, 48):\n"
        "        rows, blocks, mine = bias_inputs(dtype, dim, 3, seed=dim)\n"
        "        rows = rows.to(dtype)\n"
        "        out, lse = Pieces(blocks, math.log(0.25)).attend(rows, *mine, dim ** -0.5, 3)\n"
        "        want, want_lse = biased_reference(rows, blocks, mine, dim ** -0.5, 3,"
        " math.log(0.25))\n"
        "        worst = max(worst, ((out.double() - want).abs().max() / want.abs().max()).item(),"
        " ((lse.double() - want_lse).abs().max() / want_lse.abs().max()).item())\n"
        "print(kernels.simd_paths().written, worst)\n")
    tests = os.path.dirname(__file__)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "STARQA_SIMD": cap, "PYTHONPATH": path},
                          check=True)
    written, worst = done.stdout.split()
    assert int(written) <= {"avx2": 1, "none": 0}[cap]
    assert float(worst) <= 1e-5


@pytest.mark.parametrize("dim,dtype", [(64, torch.bfloat16), (128, torch.bfloat16),
                                       (128, torch.float32), (40, torch.float32)])
def test_questions_attended_together_get_their_rows_alone(dim, dtype):
    """`Pieces.attend_batch`: several questions' rows over the shard read once, each over
    its own keys, give bit for bit what `attend` gives each question alone: rows of one
    position and of several (a prefill, drafts), own buffers longer than the rows, a
    shard of several pieces with a score bias and an int8 piece."""
    from starqa.attention import Pieces, fold_gqa
    from starqa.attention.kvint8 import quantize_rows
    from starqa.native import ops as native

    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    torch.manual_seed(3)
    kv_heads = 2
    blocks = [torch.randn(2, kv_heads, n, dim, dtype=dtype) for n in (700, 90)]
    fixed = [(b[0], b[1]) for b in blocks]
    if dtype == torch.bfloat16:  # an int8 piece too, as `--kv int8` keeps a shard
        fixed.append(tuple(quantize_rows(torch.randn(kv_heads, 130, dim))
                           for _ in range(2)))
    pieces = Pieces(fixed, math.log(0.5))
    questions = [(1, 20), (7, 7), (4, 33), (1, 600)]  # (rows, own keys so far)
    own = [torch.randn(2, kv_heads, n, dim, dtype=dtype) for _, n in questions]
    rows = [fold_gqa(torch.randn(1, 6 * kv_heads, m, dim), kv_heads, dtype)[0]
            for m, _ in questions]
    owns = [(o[0], o[1], m) for o, (m, _) in zip(own, questions)]
    assert pieces.batched([(k, v) for k, v, _ in owns])
    out, lse = pieces.attend_batch(torch.cat(rows, dim=1), owns, [r.shape[1] for r in rows],
                                   dim ** -0.5)
    at = 0
    for q, (k, v, m) in zip(rows, owns):
        alone, alone_lse = pieces.attend(q, k, v, dim ** -0.5, m)
        assert torch.equal(out[:, at:at + q.shape[1]], alone)
        assert torch.equal(lse[:, at:at + q.shape[1]], alone_lse)
        at += q.shape[1]
