"""`--model ./x.gguf` and `--model ollama:NAME[:TAG]` (issue 49, item 4): GGUFs the tests
write with the `gguf` package (a tiny random Llama with a byte-level BPE, tests/tiny.py's
shapes) and ollama stores laid out in tmp_path, converted once into the model cache."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from fakes import starqa
from starqa import models
from starqa.core.errors import StarqaError
from starqa.core.paths import models_dir
from starqa.models import gguf as ggufs
from starqa.models import ollama
from tiny import TEMPLATE, byte_bpe

QUESTION = "who approved the travel budget"


def _tokenizer() -> tuple[list[str], list[str]]:
    """tiny's byte-level BPE, GGUF's way: (tokens, merges "a b")."""
    vocab, merges = byte_bpe()
    return sorted(vocab, key=vocab.get), [" ".join(m) for m in merges]


def _llama_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's RoPE order (its convert_hf_to_gguf.py `permute`), which
    transformers' GGUF loader undoes."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, seed: int = 0, arch: str = "llama") -> dict[str, torch.Tensor]:
    """A tiny random Llama (tiny.py's shapes) as an F32 GGUF with a byte-level BPE, "</s>"
    ending turns; returns its state dict. `arch` other than llama: a header alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    writer = gguf.GGUFWriter(str(path), arch)
    if arch != "llama":
        writer.add_block_count(2)
        for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                     writer.write_tensors_to_file, writer.close):
            step()
        return {}
    tokens, merges = _tokenizer()
    tokens += ["<s>", "</s>"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=len(tokens) - 2,
                         eos_token_id=len(tokens) - 1, initializer_range=0.2)
    torch.manual_seed(seed)
    state = LlamaForCausalLM(config).state_dict()
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, tensor in state.items():
        weight = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _llama_order(weight, 4 if "q_proj" in name else 2)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                          np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny Llama's GGUF (written once) and its state dict."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, write_gguf(path)


@pytest.fixture
def gguf_file(tiny_gguf, tmp_path) -> Path:
    """A copy of the tiny GGUF of this test's own (tests touch and damage theirs)."""
    return Path(shutil.copy(tiny_gguf[0], tmp_path / tiny_gguf[0].name))


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("STARQA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.delenv("STARQA_MODEL", raising=False)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_store(root: Path, gguf_path: Path, name: str = "tiny", tags=("latest",)) -> str:
    """An ollama store at `root` holding `gguf_path` as the model layer of NAME:TAG for each
    tag (NAME "ns/name": another namespace), with a template layer beside it, as ollama lays
    them out; returns the blob's sha256."""
    digest = sha256(gguf_path)
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf_path, blobs / f"sha256-{digest}")
    template = b"{{ .Prompt }}"
    (blobs / f"sha256-{hashlib.sha256(template).hexdigest()}").write_bytes(template)
    namespace, _, model = name.rpartition("/")
    folder = root / "manifests" / "registry.ollama.ai" / (namespace or "library") / model
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "c" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": f"sha256:{hashlib.sha256(template).hexdigest()}", "size": len(template)},
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": gguf_path.stat().st_size},
        ]}
    for tag in tags:
        (folder / tag).write_text(json.dumps(manifest))
    return digest


def converted() -> list[str]:
    """The converted GGUF folders in the model cache."""
    root = models_dir()
    return sorted(p.name for p in root.iterdir() if p.name.startswith("gguf-")) \
        if root.is_dir() else []


def count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


# ---------------------------------------------------------------------------- a GGUF file


def test_the_supported_architectures_are_phase_2s():
    from starqa.models.prepared import ARCHITECTURES

    assert sorted(ggufs.ARCHITECTURES.values()) == sorted(ARCHITECTURES)


