"""The CUDA paths: torch's fused kernels with their LSE (flash-attn when installed), and a
whole ingest + ask on the GPU. Skipped where torch sees no GPU (CI has none); run on a
machine that has one with `python -m pytest tests/test_cuda.py`."""

import pytest
import torch

from starqa.attention import attend, attend_fused, fold_gqa, partial_chunks

from test_attention import FUSED_SHAPES, check_chunk_parts, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    from test_engine import QUESTION, reference_tokens

    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(docs),), model=str(tiny_model), dtype=dtype, method="dense", block_size=50,
        device="cuda")).manifest
    answer = engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8, device="cuda"))
    assert answer.workers == 1 and answer.token_ids
    assert answer.sources and sum(s["share"] for s in answer.sources) <= 1 + 1e-6
    if dtype == "fp32":
        assert answer.token_ids == reference_tokens(tiny_model, manifest, QUESTION, 8)


def test_more_workers_than_gpus_is_refused_before_anything_starts():
    from starqa.errors import StarqaError
    from starqa.launch import check_gpus

    gpus = torch.cuda.device_count()
    check_gpus("auto", gpus)
    with pytest.raises(StarqaError, match=f"need {gpus + 1} GPUs") as err:
        check_gpus("auto", gpus + 1)
    assert f"--workers {gpus}" in err.value.hint
