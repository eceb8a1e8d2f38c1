"""The model and device a run takes: the default dtype is chosen for the device ingest runs
on; `--device cuda` without a GPU names the fix; a context asked with another model than it
was made with (another embedded model, a local folder since deleted) is refused before
anything is fetched, naming the model to ask with."""

import shutil
import time
from dataclasses import replace

import pytest
import torch
from fakes import make_context

from starqa import engine
from starqa.core.errors import StarqaError


def test_ingest_on_a_gpu_without_bf16_encodes_in_fp16(home, docs, tiny_model, fake_workers,
                                                       monkeypatch):
    """The default dtype is chosen for the device ingest runs on (`auto`: the GPU torch
    sees), so a GPU without bf16 gets fp16; it was chosen for the CPU, so such GPUs got bf16."""
    def ingest(**kw):
        return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model),
                                                  block_size=60, workers=1, **kw)).manifest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    gpu = ingest()
    assert fake_workers[0]["dtype"] == gpu.dtype == "float16"
    cpu = ingest(device="cpu")
    assert fake_workers[1]["dtype"] == cpu.dtype == "bfloat16" and cpu.key != gpu.key


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_names_the_cpu_fix(home, docs, tiny_model):
    """`--device cuda` where torch sees no GPU: a clear error before any worker starts."""
    from starqa.runtime.launch import check_gpus

    with pytest.raises(StarqaError, match="no CUDA GPU") as err:
        check_gpus("cuda", 2)
    assert "--device cpu" in err.value.hint
    check_gpus("auto", 2)  # auto falls back to the CPU quietly
    check_gpus("cpu", 2)


def test_asking_with_another_embedded_model_fails_before_fetching_it(home, monkeypatch):
    """A context made with one embedded model, asked with another: the error comes from the
    manifest's recorded model name, before the other model is downloaded and converted."""
    from starqa.cache import manifest as manifest_mod
    from starqa.models import resolve

    folder = make_context(home, "notes", "k" * 16, time.time())
    recorded = manifest_mod.read_manifest(folder)
    made = replace(recorded, model=replace(recorded.model, spec="smollm2-135m", name="smollm2-135m"))
    manifest_mod.write_manifest(folder, made)

    def no_download(model):
        raise AssertionError(f"{model.name} was fetched")

    monkeypatch.setattr(resolve, "ensure_embedded", no_download)
    with pytest.raises(StarqaError, match="ingested with smollm2-135m; --model asks for "
                                          "qwen2.5-coder-1.5b") as err:
        engine.manifest_model(manifest_mod.read_manifest(folder), "qwen2.5-coder-1.5b")
    assert "--model smollm2-135m" in err.value.hint


@pytest.mark.slow
def test_a_deleted_local_model_is_named_as_such(home, docs, tmp_path):
    """The local model folder a context was made with, deleted: the error says that folder
    is gone and how to go on, instead of 'Model not found'."""
    from tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "gone-model")
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                       workers=1))
    shutil.rmtree(model)
    with pytest.raises(StarqaError, match="ingested with the model at .*gone-model, which is "
                                          "no longer there") as err:
        engine.ask(engine.AskOptions(question="who", max_new_tokens=2))
    assert "--model PATH" in err.value.hint