def test_a_gguf_is_converted_once_with_its_weights_and_tokenizer(tiny_gguf, gguf_file,
                                                                 monkeypatch):
    conversions = count_calls(monkeypatch, ggufs, "convert_gguf")
    hashes = count_calls(monkeypatch, ggufs, "sha256_file")
    folder = models.resolve_model(str(gguf_file))
    digest = sha256(gguf_file)
    assert folder == models_dir() / f"gguf-{digest}"
    assert len(conversions) == 1 and len(hashes) == 1
    # the same weights as written (bf16), in Llama's own q/k order
    from safetensors.torch import load_file

    saved = load_file(folder / "model.safetensors")
    for name, tensor in tiny_gguf[1].items():
        assert torch.equal(saved[name], tensor.to(torch.bfloat16)), name
    tokenizer = models.load_tokenizer(folder)
    assert tokenizer.eos_token == "</s>" and "</s>" in tokenizer.chat_template
    assert len(tokenizer("the travel budget").input_ids) == 3  # merges kept: one token a word
    info = json.loads((folder / models.MODEL_INFO).read_text())
    assert info["gguf_sha256"] == digest and info["architecture"] == "llama"
    assert models.fingerprint(folder)["name"] == gguf_file.name

    # used again, from another path and under another name: neither hashed nor converted
    assert models.resolve_model(str(gguf_file)) == folder
    assert len(conversions) == 1 and len(hashes) == 1
    other = Path(shutil.copy(gguf_file, gguf_file.parent / "renamed.gguf"))
    assert models.resolve_model(str(other)) == folder
    assert len(conversions) == 1 and len(hashes) == 2  # a new path is hashed, once
    os.utime(gguf_file, ns=(1, 1))  # a changed mtime: hashed again, same content, same folder
    assert models.resolve_model(str(gguf_file)) == folder
    assert len(conversions) == 1 and len(hashes) == 3
    assert converted() == [folder.name]


def test_a_gguf_is_known_by_its_magic_whatever_its_name(gguf_file):
    blob = gguf_file.rename(gguf_file.parent / "weights.bin")
    folder = models.resolve_model(str(blob))
    assert (folder / "config.json").is_file() and converted() == [folder.name]


def test_other_content_is_another_model(tiny_gguf, tmp_path):
    other = tmp_path / "other.gguf"
    write_gguf(other, seed=1)
    first, second = models.resolve_model(str(tiny_gguf[0])), models.resolve_model(str(other))
    assert first != second and len(converted()) == 2
    assert models.fingerprint(first)["digest"] != models.fingerprint(second)["digest"]


def test_a_failed_conversion_leaves_nothing_that_is_used(gguf_file, monkeypatch):
    real = ggufs.convert_gguf

    def crash(gguf_dir, gguf_file, out):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half a model
        raise OSError("killed mid-write")

    monkeypatch.setattr(ggufs, "convert_gguf", crash)
    with pytest.raises(OSError, match="killed"):
        models.resolve_model(str(gguf_file))
    root = models_dir()
    assert sorted(p.name for p in root.iterdir()) == [ggufs.DIGESTS]  # no staging, no half
    monkeypatch.setattr(ggufs, "convert_gguf", real)
    folder = models.resolve_model(str(gguf_file))
    assert json.loads((folder / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]


def test_a_concurrent_converter_wins(gguf_file, monkeypatch):
    final = models_dir() / f"gguf-{sha256(gguf_file)}"

    def convert(gguf_dir, gguf_file, out):
        for folder in (final, out):  # another process finishes first, then this one does
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(
                {"architectures": ["LlamaForCausalLM"], "by": folder.name}))

    monkeypatch.setattr(ggufs, "convert_gguf", convert)
    assert models.resolve_model(str(gguf_file)) == final
    assert json.loads((final / "config.json").read_text())["by"] == final.name
    assert sorted(p.name for p in models_dir().iterdir()) == [ggufs.DIGESTS, final.name]


def test_an_unsupported_architecture_is_named(tmp_path, monkeypatch):
    conversions = count_calls(monkeypatch, ggufs, "convert_gguf")
    path = tmp_path / "gemma.gguf"
    write_gguf(path, arch="gemma2")
    with pytest.raises(StarqaError, match="gemma.gguf is a gemma2 model") as info:
        models.resolve_model(str(path))
    assert "llama, mistral, qwen2" in str(info.value)
    assert "--model smollm2-135m" in info.value.hint
    assert conversions == [] and converted() == []


