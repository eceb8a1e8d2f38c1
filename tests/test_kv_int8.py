"""int8 KV (`ingest --kv int8`): rows quantised per (layer, KV head, token) with an fp32
scale, on disk and in Phase 2. The quantisation's error bound; partial attention over int8
rows against an fp32 reference over the dequantised rows (tight: the same numbers) and over
the original rows (bounded relative to the reference's own magnitude); the compiled kernel
against the torch reference on every SIMD path; an ingest with int8 KV on the tiny model,
answered like its float twin; float shards written before int8 KV existed still load."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from starqa.attention import Pieces, fold_gqa, partial_parts
from starqa.attention.kvint8 import Int8Rows, attend_int8, attend_int8_parts, quantize_rows
from starqa.cache.manifest import kv_bytes_per_token
from starqa.cache import shards
from starqa.cache.manifest import block_file, kv_tag, read_manifest
from starqa.core.errors import ShardError
from starqa.native import ops as native


def reference(q, key, value, scale, own=0):
    """fp64 partial attention of folded rows q [H, R, D] over key/value [H, N, D] (the last
    `own` the rows' own, causally): out [H, R, D], lse [H, R]."""
    scores = q.double() @ key.double().transpose(1, 2) * scale
    n, rows = key.shape[1], q.shape[1]
    if own:
        limit = n - own + torch.arange(rows) % own + 1
        scores = scores.masked_fill(torch.arange(n)[None, :] >= limit[:, None], -math.inf)
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ value.double(), lse


# --------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 50, 64), (1, 2, 7, 128), (4, 3, 33)])
def test_quantise_within_half_a_step(dtype, shape):
    """Each row dequantises within half a step of itself: |x - s q| <= max|x| / 254 per
    element (and fp32 rounding); the largest element of a row is exact to fp32 rounding;
    data in [-127, 127]; a row of zeros stays zeros."""
    torch.manual_seed(len(shape))
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10).to(dtype)
    x[..., 0, :] = 0
    rows = quantize_rows(x)
    assert rows.data.dtype == torch.int8 and rows.scale.dtype == torch.float32
    assert rows.data.shape == x.shape and rows.scale.shape == x.shape[:-1]
    assert rows.dtype == dtype
    assert int(rows.data.abs().max()) == 127
    absmax = x.float().abs().amax(-1, keepdim=True)
    error = (rows.float() - x.float()).abs()
    assert (error <= absmax / 254 * (1 + 1e-5) + 1e-30).all()
    assert error.max() > 0  # something was rounded: the bound is not vacuous
    assert (rows.float()[..., 0, :] == 0).all() and (rows.scale[..., 0] == 0).all()
    assert torch.equal(rows[0].data, rows.data[0]) and torch.equal(rows[0].scale, rows.scale[0])


def test_bytes_per_token():
    """Qwen2.5-Coder-1.5B (28 layers, 2 KV heads of 128): 28,672 bytes of bf16 KV a token,
    14,784 as int8 rows with fp32 scales (docs/architecture.md)."""
    assert kv_bytes_per_token(28, 2, 128, "float") == 28_672
    assert kv_bytes_per_token(28, 2, 128, "int8") == 14_784


# --------------------------------------------------------------------------- attention

SHAPES = [  # (q_heads, kv_heads, m, n, dim, own)
    (9, 3, 1, 7 * 512 + 37, 64, 0),   # SmolLM2 decode: several kernel tasks
    (12, 2, 1, 1000, 128, 0),         # Qwen2.5 decode
    (9, 3, 5, 300, 64, 5),            # a prefill's causal tail
    (4, 4, 3, 50, 32, 0),             # the portable loops
    (8, 2, 2, 70, 80, 2),             # a head size that is no multiple of 16
]


def _inputs(q_heads, kv_heads, m, n, dim, seed=0):
    torch.manual_seed(seed + n + dim)
    q = fold_gqa(torch.randn(1, q_heads, m, dim), kv_heads, torch.float32)[0]
    k, v = torch.randn(kv_heads, n, dim) * 2, torch.randn(kv_heads, n, dim)
    return q, k, v


