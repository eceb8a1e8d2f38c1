"""The decode step's compiled kernels. The int4 product (starqa/native/_int4.c through
`native.int4_mm`) against a float64 reference of the sums its docstring defines, its fast
(VNNI) and plain C paths bit for bit, rows independent of each other, and its error against
the dense product bounded by that of torch's own int4 kernel over the same weights. RMSNorm
and RoPE (starqa/native/_rows.c) against transformers' formulas in torch operators."""

import math

import pytest
import torch
import torch.nn.functional as F

from starqa.native import kernels, ops as native
from starqa.models.linear import INT4_GROUP, Linear, _int4_levels, _int4_pack, _int4_tiles

from memory import mapped_pages  # tests/memory.py (conftest puts tests/ on the path)

pytestmark = pytest.mark.skipif(not native.available(), reason="starqa's kernels not built")


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [M, N] in float64 from _int4.c's formula: activations in 14 bits per group of 32
    (scale max |x| / 8191), integer dot products, bf16 scales and zeros."""
    q, scale, zero = _int4_levels(weight.float())
    n, k = q.shape
    groups = k // INT4_GROUP
    scale, zero = scale.bfloat16().double(), zero.bfloat16().double()
    xf = x.float().view(x.shape[0], groups, INT4_GROUP)
    top = xf.abs().amax(dim=-1)
    inverse = torch.where(top > 0, torch.full_like(top, 8191.0) / top, torch.zeros_like(top))
    x14 = torch.round(xf * inverse[..., None]).double()
    sx, xsum = (top / torch.full_like(top, 8191.0)).double(), xf.sum(dim=-1).double()
    dots = torch.einsum("mgi,ngi->mng", x14, q.view(n, groups, INT4_GROUP).double())
    return (dots * scale[None] * sx[:, None] + (zero - 8 * scale)[None] * xsum[:, None]).sum(-1)


SHAPES = [(16, 32, 1), (64, 128, 1), (96, 256, 3), (48, 64, 5), (960, 576, 4), (32, 1536, 9)]


@pytest.mark.parametrize("n,k,m", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_mm_is_its_formula(n, k, m, dtype):
    """fp32 output: the float64 formula to fp32 rounding; bf16: and one bf16 rounding."""
    torch.manual_seed(n + k + m)
    weight, x = torch.randn(n, k), torch.randn(m, k).to(dtype)
    x[0, :INT4_GROUP] = 0  # a group of zeros (its scale is 0)
    expected = reference(x, weight)
    for fast in (True, False):
        got = native.int4_mm(x, _int4_tiles(weight), fast=fast)
        assert got.dtype == dtype and got.shape == (m, n)
        # fp32 sums of K / 32 group terms: ~1e-7 of the row's size each; bf16 adds half
        # a unit in the last place of the output itself
        rounding = 0 if dtype == torch.float32 else 2 ** -8
        size = expected.abs().amax(dim=1, keepdim=True)
        excess = (got.double() - expected).abs() - rounding * expected.abs() - 1e-5 * size
        assert excess.max() <= 0, (fast, excess.max())


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_fast_path_equals_plain_c_bit_for_bit(n, k, m):
    torch.manual_seed(7)
    tiles, x = _int4_tiles(torch.randn(n, k)), torch.randn(m, k).bfloat16()
    assert torch.equal(native.int4_mm(x, tiles), native.int4_mm(x, tiles, fast=False))


def test_rows_do_not_depend_on_each_other():
    """A row's result is the same alone or among others (drafted tokens), bit for bit,
    whatever the rows around it hold."""
    torch.manual_seed(3)
    tiles, x = _int4_tiles(torch.randn(160, 288)), torch.randn(7, 288).bfloat16()
    x[3] *= 1000
    together = native.int4_mm(x, tiles)
    for i in range(len(x)):
        assert torch.equal(together[i:i + 1], native.int4_mm(x[i:i + 1], tiles))


def test_error_against_dense_is_torch_int4s():
    """The activations' 14-bit rounding adds next to nothing to the weights' int4
    rounding: against the fp32 product over the dense weights, the error stays within 1.1x
    that of torch's weight-only int4 kernel on the same int4 weights; against the product
    over the int4 weights themselves (fp32 output) it is 1e-4 (8-bit activations: 4e-3)."""
    torch.manual_seed(5)
    weight, x = torch.randn(512, 1024), torch.randn(4, 1024).bfloat16()
    exact = x.float() @ weight.T
    packed, scales = _int4_pack(weight, torch.bfloat16)
    theirs = torch.cat([torch.ops.aten._weight_int4pack_mm_for_cpu(
        x[i:i + 1], packed, INT4_GROUP, scales) for i in range(len(x))]).float()
    ours = native.int4_mm(x, _int4_tiles(weight)).float()
    assert (ours - exact).norm() <= 1.1 * (theirs - exact).norm()
    q, scale, zero = _int4_levels(weight)
    scale, zero = scale.bfloat16().float()[..., None], zero.bfloat16().float()[..., None]
    levels = q.view(512, -1, INT4_GROUP).float() * scale + zero - 8 * scale
    on_int4 = x.float() @ levels.view(512, 1024).T
    ours32 = native.int4_mm(x.float(), _int4_tiles(weight))
    assert ((ours32 - on_int4).norm() / on_int4.norm()).item() < 5e-4


def test_bad_shapes_are_refused():
    tiles = _int4_tiles(torch.randn(32, 64))
    with pytest.raises(ValueError, match="int4 kernel"):
        native.int4_mm(torch.randn(2, 96), tiles)
    with pytest.raises(ValueError, match="int4 kernel"):
        native.int4_mm(torch.randn(2, 64).half(), tiles)


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
def test_linear_uses_the_tiles_for_decode_rows():
    """Where the fast path runs, an int4 Linear holds the tiles (no torch packing) and one
    row (decode), or rows computed rowwise (drafts), go through `int4_mm`."""
    torch.manual_seed(2)
    weight, x = torch.randn(64, 128).bfloat16(), torch.randn(5, 128).bfloat16()
    lin = Linear.quantize(weight, None, "int4", torch.bfloat16)
    assert lin.weight.shape == (4, 4, 320) and lin.scale is None
    torch.testing.assert_close(lin(x[:1]), native.int4_mm(x[:1], lin.weight), rtol=0, atol=0)
    torch.testing.assert_close(lin(x, rowwise=True), native.int4_mm(x, lin.weight),
                               rtol=0, atol=0)


def tiny_decoder(dtype: torch.dtype, bias: bool):
    """Two random layers of int4 tiles (9 query heads, 3 KV heads of 32, MLP 192; a bias on
    qkv like Qwen2's where `bias`)."""
    from starqa.models.decoder import Decoder, Layer
    from starqa.models.prepared import DecoderConfig

    torch.manual_seed(4)
    c = DecoderConfig(layers=2, hidden=96, heads=9, kv_heads=3, head_dim=32, vocab=64,
                      eps=1e-5, rope_theta=10000.0, tied=False)

    def lin(n, k, with_bias=False):
        return Linear.quantize(torch.randn(n, k) / k ** 0.5,
                               torch.randn(n) if with_bias else None, "int4", dtype)

    layers = [Layer(attn_norm=(1 + torch.randn(96) / 4).to(dtype), qkv=lin(480, 96, bias),
                    out=lin(96, 288), mlp_norm=(1 + torch.randn(96) / 4).to(dtype),
                    gate_up=lin(384, 96), down=lin(96, 192)) for _ in range(2)]
    return Decoder(c, torch.randn(64, 96).to(dtype), layers, torch.ones(96).to(dtype),
                   lin(64, 96), dtype, "int4")


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_in_two_calls_gives_the_bits_of_its_kernels_one_by_one(dtype, bias):
    """starqa/native/_layer.c composes the norm, int4, RoPE, SiLU·mul and add kernels around each
    layer's attention in one call each: the forward's hidden states equal those of the
    kernels called one by one, bit for bit, for a token and for rows computed rowwise."""
    decoder = tiny_decoder(dtype, bias)
    assert decoder.layer_kernels
    ids, positions = torch.tensor([3, 17, 42]), torch.tensor([100, 101, 102])

    def attention(layer, q, k, v):  # any function of q, k and v will do
        return q * 0.5 + (k + v).repeat_interleave(3, dim=1)

    for rows in (1, 3):
        fused = decoder.forward(ids[:rows], positions[:rows], attention, rowwise=True)
        decoder.layer_kernels = False
        separate = decoder.forward(ids[:rows], positions[:rows], attention, rowwise=True)
        decoder.layer_kernels = True
        assert torch.equal(fused, separate)
    layer = decoder.layers[0]
    hidden = torch.randn(1, 96).to(dtype)
    with pytest.raises(ValueError, match="decoder layer"):  # attention of 10 heads for 9
        native.layer_after(hidden, torch.randn(1, 320).to(dtype), (layer.out.weight, None),
                           layer.mlp_norm, 1e-5, (layer.gate_up.weight, None),
                           (layer.down.weight, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rounds_as_transformers_does(dtype):
    """LlamaRMSNorm: normalised in fp32, rounded to the dtype, times the weight (rounded
    again). bf16: at most one unit in the last place from it (the mean's sum runs in
    another order), most results bit for bit; fp32: within fp32 rounding. Rows alone or
    together alike."""
    torch.manual_seed(4)
    x, weight = (torch.randn(6, 576) * 3).to(dtype), (torch.randn(576) * 0.5 + 1).to(dtype)
    x[2] *= 1e3
    xf = x.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = native.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    bf16 = dtype == torch.bfloat16
    bound = 2 ** -7 if bf16 else 1e-6  # fp32: a few units in the last place
    assert ((got.float() - expected.float()).abs() <= bound * expected.float().abs()).all()
    assert not bf16 or (got == expected).float().mean() > 0.9
    assert torch.equal(torch.cat([native.rms_norm(x[i:i + 1], weight, 1e-5)
                                  for i in range(len(x))]), got)
    assert (got.float() - F.rms_norm(xf, (576,), weight.float(), 1e-5)).abs().max() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_torchs_operators_bit_for_bit(dtype):
    """In place on the first heads only (the values' heads untouched), the same numbers as
    x * cos + rotate_half(x) * sin in torch operators of the dtype."""
    torch.manual_seed(6)
    qkv = torch.randn(3, 15, 64).to(dtype)
    cos, sin = torch.randn(3, 1, 64).to(dtype), torch.randn(3, 1, 64).to(dtype)
    x = qkv[:, :12]
    expected = x * cos + torch.cat([-x[..., 32:], x[..., :32]], dim=-1) * sin
    rotated = qkv.clone()
    got = native.rope_(rotated, 12, cos, sin)
    assert got.data_ptr() == rotated.data_ptr() and torch.equal(got, expected)
    assert torch.equal(rotated[:, 12:], qkv[:, 12:])
    with pytest.raises(ValueError, match="head size"):
        native.rope_(torch.zeros(1, 2, 1024, dtype=dtype), 1, torch.zeros(1, 1, 1024, dtype=dtype),
                     torch.zeros(1, 1, 1024, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_torchs_up_to_its_exp(dtype):
    """silu(g) · u with torch's roundings: against the fp64 formula, no further off than
    torch's own F.silu(g) * u plus one unit of bf16's last place (bf16), or than 4 units of
    fp32's (fp32: starqa's exp is within 2 of them); bf16 mostly the very bits of torch's
    (the exp differs in fp32's last place, rarely crossing a bf16 rounding); large |g|
    without overflow; rows alone or together alike."""
    torch.manual_seed(7)
    x = (torch.randn(5, 2 * 1536) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 1e-30, -1e30])
    g, u = x.float().double().chunk(2, dim=-1)
    exact = g / (1 + torch.exp(-g)) * u
    got = native.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torchs = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (5, 1536) and torch.isfinite(got).all()
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -21
    if dtype == torch.float32 and kernels.simd_paths().cloned == 0:
        # the baseline build (STARQA_SIMD=none; CPUs before x86-64-v3) fuses no multiply-add:
        # its exp rounds g·log2(e) before reducing it, 2^-24 |g| more, relative
        ulp = ulp + 2 ** -24 * g.abs()
    assert ((got.double() - exact).abs()
            <= (torchs.double() - exact).abs() + ulp * exact.abs() + 1e-30).all()
    assert (got == torchs).float().mean() > (0.99 if dtype == torch.bfloat16 else 0.5)
    assert torch.equal(torch.cat([native.silu_mul(x[i:i + 1]) for i in range(5)]), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_is_transformers_angles(dtype):
    """cos and sin of position · inv_freq (fp32 angles, as transformers computes them) in
    the dtype: within one unit of the last place of torch's own cos and sin of those angles,
    the two halves alike."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    positions = torch.tensor([0, 1, 7, 4095, 32767])
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = native.rope_table(positions, inv_freq, dtype)
    assert cos.shape == sin.shape == (5, 1, 64) and cos.dtype == dtype
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -23
    for got, expected in ((cos, emb.cos()), (sin, emb.sin())):
        assert ((got.float() - expected).abs() <= ulp + 1e-6).all()
        assert torch.equal(got[..., :32], got[..., 32:])
    assert torch.equal(cos[0], torch.ones(1, 64, dtype=dtype))


@pytest.mark.parametrize("setting, before, after", [
    ("always [madvise] never\n", None, "1"),  # huge pages on request only: asked for
    ("always [madvise] never\n", "0", "0"),  # the user's choice kept
    ("[always] madvise never\n", None, None),  # every large mapping gets them already
    ("always madvise [never]\n", None, None),  # none to be had
    (None, None, None),  # no such setting (not Linux, no THP)
])
def test_large_tensors_ask_for_huge_pages_where_the_kernel_wants_asking(tmp_path, setting,
                                                                        before, after):
    from starqa.core import hugepages

    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    environ = {} if before is None else {"THP_MEM_ALLOC_ENABLE": before}
    hugepages.ask_for_huge_pages(str(path), environ)
    assert environ.get("THP_MEM_ALLOC_ENABLE") == after


def test_a_starqa_process_asks_before_torch_allocates():
    import os
    import subprocess
    import sys

    from starqa.core import hugepages

    wanted = "1"
    try:
        with open(hugepages.THP_SETTING) as fh:
            if "[madvise]" not in fh.read():
                wanted = None
    except OSError:
        wanted = None
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    shown = subprocess.run([sys.executable, "-c", "import starqa.workers.worker, os, sys; "
                            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), "
                            "'torch' in sys.modules)"],
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert shown == [str(wanted), "False"]  # set, and torch not yet imported


FORWARDS = [list(range(1, 6)), [7], [9], [11, 12, 13], [14]]  # question, tokens, drafts


def _forwards(decoder, attention, forwards, dtype, compiled: bool, planned: list) -> list:
    """The hidden states of `forwards` (lists of token ids) one after the other through
    `attention` (a `ShardAttention` over 9 query heads and 3 KV heads of 32), every
    layer in one call where it offers a plan and `compiled` (planned: whether each did)."""
    hidden, position = [], 1000
    for step, tokens in enumerate(forwards):
        plan = attention.compiled(len(tokens), dtype, 9, 3, 32) if compiled else None
        planned.append(plan is not None)
        hidden.append(decoder.forward(
            torch.tensor(tokens), torch.arange(position, position + len(tokens)),
            attention.attention, rowwise=step > 0,
            compiled=(lambda *_, plan=plan: plan) if compiled else None))
        attention.advance(len(tokens))
        position += len(tokens)
    return hidden


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["exact", "flat", "ivf"])
@pytest.mark.parametrize("bias", [0.0, math.log(0.3)])
def test_every_layer_in_one_call_gives_the_bits_of_the_layer_by_layer_loop(dtype, kind, bias):
    """starqa/native/_step.c runs a forward's layers in one call (the attention's words from
    `ShardAttention.compiled`): a question, then single tokens and drafted rows, give the
    hidden states of the loop that calls the same kernels layer by layer, bit for bit, with
    the own keys written alike (a later forward reads them) and, for exact, the same source
    attribution from the rows kept. A context bias (the shard's keys weigh e^b) is compiled
    too: in exact's tables and top-k's words, the shard's first 150 keys (the anchor's,
    cut inside the first block) and the own keys without it."""
    from starqa.runtime import dist
    from starqa.phase2.shard_attention import ShardAttention
    from starqa.topk import retrieval
    from starqa.topk.indexes import TopK

    torch.manual_seed(9)
    decoder = tiny_decoder(dtype, bias=True)
    assert decoder.step_words is not None
    n = 700
    blocks = [(torch.randn(2, 3, t, 32).to(dtype), torch.randn(2, 3, t, 32).to(dtype))
              for t in (300, n - 300)]
    ids = torch.randint(0, 64, (n,))

    def hook(bias=bias, unbiased=150):
        if kind == "exact":
            pieces = [[(k[layer][None], v[layer][None]) for k, v in blocks] for layer in range(2)]
            return ShardAttention(dist.local_world(), pieces, query_host=True, head=5, ids=ids,
                                  context_bias=bias, unbiased=unbiased)
        shard = retrieval.from_parts(blocks, TopK(count=24, index=kind, sink=4), n)
        return ShardAttention(dist.local_world(), None, query_host=True, retriever=shard,
                              context_bias=bias, unbiased=unbiased)

    results, planned = [], []
    for compiled in (True, False):
        attention = hook()
        attention.begin(4)  # grown by the question (the own buffers' copy is checked too)
        attention.track = True
        hidden = _forwards(decoder, attention, FORWARDS, dtype, compiled, planned)
        mass = attention.key_mass([3, 7, 9, 11, 12]) if kind == "exact" else None
        results.append((hidden, mass))
    # top-k's question attends every key exactly (`retrieval`): layer by layer, as before
    assert planned[:5] == [kind == "exact", True, True, True, True]
    assert not any(planned[5:])
    (fused, fused_mass), (loop, loop_mass) = results
    for a, b in zip(fused, loop):
        assert torch.equal(a, b)
    if kind == "exact":
        assert fused_mass.sum() > 0 and torch.equal(fused_mass, loop_mass)
    if bias:  # and the bias weighs, and not on the first 150 keys: the loop's hidden
        # states without it, and with it on every key, are others
        for other in (hook(0.0), hook(bias, 0)):
            other.begin(4)
            assert not torch.equal(_forwards(decoder, other, FORWARDS, dtype, False, [])[-1],
                                   loop[-1])


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_a_shard_on_disk_in_one_call_gives_the_loops_bits_and_releases_its_pages(kind,
                                                                                  tmp_path):
    """Top-k with --kv-on-disk (values, and flat's keys, memory-mapped from the block files)
    runs a forward's layers in one call too: the hidden states of the layer-by-layer loop,
    bit for bit, and the step releases each layer's mapped pages after its attention, as
    the loop does: after a forward no page of the values' last layer is mapped. (Earlier
    layers' last pages may be mapped again by a later layer's read: a file's large folio.)"""
    from starqa.runtime import dist
    from starqa.phase2.shard_attention import ShardAttention
    from starqa.core import tensorfile
    from starqa.topk import retrieval
    from starqa.topk.flat import MappedFlatShard
    from starqa.topk.indexes import TopK
    from starqa.topk.ivf import IvfShard
    from starqa.topk.rows import Held, MappedRows

    torch.manual_seed(10)
    dtype = torch.bfloat16
    decoder = tiny_decoder(dtype, bias=False)
    sizes = (2048, 2048)  # a layer's values: 384 KiB a block, whole pages
    blocks = [(torch.randn(2, 3, t, 32).to(dtype), torch.randn(2, 3, t, 32).to(dtype))
              for t in sizes]
    paths = []
    for i, (k, v) in enumerate(blocks):
        paths.append(tmp_path / f"block_{i}.safetensors")
        tensorfile.save_aligned({"k": k, "v": v, "ids": torch.zeros(k.shape[2])}, paths[-1], {})
    settings = TopK(count=24, index=kind, sink=4, kv_on_disk=True)

    def hook():
        held = retrieval.from_parts(blocks, settings, sum(sizes))  # its ivf, sink, blocks
        starts = [0, sizes[0]]
        mapped = {name: MappedRows([(start, tensorfile.MappedTensor(path, name))
                                    for start, path in zip(starts, paths)]) for name in ("k", "v")}
        on_disk = Held(settings, held.budgets, held.n_keys, mapped["v"], held.sinks, held.blocks)
        shard = (MappedFlatShard(on_disk, mapped["k"]) if kind == "flat"
                 else IvfShard(on_disk, held.ivf))
        return ShardAttention(dist.local_world(), None, query_host=True, retriever=shard)

    results, planned = [], []
    for compiled in (True, False):
        attention = hook()
        attention.begin(4)
        hidden = _forwards(decoder, attention, FORWARDS, dtype, compiled, planned)
        if compiled:  # the values' last layer: the union's rows were read from its pages
            last = [mapped.pages(1) for mapped in attention.retriever.values.files()]
            assert all(pages is not None and mapped_pages(*pages) == 0 for pages in last)
        results.append(hidden)
    assert planned[:5] == [False, True, True, True, True]  # the question: layer by layer
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_world_of_several_goes_layer_by_layer():
    """The compiled step has no collective between layers: a world of two offers no words
    (nor does a shard whose dtype is not the model's)."""
    from starqa.runtime import dist
    from starqa.phase2.shard_attention import ShardAttention

    pieces = [[(torch.randn(1, 3, 10, 32), torch.randn(1, 3, 10, 32))] for _ in range(2)]
    two = dist.DistInfo(1, 1, 2, torch.device("cpu"), None)
    hook = ShardAttention(two, pieces, query_host=True)
    hook.begin(8)
    assert hook.compiled(1, torch.float32, 9, 3, 32) is None
    for dtype, offers in ((torch.bfloat16, False), (torch.float32, True)):  # an fp32 shard
        alone = ShardAttention(dist.local_world(), pieces, query_host=True)
        alone.begin(8)
        assert (alone.compiled(1, dtype, 9, 3, 32) is not None) == offers
