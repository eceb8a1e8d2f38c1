"""Integration on the embedded SmolLM2-135M-Instruct (fetched and converted once)."""

import pytest
import torch

from starqa import corpus, engine, models, prompt
from starqa.models import load_model, load_tokenizer
from starqa.paths import contexts_dir

pytestmark = pytest.mark.model
QUESTION = "Who approved the 2026 travel budget?"


def test_dense_two_workers_equal_one_transformers_generate(embedded_model, home, request):
    """dense ingest (fp32) + 2-worker Phase 2 = greedy generate over the whole prompt."""
    samples = request.config.rootpath / "samples"
    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(samples),), model=str(embedded_model), method="dense", dtype="fp32",
        block_size=1024)).manifest
    assert len(manifest.blocks) >= 4
    answer = engine.ask(engine.AskOptions(QUESTION, workers=2, max_new_tokens=12))

    tok = load_tokenizer(embedded_model)
    packed, spans = corpus.pack(corpus.collect([samples]).files)
    context_ids = prompt.tokenize_context(tok, packed, spans).ids
    ids = context_ids + prompt.tokenize_query(tok, QUESTION)
    model = load_model(embedded_model, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    reference = [t for t in out[0, len(ids):].tolist()]
    stop = models.stop_ids(tok, embedded_model)
    reference = reference[:next((i for i, t in enumerate(reference) if t in stop), len(reference))]
    assert answer.token_ids == reference
    assert len(reference) > 3


def test_samples_ingest_excludes_the_answer_key(embedded_model, home, request):
    samples = request.config.rootpath / "samples"
    files = {f.path for f in corpus.collect([samples]).files}
    assert "questions.jsonl" not in files and "handbook/travel-policy.md" in files
    tok = load_tokenizer(embedded_model)
    packed, spans = corpus.pack(corpus.collect([samples]).files)
    ids = prompt.tokenize_context(tok, packed, spans).ids
    assert len(ids) < 8192 - 512  # the samples fit the window with room for Q&A
    assert not contexts_dir().exists()


def test_needle_file_is_the_top_source(embedded_model, home, request):
    """The answer's attention mass, traced through the manifest, points at the file that
    holds the needle."""
    samples = request.config.rootpath / "samples"
    engine.ingest(engine.IngestOptions(paths=(str(samples),), model=str(embedded_model),
                                       workers=2))
    answer = engine.ask(engine.AskOptions(QUESTION, workers=2, max_new_tokens=24))
    assert "Quintanilla" in answer.text
    assert answer.sources[0]["path"] == "handbook/travel-policy.md", answer.sources
    first, last = answer.sources[0]["lines"]
    budget_line = next(i for i, line in enumerate(
        (samples / "handbook/travel-policy.md").read_text().splitlines(), 1)
        if "Quintanilla" in line)
    assert first <= budget_line + 2 and last >= budget_line - 2, (first, last, budget_line)