def test_scaled_rope_is_refused_after_conversion(gguf_file, monkeypatch):
    def convert(gguf_dir, gguf_file, out):
        out.mkdir()
        (out / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3"}}))

    monkeypatch.setattr(ggufs, "convert_gguf", convert)
    with pytest.raises(StarqaError, match="llama3 RoPE scaling"):
        models.resolve_model(str(gguf_file))
    assert converted() == []


def test_a_missing_or_false_gguf(tmp_path):
    with pytest.raises(StarqaError, match="No GGUF file at") as info:
        models.resolve_model(str(tmp_path / "nowhere.gguf"))
    assert "ls " in info.value.hint
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(StarqaError, match="not a GGUF file"):
        models.resolve_model(str(fake))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(StarqaError, match="Cannot read the GGUF header"):
        models.resolve_model(str(truncated))
    assert converted() == []


# ---------------------------------------------------------------------------- ollama's store


@pytest.mark.parametrize(("spec", "name", "tags"), [
    ("ollama:tiny", "tiny", ("latest",)),
    ("ollama:tiny:q4", "tiny", ("latest", "q4")),
    ("ollama:someone/tiny:q4", "someone/tiny", ("q4",)),
])
def test_an_ollama_model_is_its_gguf_blob(gguf_file, tmp_path, spec, name, tags):
    digest = make_store(tmp_path / "ollama", gguf_file, name, tags)
    folder = models.resolve_model(spec)
    assert folder == models_dir() / f"gguf-{digest}"
    expected = spec.removeprefix("ollama:") + ("" if ":" in spec[7:] else ":latest")
    assert models.fingerprint(folder)["name"] == f"ollama:{expected}"
    assert models.resolve_model(str(gguf_file)) == folder  # the same GGUF: the same model


def test_ollama_store_missing(tmp_path):
    with pytest.raises(StarqaError, match="No ollama model store at .*ollama") as info:
        models.resolve_model("ollama:llama3.2")
    assert "`ollama pull llama3.2:latest`" in info.value.hint
    assert "OLLAMA_MODELS" in str(info.value) + info.value.hint


def test_ollama_home_store_when_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert ollama.store() == tmp_path / "user" / ".ollama" / "models"


def test_ollama_model_missing_lists_the_store(gguf_file, tmp_path):
    make_store(tmp_path / "ollama", gguf_file, "tiny", ("latest", "q4"))
    make_store(tmp_path / "ollama", gguf_file, "someone/other", ("v1",))
    with pytest.raises(StarqaError, match="has no model llama3.2") as info:
        models.resolve_model("ollama:llama3.2:1b")
    assert info.value.hint.startswith("`ollama pull llama3.2:1b`")
    assert ("or one the store has: --model ollama:someone/other:v1, --model ollama:tiny:latest, "
            "--model ollama:tiny:q4") in info.value.hint


def test_ollama_tag_missing_lists_the_tags(gguf_file, tmp_path):
    make_store(tmp_path / "ollama", gguf_file, "tiny", ("q4", "q8"))
    with pytest.raises(StarqaError, match="has tiny but not tiny:latest") as info:
        models.resolve_model("ollama:tiny")
    assert "--model ollama:tiny:q4 or --model ollama:tiny:q8" in info.value.hint
    assert "`ollama pull tiny:latest`" in info.value.hint


def test_ollama_blob_that_does_not_match_its_name(gguf_file, tmp_path):
    digest = make_store(tmp_path / "ollama", gguf_file, "tiny")
    blob = tmp_path / "ollama" / "blobs" / f"sha256-{digest}"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(data)
    with pytest.raises(StarqaError, match="does not match its name") as info:
        models.resolve_model("ollama:tiny")
    assert digest in str(info.value) and hashlib.sha256(data).hexdigest() in str(info.value)
    assert "`ollama rm tiny:latest && ollama pull tiny:latest`" in info.value.hint
    assert converted() == []


def test_ollama_blob_missing_or_manifest_without_a_model(gguf_file, tmp_path):
    digest = make_store(tmp_path / "ollama", gguf_file, "tiny")
    (tmp_path / "ollama" / "blobs" / f"sha256-{digest}").unlink()
    with pytest.raises(StarqaError, match="is missing from the store") as info:
        models.resolve_model("ollama:tiny")
    assert "ollama pull tiny:latest" in info.value.hint
    manifest = tmp_path / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "tiny"
    (manifest / "latest").write_text(json.dumps({"layers": []}))
    with pytest.raises(StarqaError, match="names no GGUF layer"):
        models.resolve_model("ollama:tiny")


def test_ollama_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, arch="gemma2")
    make_store(tmp_path / "ollama", path, "gemma2", ("2b",))
    with pytest.raises(StarqaError, match="ollama:gemma2:2b is a gemma2 model; .*Llama"):
        models.resolve_model("ollama:gemma2:2b")


