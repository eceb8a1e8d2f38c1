"""The CUDA paths: torch's fused kernels with their LSE (flash-attn when installed), and a
whole ingest + ask on the GPU. Skipped where torch sees no GPU (CI has none); run on a
machine that has one with `python -m pytest tests/test_cuda.py`."""

import pytest
import torch

from starqa.attention import attend, attend_fused, fold_gqa, partial_chunks

from oracles import FUSED_SHAPES, check_chunk_parts, exact_part, reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,m,n,chunk,head", FUSED_SHAPES)
def test_cuda_fused_chunks_within_the_reference_error(dtype, q_heads, kv_heads, m, n, chunk, head):
    """As test_attention's CPU test: each part's LSE is the exact partial LSE, and the
    merged output's error against fp64 stays within twice a plain same-dtype computation's."""
    torch.manual_seed(n)
    q = torch.randn(1, q_heads, m, 64, dtype=dtype)
    k, v = torch.randn(1, kv_heads, n, 64, dtype=dtype), torch.randn(1, kv_heads, n, 64, dtype=dtype)
    want, want_lse = reference(q, k, v)
    groups = q_heads // kv_heads
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        plain = torch.nn.functional.scaled_dot_product_attention(
            q.cuda(), k.repeat_interleave(groups, 1).cuda(), v.repeat_interleave(groups, 1).cuda())
    budget = 2 * (plain.double().cpu() - want).abs().max().item() + 1e-6
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    out, lse = attend_fused(qc, kc, vc, chunk=chunk)
    assert out.is_cuda and out.dtype == lse.dtype == torch.float32
    assert (out.double().cpu() - want).abs().max().item() <= budget
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=0, atol=1e-4)
    outs, lses = partial_chunks(fold_gqa(qc, kv_heads, dtype), kc, vc, 64 ** -0.5, chunk, head)
    assert outs[0].is_cuda
    check_chunk_parts(q, k, v, outs, lses, chunk, head, want, budget)


def test_cuda_causal_attend_matches_the_reference():
    """`attend` with the bottom-right causal mask on the GPU (Phase 2's own KV)."""
    torch.manual_seed(0)
    q = torch.randn(1, 12, 9, 64)
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    out, lse = attend(q.cuda(), k.cuda(), v.cuda(), causal=True)
    want, want_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_ingest_and_ask_equal_transformers(home, docs, tiny_model, dtype):
    """A whole dense ingest and a cold ask on the GPU, in process (a world of one): in fp32
    the greedy tokens are those of transformers' generate over the whole prompt on the CPU;
    in bf16 the answer runs through the fused kernels and its sources sum to one."""
    from starqa import engine
    from fakes import QUESTION
    from tiny import reference_tokens

    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(docs),), model=str(tiny_model), dtype=dtype, method="dense", block_size=50,
        device="cuda")).manifest
    answer = engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8, device="cuda"))
    assert answer.workers == 1 and answer.token_ids
    assert answer.sources and sum(s.share for s in answer.sources) <= 1 + 1e-6
    if dtype == "fp32":
        assert list(answer.token_ids) == reference_tokens(tiny_model, manifest, QUESTION, 8)