@pytest.mark.parametrize("q_heads,kv_heads,m,n,dim,own", SHAPES)
def test_torch_reference_over_int8_rows(q_heads, kv_heads, m, n, dim, own):
    """`attend_int8` in chunks over int8 rows equals fp64 attention over the dequantised
    rows to fp32 rounding; against the original rows its error is what quantising them
    costs: bounded relative to the reference's own magnitude."""
    q, k, v = _inputs(q_heads, kv_heads, m, n, dim)
    key, value = quantize_rows(k), quantize_rows(v)
    scale = dim ** -0.5
    out, lse = attend_int8(q, key, value, scale, own, chunk=97)  # chunks of odd length
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape
    want, want_lse = reference(q, key.float(), value.float(), scale, own)
    assert (out.double() - want).abs().max() <= 1e-5
    assert (lse.double() - want_lse).abs().max() <= 1e-5
    exact, exact_lse = reference(q, k, v, scale, own)
    magnitude = exact.abs().max().item()
    assert (out.double() - exact).abs().max() <= 0.05 * magnitude
    assert (lse.double() - exact_lse).abs().max() <= 0.05
    relative = ((out.double() - exact).norm() / exact.norm()).item()
    assert 0 < relative < 0.02  # int8 rows cost something, and little


@pytest.mark.parametrize("q_heads,kv_heads,m,n,dim,own", SHAPES)
def test_kernel_over_int8_rows_equals_the_torch_reference(q_heads, kv_heads, m, n, dim, own):
    """starqa's compiled kernel over int8 pieces (each a slice of its own buffer), then the
    question's own keys in bf16, as one sequence: the torch reference's numbers to fp32
    rounding. The layout laid out once (`Pieces`) gives the same."""
    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    q, k, v = _inputs(q_heads, kv_heads, m, n, dim, seed=1)
    key, value = quantize_rows(k), quantize_rows(v)
    cut = n // 3
    parts = [(key[:, :cut], value[:, :cut]), (key[:, cut:], value[:, cut:])]
    own_k, own_v = (torch.randn(kv_heads, max(own, 1) + 3, dim).bfloat16() for _ in range(2))
    assert native.supports_int8(key.data[:, cut:], key.scale[:, cut:])
    want = attend_int8_parts(q, parts + [(own_k, own_v)], dim ** -0.5, own)
    got = partial_parts(q, parts + [(own_k, own_v)], dim ** -0.5, own)
    laid = Pieces(parts)
    assert laid.layout is not None
    again = laid.attend(q, own_k, own_v, dim ** -0.5, own)
    for out, lse in (got, again):
        assert (out - want[0]).abs().max() <= 1e-5
        assert (lse - want[1]).abs().max() <= 1e-5
    alone = Pieces(parts).attend(q, scale=dim ** -0.5)  # the shard alone, no own keys
    expected = attend_int8_parts(q, parts, dim ** -0.5)
    assert (alone[0] - expected[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("cap", ["avx2", "none"])
def test_kernel_over_int8_rows_on_every_simd_path(cap):
    """The same under STARQA_SIMD=avx2 and none (a process each: the cap is read once): the
    AVX2 widening and the portable loops against the torch reference."""
    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    script = (
        "import torch\n"
        "from starqa.attention.kvint8 import quantize_rows, attend_int8\n"
        "from starqa.native import ops, kernels\n"
        "torch.manual_seed(3)\n"
        "worst = 0.0\n"
        "for d in (64, 128, 48):\n"
        "    q = torch.randn(2, 6, d); k = quantize_rows(torch.randn(2, 900, d));"
        " v = quantize_rows(torch.randn(2, 900, d))\n"
        "    out, lse = ops.attend(q, [(k.data, v.data, k.scale, v.scale)], d ** -0.5)\n"
        "    want, want_lse = attend_int8(q, k, v, d ** -0.5)\n"
        "    worst = max(worst, (out - want).abs().max().item(),"
        " (lse - want_lse).abs().max().item())\n"
        "print(kernels.simd_paths().written, worst)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "STARQA_SIMD": cap}, check=True)
    written, worst = done.stdout.split()
    assert int(written) <= {"avx2": 1, "none": 0}[cap]
    assert float(worst) <= 1e-5


def test_kernel_refuses_scales_not_laid_out_as_their_rows():
    """Scales must lie as their rows do ([H, N], a data head stride / D apart): a transposed
    one is not taken by the kernel, and the torch reference answers instead, the same."""
    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    q, k, v = _inputs(4, 2, 1, 40, 64)
    key, value = quantize_rows(k), quantize_rows(v)
    odd = Int8Rows(key.data, key.scale.t().contiguous().t(), key.dtype)
    assert not native.supports_int8(odd.data, odd.scale)
    out, _ = partial_parts(q, [(odd, value)], 0.125)
    assert (out - attend_int8(q, key, value, 0.125)[0]).abs().max() <= 1e-5


# --------------------------------------------------------------------------- shards


def test_block_file_holds_int8_rows_and_loads_as_them(tmp_path):
    """A block saved with kv "int8": k and v int8 and their scales [L, Hkv, T] fp32 in the
    file, about half the bytes of bf16's; read back for Phase 1 (`read_blocks`) as floats
    within half a step; Phase 2's pieces (`kv_rows`) are int8 rows standing for the dtype."""
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 40, 64).bfloat16(), torch.randn(3, 2, 40, 64).bfloat16()
    (tmp_path / "f").mkdir(), (tmp_path / "i").mkdir()
    floats = shards.save_block(tmp_path / "f", 0, k, v, range(40), {})
    ints = shards.save_block(tmp_path / "i", 0, k, v, range(40), {}, kv="int8")
    from starqa.core import tensorfile

    _, found = tensorfile.header(ints)
    assert found["k"]["dtype"] == found["v"]["dtype"] == "I8"
    assert found["k_scale"]["shape"] == [3, 2, 40] and found["v_scale"]["dtype"] == "F32"
    assert ints.stat().st_size < 0.6 * floats.stat().st_size
    (layer0_k, layer0_v), *_ = shards.read_blocks(tmp_path / "i", [0])
    bound = k[0].float().abs().amax(-1, keepdim=True) / 254 + 1e-6
    assert (layer0_k[0].float() - k[0].float()).abs().le(bound).all()
    from safetensors.torch import load_file

    key, value = shards.kv_rows(load_file(str(ints)), torch.bfloat16)
    assert isinstance(key, Int8Rows) and key.dtype == torch.bfloat16
    assert torch.equal(shards.read_keys(ints), key.float())


# --------------------------------------------------------------------------- end to end


def _ingest(docs, model, **kw):
    from starqa import engine

    kw = {"dtype": "fp32", **kw}
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                              block_size=60, encode_in="process", **kw))


