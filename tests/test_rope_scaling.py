"""RoPE scaling as a config declares it (starqa.models.rope), in every path that rotates keys
and queries, against transformers' own forward in fp32: Phase 2's decoder (torch's operators
and the C rope table), Phase 1's model pinned to the context's length, the cold first
token's forward, and the re-rotation of moved blocks. Tiny random models whose original
window is 64 positions, run over 200, so every scaling is past its window."""

import json
import shutil

import pytest
import torch

from starqa.attention import attend
from starqa.models import context_window, load_model
from starqa.models.decoder_io import load_decoder
from starqa.models.prepared import DecoderConfig
from starqa.models.rope import Rope, frequencies, yarn
from starqa.native import kernels, ops as native
from starqa.core.errors import StarqaError
from starqa.reingest.rotate import inv_freq as rotation_freqs, rerotate
from tiny import make_tiny_model

ORIGINAL, LENGTH = 64, 200
D = 16  # both tiny models' head size: 8 frequencies
# each kind's parameters and the window its config declares (max_position_embeddings)
KINDS = {
    "default": ({}, 256),
    "linear": ({"factor": 4.0}, ORIGINAL),
    "dynamic": ({"factor": 4.0}, ORIGINAL),
    "yarn": ({"factor": 4.0, "original_max_position_embeddings": ORIGINAL}, ORIGINAL),
    "llama3": ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL}, 256),
    "longrope": ({"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
                  "long_factor": [1.0, 1.3, 1.8, 2.5, 3.5, 4.5, 5.5, 6.0],
                  "original_max_position_embeddings": ORIGINAL}, 256),
}
# error relative to the reference's own magnitude: fp32 throughout, transformers' and
# starqa's operators in another order (and libm's cos and sin against torch's)
BOUND = 1e-4


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def plain(request, tmp_path_factory):
    """A tiny model with plain RoPE (int4 tiles take its vocabulary: firsttoken)."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "plain", arch=request.param,
                           vocab_multiple=16)


@pytest.fixture(scope="module", params=list(KINDS))
def scaled(request, plain):
    """The same weights with the kind's RoPE declared in config.json: (kind, folder)."""
    kind = request.param
    folder = plain.parent / kind
    if not folder.exists():
        shutil.copytree(plain, folder, ignore=shutil.ignore_patterns(".starqa-*"))
        config = json.loads((folder / "config.json").read_text())
        theta = (config.get("rope_parameters") or {}).get("rope_theta",
                                                          config.get("rope_theta", 10000.0))
        parameters, window = KINDS[kind]
        config["rope_parameters"] = {"rope_type": kind, "rope_theta": theta, **parameters}
        config.pop("rope_scaling", None)
        config["max_position_embeddings"] = window
        (folder / "config.json").write_text(json.dumps(config))
    return kind, folder


