"""Phase 2's lean decoder against transformers, and its quantised weights."""

import json

import pytest
import torch

from starqa import models
from starqa.native import ops as native
from starqa.core import tensorfile
from starqa.attention import attend
from starqa.models.decoder_io import load_decoder
from starqa.core.errors import StarqaError
from starqa.models import load_model
from tiny import make_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param)


def causal(layer, q, k, v):
    return attend(q, k, v, causal=True)[0]


def logits(decoder, ids):
    with torch.inference_mode():
        return decoder.logits(decoder.forward(ids, torch.arange(len(ids)), causal))


IDS = torch.tensor([3, 17, 5, 22, 9, 30, 11, 4, 8, 19, 2, 25])


def test_dense_fp32_equals_transformers(tiny):
    """RMSNorm, fused q/k/v (with Qwen2's biases), RoPE on q and k at once, SwiGLU, tied or
    separate head: the same logits as transformers' own model, fp32."""
    reference = load_model(tiny, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(IDS[None]).logits[0]
    got = logits(load_decoder(tiny, torch.float32), IDS)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights,bound", [("int8", 0.08), ("int4", 0.5)])
def test_quantised_weights_are_prepared_once(tiny, weights, bound):
    """int8/int4 logits stay near the dense ones; the prepared weights are saved beside the
    model (hidden, so the model's fingerprint does not change) and a second load reads them
    and gives the very same logits, for several tokens at once too (the packed kernels
    crashed on weights mapped at an unaligned file offset)."""
    before = models.fingerprint(tiny)["digest"]
    dense = logits(load_decoder(tiny, torch.bfloat16), IDS).float()
    fresh = logits(load_decoder(tiny, torch.bfloat16, weights), IDS).float()
    prepared = tiny / f".starqa-phase2-{weights}-bfloat16.safetensors"
    assert prepared.is_file()
    again = logits(load_decoder(tiny, torch.bfloat16, weights), IDS).float()
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
    assert ((fresh - dense).norm() / dense.norm()).item() < bound
    assert models.fingerprint(tiny)["digest"] == before


def test_a_prefill_gives_back_the_int8_copy_it_read(tiny, monkeypatch):
    """int4 mapped from its prepared file: a forward of W8A8's rows reads each layer's int8
    copy and releases its pages after (only the decode's int4 weights stay resident); the
    next one maps them again and gives the very same logits; a one-row step reads no copy.
    (W8A8 as where torch's int8 GEMM is fast, whatever this CPU.)"""
    monkeypatch.setattr(native, "int8_gemm_fast", lambda: True)
    load_decoder(tiny, torch.bfloat16, "int4")  # prepares the file
    released = []
    real = tensorfile.FileMap.release
    monkeypatch.setattr(tensorfile.FileMap, "release",
                        lambda self, t: (released.append(t.data_ptr()), real(self, t)))
    decoder = load_decoder(tiny, torch.bfloat16, "int4")
    ids = torch.arange(70) % 30  # more rows than either int4 layout's W8A8 threshold
    first = logits(decoder, ids)
    copies = [lin.w8.data_ptr() for layer in decoder.layers
              for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    assert all(copies) and sorted(released) == sorted(copies)
    torch.testing.assert_close(logits(decoder, ids), first, rtol=0, atol=0)
    released.clear()
    logits(decoder, ids[:1])
    assert released == []


def test_stale_prepared_weights_are_rebuilt(tiny, tmp_path):
    """Prepared weights of other model weights (or another torch), or int4 weights in the
    other kernel's layout (a model folder shared with a CPU without VNNI), are not used."""
    from safetensors.torch import save_file

    from starqa.core import tensorfile

    decoder = load_decoder(tiny, torch.bfloat16, "int4")
    prepared = tiny / ".starqa-phase2-int4-bfloat16.safetensors"
    stamp = tensorfile.header(prepared)[1]["__metadata__"]
    assert stamp["int4"] == ("tiles" if native.int4_fast() else "torch")
    other = {**stamp, "int4": "torch" if stamp["int4"] == "tiles" else "tiles"}
    for metadata in ({"weights_sha256": "0" * 64, "torch": torch.__version__}, other):
        save_file({k: torch.zeros_like(v) for k, v in decoder.tensors().items()},
                  str(prepared), metadata=metadata)
        got = logits(load_decoder(tiny, torch.bfloat16, "int4"), IDS)
        torch.testing.assert_close(got, logits(decoder, IDS), rtol=0, atol=0)


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny):
    folder = tmp_path / "other"
    folder.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(StarqaError, match="Phase 2 supports LlamaForCausalLM") as err:
        load_decoder(folder, torch.float32)
    assert "--model" in err.value.hint
    with pytest.raises(StarqaError, match="Unknown weight format 'int3'"):
        load_decoder(tiny, torch.float32, "int3")


def test_int4_keeps_weights_that_came_from_4_bit_blocks():
    """The embedded GGUFs hold blocks of 32 weights on 16 levels (Q4_1, Q4_K): int4 in
    groups of 32 re-quantises such a tensor without loss, so x Wᵀ through the packed kernel
    equals the dense product up to bf16 rounding."""
    from starqa.models.linear import Linear

    torch.manual_seed(0)
    n, k = 64, 128
    levels = torch.randint(0, 16, (n, k // 32, 32)).float()
    levels[..., 0], levels[..., 1] = 0, 15  # every block spans its 16 levels, as GGUF's do
    scale, low = torch.rand(n, k // 32, 1) * 0.1 + 0.01, torch.randn(n, k // 32, 1)
    weight = (levels * scale + low).view(n, k).bfloat16()
    x = torch.randn(3, k).bfloat16()
    packed = Linear.quantize(weight, None, "int4", torch.bfloat16)
    assert packed.format == "int4" and packed.nbytes() < weight.nbytes / 2
    expected = x.float() @ weight.float().T
    dense_bf16 = (x @ weight.T).float()
    error = (packed(x).float() - expected).abs().max()
    assert error <= 2 * (dense_bf16 - expected).abs().max() + 1e-3


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_several_rows_multiply_int8_activations_by_int8_weights(fmt, monkeypatch):
    """From `w8a8_rows` rows on (a long question's prefill), a quantised Linear quantises x
    per row and runs one int8 GEMM: per row it then equals that row alone through the same
    path (no row leaks into another's scale), stays within 2% of the fp32 product, and for
    int4 it is closer to it than the int4 kernel; fewer rows (decode, a short question)
    keep the format's own kernel. (As where torch's int8 GEMM is fast, whatever this CPU.)"""
    from starqa.models.linear import INT4_GROUP, W8A8_MIN_ROWS, W8A8_MIN_ROWS_TILES, Linear

    monkeypatch.setattr(native, "int8_gemm_fast", lambda: True)
    torch.manual_seed(1)
    weight = torch.randn(96, 128).bfloat16()
    lin = Linear.quantize(weight, None, fmt, torch.bfloat16)
    assert lin.w8a8_rows == (W8A8_MIN_ROWS_TILES if lin.scale is None else W8A8_MIN_ROWS)
    x = torch.randn(lin.w8a8_rows + 3, 128).bfloat16()
    x[2] *= 50  # one loud row
    exact = x.float() @ weight.float().T
    rows = lin(x).float()
    assert ((rows - exact).norm() / exact.norm()).item() < 0.02
    stacked = torch.cat([lin(torch.cat([x[i:i + 1]] * lin.w8a8_rows))[:1]
                         for i in range(len(x))])
    torch.testing.assert_close(rows, stacked.float(), rtol=0, atol=0)
    one = lin(x[:1])
    if fmt == "int8":
        kernel = torch.ops.aten._weight_int8pack_mm(x[:1], lin.weight, lin.scale)
    elif lin.scale is None:  # starqa's int4 tiles (starqa/native/_int4.c)
        kernel = native.int4_mm(x[:1], lin.weight)
    else:
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x[:1], lin.weight, INT4_GROUP,
                                                            lin.scale)
    torch.testing.assert_close(one, kernel, rtol=0, atol=0)
    if lin.scale is None:  # tiles: below w8a8_rows, every row as it would be alone
        below = x[:lin.w8a8_rows - 1]
        torch.testing.assert_close(lin(below), native.int4_mm(below, lin.weight), rtol=0,
                                   atol=0)
    if fmt == "int4":
        per_row = torch.cat([lin(x[i:i + 1]) for i in range(len(x))]).float()
        assert (rows - exact).norm() < (per_row - exact).norm()


@pytest.mark.skipif(not native.int4_fast(), reason="no fast int4 path here (AVX-512 VNNI or AVX2)")
def test_without_a_fast_int8_gemm_every_forward_runs_the_tiles(monkeypatch):
    """Where torch's int8 GEMM is a plain loop (no AVX-512 VNNI: ~20x the tiles' time), an
    int4 Linear never runs W8A8: a prefill of any length is the tiles', row for row."""
    from starqa.models.linear import W8A8_MIN_ROWS_TILES, Linear

    monkeypatch.setattr(native, "int8_gemm_fast", lambda: False)
    torch.manual_seed(2)
    lin = Linear.quantize(torch.randn(96, 128).bfloat16(), None, "int4", torch.bfloat16)
    assert lin.scale is None and lin.w8a8_rows is None
    x = torch.randn(W8A8_MIN_ROWS_TILES + 7, 128).bfloat16()
    torch.testing.assert_close(lin(x), native.int4_mm(x, lin.weight), rtol=0, atol=0)