def test_ingest_int8_answers_as_float(home, docs, tiny_model):
    """`ingest --kv int8` on the tiny model: its own context (another cache key: the KV's
    precision is part of it, and of its blocks' addresses in the store), shards of int8
    rows that pass every check, and the answer of the float context to the same question;
    its logits within a small distance of float's."""
    from starqa import engine
    from starqa.cache import blockstore
    from starqa.core import paths, tensorfile

    float_ctx = _ingest(docs, tiny_model, name="f").manifest
    int8_ctx = _ingest(docs, tiny_model, name="q", kv="int8").manifest
    assert int8_ctx.kv == "int8" and float_ctx.kv == "float"
    assert int8_ctx.key != float_ctx.key
    assert read_manifest(int8_ctx.folder).kv == "int8"
    assert sum(b.bytes for b in int8_ctx.blocks) < 0.6 * sum(b.bytes for b in float_ctx.blocks)
    stored = list(blockstore.store_dir(paths.contexts_dir()).glob("*.safetensors"))
    # every block twice in the store: int8 blocks never take a float block's name
    assert len(stored) == len(int8_ctx.blocks) + len(float_ctx.blocks)
    assert sorted(tensorfile.header(p)[1]["k"]["dtype"] for p in stored) == \
        ["F32"] * len(float_ctx.blocks) + ["I8"] * len(int8_ctx.blocks)
    shards.verify_checksums(int8_ctx, contents=True)
    question = "who approved the travel budget"
    answers = {}
    for name in ("f", "q"):
        answers[name] = engine.ask(engine.AskOptions(question=question, context=name,
                                                     max_new_tokens=6))
    assert answers["q"].token_ids == answers["f"].token_ids
    again = _ingest(docs, tiny_model, name="q", kv="int8")
    assert again.cache_hit and again.manifest.key == int8_ctx.key


