"""`--model SPEC+yarnN` (starqa.models.scaled): the model SPEC names with YaRN at factor N,
a folder of links beside the models, made once; a context made with it is answered by it,
as transformers' YaRN model answers."""

import json
import os

import pytest

from starqa import engine, models
from starqa.core.errors import StarqaError
from starqa.models import scaled
from starqa.models.rope import Rope

from tiny import make_tiny_model, reference_tokens

QUESTION = "who approved the travel budget"


def test_a_spec_names_its_factor():
    assert scaled.split("qwen2.5-coder-1.5b+yarn4") == ("qwen2.5-coder-1.5b", 4)
    assert scaled.split("./m+yarn/model") == ("./m+yarn/model", None)
    assert scaled.split("ollama:qwen2.5:7b+yarn2") == ("ollama:qwen2.5:7b", 2)
    for factor in (0, 1, 64):
        with pytest.raises(StarqaError, match=f"YaRN factor {factor}") as error:
            scaled.split(f"qwen2.5-coder-1.5b+yarn{factor}")
        assert error.value.hint == "--model qwen2.5-coder-1.5b+yarn4 (a window 4 times its own)"
    # the same weights: the embedded model's Phase 2 format
    assert models.phase2_weights(None, "qwen2.5-coder-1.5b+yarn4", "cpu") == \
        models.phase2_weights(None, "qwen2.5-coder-1.5b", "cpu") == "int4"


def test_the_folder_links_the_model_and_declares_yarn(home, tiny_model):
    folder = models.resolve_model(f"{tiny_model}+yarn4")
    assert folder.parent == home / "models" / "scaled"
    rope = Rope.of(folder)
    assert rope.kind == "yarn" and rope.parameters["factor"] == 4.0
    assert models.context_window(_config(folder)) == 4 * models.context_window(_config(tiny_model))
    for name in ("model.safetensors", "tokenizer.json"):
        assert os.path.samefile(folder / name, tiny_model / name)  # linked, not copied
    assert not any(f.name.startswith(".") for f in folder.iterdir())
    made = (folder / "config.json").stat().st_mtime_ns
    assert models.resolve_model(f"{tiny_model}+yarn4") == folder  # made once
    assert (folder / "config.json").stat().st_mtime_ns == made
    assert models.fingerprint(folder)["digest"] != models.fingerprint(tiny_model)["digest"]
    assert models.fingerprint(folder)["name"] == "tiny-llama+yarn4"
    assert models.recorded_spec(f"{tiny_model}+yarn4") == f"{tiny_model.resolve()}+yarn4"
    assert models.rebuildable(f"{tiny_model}+yarn4") and not models.rebuildable(str(tiny_model))


def test_a_model_that_scales_its_rope_already_is_refused(home, tmp_path):
    folder = models.resolve_model(f"{make_tiny_model(tmp_path / 'once')}+yarn2")
    with pytest.raises(StarqaError, match="declares RoPE 'yarn' already") as error:
        models.resolve_model(f"{folder}+yarn2")
    assert "leave +yarn2 out" in error.value.hint


@pytest.mark.slow
def test_a_context_made_with_yarn_is_answered_as_transformers_yarn_answers(home, docs,
                                                                           tiny_model):
    spec = f"{tiny_model}+yarn2"
    result = engine.ingest(engine.IngestOptions(paths=(str(docs),), model=spec, dtype="fp32",
                                                method="dense", encode_in="process"))
    manifest = result.manifest
    assert manifest.model.spec == f"{tiny_model.resolve()}+yarn2"
    assert manifest.model.window == 1024
    folder = models.resolve_model(spec)
    want = reference_tokens(folder, manifest, QUESTION, 8)
    assert want != reference_tokens(tiny_model, manifest, QUESTION, 8)  # YaRN changed it
    for model in (None, spec):  # the manifest's model, or the same spec named
        answer = engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8, model=model))
        assert list(answer.token_ids) == want
    with pytest.raises(StarqaError, match="does not match the model"):  # the plain model: no
        engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8, model=str(tiny_model)))


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def test_yarn_declared_keeps_the_rest_of_the_config(home, tiny_model):
    before = json.loads((tiny_model / "config.json").read_text())
    after = json.loads((models.resolve_model(f"{tiny_model}+yarn2") / "config.json").read_text())
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed <= {"rope_parameters", "rope_scaling", "max_position_embeddings"}