def test_more_workers_than_gpus_is_refused_before_anything_starts():
    from starqa.core.errors import StarqaError
    from starqa.runtime.launch import check_gpus

    gpus = torch.cuda.device_count()
    check_gpus("auto", gpus)
    with pytest.raises(StarqaError, match=f"need {gpus + 1} GPUs") as err:
        check_gpus("auto", gpus + 1)
    assert f"--workers {gpus}" in err.value.hint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_topk_every_key_selected_equals_exact_partial_attention(dtype):
    """test_topk's CPU test on the GPU: with k >= the keys, selection and attention over
    the selected rows are exact attention, within twice fp32's own error against fp64;
    a small k picks exactly the best keys, as the CPU does."""
    from starqa.attention import topk

    torch.manual_seed(0)
    hkv, rows, n, dim = 3, 9, 300, 64
    q = torch.randn(hkv, rows, dim).to(dtype)
    key, value = torch.randn(hkv, n, dim).to(dtype), torch.randn(hkv, n, dim).to(dtype)
    scale = dim ** -0.5
    scores, idx = topk.select_exact(q.cuda(), key.cuda(), n + 5)
    out, lse = topk.attend_selected(scores, idx, topk.gather_rows(value.cuda(), idx), scale)
    assert out.is_cuda and out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = exact_part(q.float(), key.float(), value.float(), scale, torch.float64)
    own_out, own_lse = exact_part(q.float(), key.float(), value.float(), scale, torch.float32)
    assert (out.double().cpu() - ref_out).abs().max() <= 2 * (own_out - ref_out).abs().max() + 1e-6
    assert (lse.double().cpu() - ref_lse).abs().max() <= 2 * (own_lse - ref_lse).abs().max() + 1e-6
    _, small = topk.select_exact(q.float().cuda(), key.float().cuda(), 7)
    _, want = topk.select_exact(q.float(), key.float(), 7)
    assert torch.equal(small.cpu().sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_cuda_topk_shard_with_every_key_merges_to_exact_attention(kind):
    """test_topk's merge test with the blocks and queries on the GPU (what `starqa eval`
    builds): flat attends there, ivf and hnsw search on the CPU; two workers' parts and
    the own causal part merge to exact attention over every key."""
    from starqa.attention import merge
    from starqa.topk.indexes import TopK
    from starqa.topk import retrieval

    torch.manual_seed(2)
    hkv, g, m, dim, layer = 2, 3, 4, 16, 1
    blocks = [(torch.randn(2, hkv, t, dim), torch.randn(2, hkv, t, dim)) for t in (40, 90, 70)]
    own_k, own_v = torch.randn(1, hkv, m, dim), torch.randn(1, hkv, m, dim)
    query = torch.randn(1, hkv * g, m, dim)
    gpu = [(k.cuda(), v.cuda()) for k, v in blocks]
    settings, scale = TopK(count=1000, index=kind), dim ** -0.5
    q = query.reshape(1, hkv, g * m, dim).cuda()
    outs, lses = [], []
    for shard in (retrieval.from_parts(gpu[:1], settings, 200),
                  retrieval.from_parts(gpu[1:], settings, 200, first=False)):
        out, lse = shard.parts(layer, q, scale, m)
        assert all(o.is_cuda for o in out)
        outs += out
        lses += lse
    own_out, own_lse = attend(query.cuda(), own_k.cuda(), own_v.cuda(), scale, causal=True)
    outs.append(own_out.reshape(1, hkv, g * m, dim))
    lses.append(own_lse.reshape(1, hkv, g * m))
    out, lse = merge(torch.cat([o.float() for o in outs]), torch.cat(lses))
    keys = torch.cat([b[0][layer] for b in blocks] + [own_k[0]], dim=1)[None]
    values = torch.cat([b[1][layer] for b in blocks] + [own_v[0]], dim=1)[None]
    ref, ref_lse = attend(query.double(), keys.double(), values.double(), scale, causal=True)
    assert (out.reshape(ref.shape).double().cpu() - ref).abs().max() <= 1e-5
    assert (lse.reshape(ref_lse.shape).double().cpu() - ref_lse).abs().max() <= 1e-5


def test_cuda_topk_ask_with_every_key_is_exact_ask(home, docs, tiny_model):
    """A dense ingest and cold asks on the GPU, fp32: top-k with k = 100% gives exact
    Phase 2's greedy tokens for every index kind, keys and values in memory or mapped
    from the cache (--kv-on-disk), the question's forward exact or top-k; a small k on
    disk answers as in memory."""
    from starqa import engine
    from starqa.topk.indexes import TopK

    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model), dtype="fp32",
                                       method="dense", block_size=50, device="cuda"))

    def ask(topk=None):
        return engine.ask(engine.AskOptions(question="who approved the travel budget",
                                            max_new_tokens=8, device="cuda", topk=topk))

    exact = ask()
    assert exact.token_ids and exact.attention == "exact"
    for kind in ("flat", "ivf", "hnsw"):
        for on_disk in (False, True):
            for prefill in ("exact", "topk"):
                answer = ask(TopK(fraction=1.0, index=kind, kv_on_disk=on_disk, prefill=prefill))
                assert answer.token_ids == exact.token_ids, (kind, on_disk, prefill)
                assert answer.attention.startswith("top-k 100% (" + kind)
    for kind in ("flat", "ivf"):
        wanted = ask(TopK(count=20, index=kind, prefill="topk")).token_ids
        assert ask(TopK(count=20, index=kind, prefill="topk", kv_on_disk=True)).token_ids == wanted