@pytest.fixture(scope="module")
def ids(plain):
    vocab = json.loads((plain / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (LENGTH,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def reference(scaled, ids):
    """transformers' own model of the folder, its logits [LENGTH, V] over the whole
    sequence in fp32 (its RoPE computed from the forward's length, as transformers does)."""
    model = load_model(scaled[1], dtype=torch.float32)
    with torch.inference_mode():
        return model, model(ids[None]).logits[0]


def causal(layer, q, k, v):
    return attend(q, k, v, causal=True)[0]


@pytest.mark.parametrize("rows", ["torch", "native"])
def test_decoder_forward_is_transformers(scaled, plain, ids, reference, rows):
    """Phase 2's decoder, its RoPE that of the context's length, gives transformers' logits
    over 200 positions (past the original window of 64), with torch's operators and with
    the C rope table; plain RoPE on the same weights is far off, so the bound means it."""
    kind, folder = scaled
    if rows == "native" and not native.rows_supported(torch.device("cpu"), torch.float32):
        pytest.skip("starqa's kernels are not built here")
    decoder = load_decoder(folder, torch.float32, length=LENGTH)
    decoder.native_rows = rows == "native"
    with torch.inference_mode():
        got = decoder.logits(decoder.forward(ids, torch.arange(LENGTH), causal))
    expected = reference[1]
    assert relative(got, expected) < BOUND
    if kind != "default":
        other = load_decoder(plain, torch.float32)
        with torch.inference_mode():
            unscaled = other.logits(other.forward(ids, torch.arange(LENGTH), causal))
        assert relative(unscaled, expected) > 100 * BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rope_table_is_transformers_cos_and_sin(scaled, reference, dtype):
    """starqa's C table of cos and sin, from the rule's frequencies and attention factor,
    is transformers' rotary embedding over the whole sequence: within fp32's rounding
    (libm's cos against torch's), in bf16 within one rounding of it."""
    if not native.rows_supported(torch.device("cpu"), dtype):
        pytest.skip("starqa's kernels are not built here")
    model = reference[0]
    positions = torch.arange(LENGTH)
    x = torch.zeros(1, LENGTH, D, dtype=dtype)
    with torch.inference_mode():
        expected = model.model.rotary_emb(x.float(), positions[None])
    inv_freq, attention = frequencies(model.config, LENGTH)
    got = native.rope_table(positions, inv_freq, dtype, attention)
    for mine, theirs in zip(got, expected):
        mine, theirs = mine[:, 0], theirs[0]
        if dtype == torch.float32:
            assert relative(mine, theirs) < 1e-5
        else:  # one bf16 step of the largest value (the attention factor's)
            step = 2.0 ** -7 * max(attention, 1.0)
            assert (mine.float() - theirs.to(dtype).float()).abs().max().item() <= step
    if scaled[0] in ("yarn", "longrope"):
        assert attention > 1.0  # the factor on cos and sin is there to be checked


def test_phase1_model_pinned_to_the_context_is_the_whole_forwards(scaled, ids, reference):
    """Phase 1 encodes a context a block at a time; its model is pinned to the context's
    length, so a forward over its first 50 positions gives the rows of transformers'
    forward over all 200. Unpinned, the kinds that depend on the length (dynamic,
    longrope) would rotate those 50 with another set: they differ, so the pin matters."""
    kind, folder = scaled
    part = ids[:50]
    pinned = load_model(folder, dtype=torch.float32, rope_length=LENGTH)
    with torch.inference_mode():
        got = pinned(part[None]).logits[0]
        alone = reference[0](part[None]).logits[0]
    expected = reference[1][:50]
    assert relative(got, expected) < BOUND
    if kind in ("dynamic", "longrope"):
        assert relative(alone, expected) > 100 * BOUND


def test_rerotated_keys_are_keys_encoded_at_the_new_position(scaled, ids, reference):
    """A key stored at position p (cos and sin times the attention factor) re-rotated by δ
    is the key transformers computes at p + δ, past the original window; the kinds whose
    frequencies depend on the context's length are never re-rotated."""
    kind, folder = scaled
    freqs = rotation_freqs(folder)
    if kind in ("dynamic", "longrope"):
        assert freqs is None
        return
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, delta = reference[0], 40
    layer = model.model.layers[0]
    config = model.config
    with torch.inference_mode():
        x = layer.input_layernorm(model.model.embed_tokens(ids[None, 100:140]))  # [1, T, H]
        k = layer.self_attn.k_proj(x).view(1, 40, config.num_key_value_heads, D).transpose(1, 2)

        def at(start):
            cos, sin = model.model.rotary_emb(x, torch.arange(start, start + 40)[None])
            return apply_rotary_pos_emb(k, k, cos, sin)[1]  # [1, Hkv, T, D]

        stored, expected = at(110), at(110 + delta)
    got = rerotate(stored, delta, freqs)  # stored as [L=1, Hkv, T, D]
    assert relative(got, expected) < 1e-5
    assert relative(stored, expected) > 0.1


@pytest.mark.skipif(not kernels.int4_fast(),
                    reason="no AVX-512 VNNI here: int4 weights keep torch's layout")
def test_first_token_forward_has_the_decoders_bits(scaled, ids):
    """The cold first token's forward (numpy and the C kernels, before torch) rotates with
    the prepared file's frequencies and attention factor: at positions past the original
    window its keys are the torch decoder's bit for bit (layer 0, before any attention),
    its first token the same."""
    from starqa.coldstart import firsttoken

    kind, folder = scaled
    torch_path = load_decoder(folder, torch.bfloat16, "int4")  # writes the prepared file
    model = firsttoken._load_model(folder)
    assert model is not None
    start, m = 150, 12
    question = ids[:m].tolist()
    early = firsttoken._forward(model, [kernels.KeyTable([]) for _ in range(model.config.layers)],
                                question, start, 1)
    keys = []

    def capture(layer, q, k, v):
        keys.append(k[0].clone())
        return attend(q, k, v, causal=True)[0]

    with torch.inference_mode():
        hidden = torch_path.forward(torch.tensor(question), torch.arange(start, start + m),
                                    capture)
    assert torch.equal(keys[0], torch.from_numpy(early.keys[0]).view(torch.bfloat16))
    assert early.token == int(torch_path.logits(hidden[-1:]).argmax())
    if kind in ("yarn", "longrope"):
        assert model.rope_attention == torch_path.rope_attention > 1.0


# ---- the rule, the window, the config ------------------------------------------------


def test_the_rule_is_transformers_frequencies_at_the_contexts_length(scaled, reference):
    """`frequencies` at a length gives what transformers' own functions give for a
    sequence of that length; dynamic and longrope change past their windows, the others
    not; `Rope.key` names exactly the sets that differ from the config's at load."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind, folder = scaled
    config = reference[0].config
    rope = DecoderConfig.read(folder).rope
    short, long = frequencies(config, 32), frequencies(config, LENGTH)
    if kind == "default":
        return
    expected, attention = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=LENGTH)
    assert relative(long[0], expected) < 1e-6 and long[1] == pytest.approx(attention)
    changes = kind in ("dynamic", "longrope")
    assert (relative(short[0], long[0]) > 1e-3) == changes
    assert (rope.key(LENGTH) is not None) == changes and rope.key(32) is None
    if kind == "dynamic":  # every length past the window its own set
        assert rope.key(LENGTH + 1) != rope.key(LENGTH)


@pytest.mark.parametrize("config,window", [
    # Qwen2.5's YaRN, as its model cards add it
    ({"max_position_embeddings": 32768, "rope_theta": 1e6,
      "rope_scaling": {"type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768}}, 131072),
    # Llama 3.1: the window declared already
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, 131072),
    # Phi-3's LongRoPE: no factor, the window over the original one
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
        "original_max_position_embeddings": 4096}}, 131072),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
     16384),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     8192),
    ({"max_position_embeddings": 4096}, 4096),
])
def test_the_window_is_the_scaled_one(config, window):
    assert Rope.read(config).scaled_window == window


def test_the_reported_window_is_the_scaled_one(scaled, reference):
    """The window starqa plans with: the original 64 times the factor (llama3: 8, the
    declared 256 otherwise), the declared one where the config names no factor."""
    kind, _ = scaled
    assert context_window(reference[0].config) == (512 if kind == "llama3" else 256)


def test_yarn_turned_on_for_a_plain_model(plain, ids):
    """`yarn` declares YaRN in a plain config: the window is the scaled one, and the model
    loaded from it is transformers' YaRN (the decoder agrees with it)."""
    config = {**json.loads((plain / "config.json").read_text()),
              "max_position_embeddings": ORIGINAL}
    folder = plain.parent / "turned-on"
    if not folder.exists():
        shutil.copytree(plain, folder, ignore=shutil.ignore_patterns(".starqa-*"))
        (folder / "config.json").write_text(json.dumps(yarn(config, 4.0)))
    rope = DecoderConfig.read(folder).rope
    assert rope.kind == "yarn" and rope.scaled_window == 4 * ORIGINAL
    with pytest.raises(ValueError, match="yarn"):
        yarn(json.loads((folder / "config.json").read_text()), 2.0)
    model = load_model(folder, dtype=torch.float32)
    decoder = load_decoder(folder, torch.float32, length=LENGTH)
    with torch.inference_mode():
        expected = model(ids[None]).logits[0]
        got = decoder.logits(decoder.forward(ids, torch.arange(LENGTH), causal))
    assert relative(got, expected) < BOUND


def test_prepared_weights_follow_the_configs_rope(plain, tmp_path):
    """A prepared weights file keeps the RoPE's frequencies: one made under plain RoPE is
    not used once the config beside it declares YaRN (the same weights): it is made again,
    and the decoder rotates as transformers' YaRN does."""
    from transformers import AutoConfig

    from starqa.models.prepared import prepared_file

    folder = tmp_path / "edited"
    shutil.copytree(plain, folder, ignore=shutil.ignore_patterns(".starqa-*"))
    before = load_decoder(folder, torch.float32, weights="int8")
    made = prepared_file(folder, "int8", "float32")
    assert made.is_file()
    config = {**json.loads((folder / "config.json").read_text()),
              "max_position_embeddings": ORIGINAL}
    (folder / "config.json").write_text(json.dumps(yarn(config, 4.0)))
    after = load_decoder(folder, torch.float32, weights="int8")
    want, attention = frequencies(AutoConfig.from_pretrained(folder))
    assert torch.equal(after.inv_freq, want) and not torch.equal(before.inv_freq, want)
    assert after.rope_attention == pytest.approx(attention) and attention > 1
    again = load_decoder(folder, torch.float32, weights="int8")  # the file made again is used
    assert torch.equal(again.inv_freq, want)


def test_a_rope_starqa_does_not_know_is_refused(plain, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(plain, folder, ignore=shutil.ignore_patterns(".starqa-*"))
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(StarqaError, match="proportional"):
        DecoderConfig.read(folder)


def test_block_addresses_name_the_set_where_the_length_chooses_it(scaled):
    """A block encoded under one set of frequencies is never reused under another: the
    addresses of a dynamic or longrope model's blocks name the set past the window."""
    from starqa.reingest.incremental import block_model

    kind, folder = scaled
    short, long, longer = (block_model("d", folder, n) for n in (32, LENGTH, LENGTH + 1))
    assert short == "d"
    assert (long != "d") == (kind in ("dynamic", "longrope"))
    assert (longer != long) == (kind == "dynamic")


def test_phase1_blocks_hold_the_whole_forwards_keys(scaled, ids, reference, tmp_path):
    """starqa's Phase 1 (dense, in blocks of 50: each a forward over its own positions
    after the stored KV before it) writes, in every layer, the keys and values
    transformers' one forward over all 200 positions computes: the model is pinned to the
    context's length (`workers.encoding.rope_length`, the method's query position)."""
    from safetensors.torch import load_file

    from starqa.methods import MethodConfig
    from starqa.workers.encoding import BlockSink, EncodeTask, encode_in_process, rope_length

    kind, folder = scaled
    blocks = [(start, start + 50) for start in range(0, LENGTH, 50)]
    task = EncodeTask(MethodConfig("dense", 50, 0), blocks, range(len(blocks)))
    assert rope_length(folder, ids, task) == (LENGTH if kind in ("dynamic", "longrope")
                                              else None)
    encode_in_process(folder, "cpu", ids, task, BlockSink(tmp_path, "float32"))
    with torch.inference_mode():
        cache = reference[0](ids[None], use_cache=True).past_key_values
    for i, (start, end) in enumerate(blocks):
        block = load_file(str(tmp_path / f"block_{i:05d}.safetensors"))
        for layer, kv in enumerate(cache.layers):
            assert relative(block["k"][layer], kv.keys[0, :, start:end]) < BOUND
            assert relative(block["v"][layer], kv.values[0, :, start:end]) < BOUND