def test_phase2_logits_over_int8_shard_near_float(home, docs, tiny_model):
    """One forward of the question over the int8 shard and over the float shard: the
    shard part is attended without a dequantised copy (the pieces stay int8), and the
    logits differ by little relative to their spread."""
    from starqa.phase2.shard_view import ShardView

    float_ctx = _ingest(docs, tiny_model, name="f").manifest
    int8_ctx = _ingest(docs, tiny_model, name="q", kv="int8").manifest
    blocks = list(range(len(int8_ctx.blocks)))
    shard_q, ids_q = shards.load_shard(int8_ctx, blocks, dtype=torch.float32)
    shard_f, ids_f = shards.load_shard(float_ctx, blocks, dtype=torch.float32)
    assert torch.equal(ids_q, ids_f)
    assert isinstance(shard_q[0][0][0], Int8Rows)
    view_q, view_f = ShardView(shard_q), ShardView(shard_f)
    assert view_q.int8 and view_q.n_keys == view_f.n_keys and view_q.dtype(0) == torch.float32
    torch.manual_seed(0)
    heads, dim = shard_f[0][0][0].shape[1], shard_f[0][0][0].shape[3]
    query = torch.randn(1, 2 * heads, 3, dim)
    for layer in range(len(shard_f)):
        q = fold_gqa(query, heads, torch.float32)
        (out_q,), (lse_q,) = view_q.parts(layer, query, q, dim ** -0.5)
        (out_f,), (lse_f,) = view_f.parts(layer, query, q, dim ** -0.5)
        assert (out_q - out_f).abs().max() <= 0.05 * out_f.abs().max()
        assert (lse_q - lse_f).abs().max() <= 0.05
    keys = torch.empty(len(shard_q), heads, 2, dim)
    view_q.gather_keys(torch.tensor([0, 5]), keys)  # attribution reads int8 rows too
    want = shard_q[1][0][0][0].float()[:, [0, 5]]
    assert torch.equal(keys[1], want)


def test_old_float_context_without_kv_still_loads(home, docs_context):
    """A manifest written before int8 KV (no `kv` field): read as float, its shards load
    and pass every check, and a rewrite leaves the field out as it was."""
    from starqa.cache.manifest import write_manifest

    path = docs_context.folder / "manifest.json"
    data = json.loads(path.read_text())
    data.pop("kv", None)
    path.write_text(json.dumps(data))
    old = read_manifest(docs_context.folder)
    assert old.kv == "float" and "kv" in old.absent
    shards.verify_checksums(old, contents=True)
    shard, ids = shards.load_shard(old, list(range(len(old.blocks))))
    assert shard[0][0][0].dtype == torch.float32 and len(ids) == old.blocks[-1].end
    write_manifest(old.folder, old)
    assert "kv" not in json.loads(path.read_text())
    assert kv_tag("float32", "float") == "float32" != kv_tag("float32", "int8")


def test_a_manifest_that_disagrees_with_its_shards_is_damaged(home, docs_context):
    """A float context whose manifest claims int8 KV (an edited manifest, its checksums
    kept) is refused by the header check, naming the shard."""
    from dataclasses import replace

    claimed = replace(docs_context, kv="int8")
    with pytest.raises(ShardError, match="damaged: its keys are F32, its manifest's KV int8"):
        shards.check_header(claimed, 0)
    assert block_file(0) in str(docs_context.blocks[0].file)


def test_unknown_kv_is_refused(home, docs, tiny_model):
    from starqa.core.errors import StarqaError

    with pytest.raises(StarqaError, match="Unknown --kv 'int4'"):
        _ingest(docs, tiny_model, kv="int4")


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_topk_over_an_int8_context_dequantises_at_load(home, docs, tiny_model, index):
    """Top-k attention holds its own copy of the keys: over an int8 context it dequantises
    the blocks as they load (docs/topk.md), and with every key picked answers as exact
    attention over the same int8 context does."""
    from starqa import engine
    from starqa.topk.indexes import TopK

    _ingest(docs, tiny_model, name="q", kv="int8")
    ask = lambda **kw: engine.ask(engine.AskOptions(  # noqa: E731
        question="who approved the travel budget", context="q", max_new_tokens=4, **kw))
    exact = ask()
    every = ask(topk=TopK(count=10_000, index=index))
    assert every.token_ids == exact.token_ids


def test_int8_context_through_the_compiled_step(home, docs, tiny_model, monkeypatch):
    """bf16 caches and int4 weights on the CPU: every layer of a forward runs in one call of
    starqa/native/_step.c, whose exact attention reads the shard's int8 rows and the own
    keys (bf16) in one table; the answer is the float context's."""
    from starqa import engine
    from starqa.phase2 import compiled_step

    if not native.available():
        pytest.skip("starqa's kernel is not built here")
    made = []
    original = compiled_step.CompiledStep._make
    monkeypatch.setattr(compiled_step.CompiledStep, "_make",
                        lambda self, *a: made.append(self.view.int8) or original(self, *a))
    answers = {}
    for kv in ("float", "int8"):
        _ingest(docs, tiny_model, name=kv, kv=kv, dtype="bf16")
        answers[kv] = engine.ask(engine.AskOptions(
            question="who approved the travel budget", context=kv, max_new_tokens=6,
            weights="int4", device="cpu"))
    assert answers["int8"].weights == "int4"
    assert answers["int8"].token_ids == answers["float"].token_ids
    if native.int4_fast():
        assert True in made and False in made  # the step ran over both