@pytest.mark.parametrize("spec", ["ollama:", "ollama:a/b/c/d", "ollama:../x", "ollama:x:.."])
def test_ollama_names_that_are_not_names(spec):
    with pytest.raises(StarqaError, match="is not an ollama model name"):
        models.resolve_model(spec)


# ---------------------------------------------------------------------------- end to end


def ingest_and_ask(home: Path, docs: Path, spec: str, said: str = "Ingested docs") -> dict:
    """`starqa ingest` with `--model spec` (its report says `said`), then `starqa ask` with
    that `--model` and without."""
    ingested = starqa("ingest", str(docs), "--model", spec, "--dtype", "fp32", "--workers", "1",
                      "--block-size", "50", home=home)
    assert ingested.returncode == 0 and said in ingested.stderr, ingested.stderr
    answers = []
    for extra in (("--model", spec), ()):
        asked = starqa("ask", QUESTION, "--json", "--max-new-tokens", "4", *extra, home=home)
        assert asked.returncode == 0, asked.stderr
        answers.append(json.loads(asked.stdout))
    assert answers[0]["answer"] == answers[1]["answer"]
    assert answers[0]["context"] == "docs" and 0 < answers[0]["tokens"]["answer"] <= 4
    return answers[0]


@pytest.mark.slow
def test_ingest_and_ask_with_a_gguf_file(home, docs, gguf_file):
    first = ingest_and_ask(home, docs, str(gguf_file))
    folder = models_dir() / converted()[0]
    made = (folder / "config.json").stat().st_mtime_ns
    manifest = json.loads(next((home / "contexts").glob("*/manifest.json")).read_text())
    assert manifest["model"]["path"] == str(folder)
    assert manifest["model"]["name"] == gguf_file.name
    # the same GGUF elsewhere: the same model, its context a cache hit, nothing converted
    copy = Path(shutil.copy(gguf_file, gguf_file.parent / "copy.gguf"))
    again = ingest_and_ask(home, docs, str(copy), said="Cache hit: docs")
    assert again["answer"] == first["answer"]
    assert converted() == [folder.name] and (folder / "config.json").stat().st_mtime_ns == made


@pytest.mark.slow
def test_ingest_and_ask_with_an_ollama_model(home, docs, gguf_file, tmp_path):
    digest = make_store(tmp_path / "ollama", gguf_file, "tiny", ("q4",))
    ingest_and_ask(home, docs, "ollama:tiny:q4")
    assert converted() == [f"gguf-{digest}"]


@pytest.mark.slow
def test_a_relative_gguf_is_recorded_whole_and_converted_again_once_deleted(
        home, docs, gguf_file, tmp_path, monkeypatch):
    monkeypatch.chdir(gguf_file.parent)
    ingested = starqa("ingest", str(docs), "--model", f"./{gguf_file.name}", "--dtype", "fp32",
                      "--workers", "1", "--block-size", "50", home=home)
    assert ingested.returncode == 0, ingested.stderr
    manifest = json.loads(next((home / "contexts").glob("*/manifest.json")).read_text())
    assert manifest["model"]["spec"] == str(gguf_file.resolve())
    [folder] = converted()
    shutil.rmtree(models_dir() / folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the relative path would name nothing here
    asked = starqa("ask", QUESTION, "--json", "--max-new-tokens", "4", home=home)
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["context"] == "docs" and converted() == [folder]
