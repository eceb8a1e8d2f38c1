"""Integration on the embedded SmolLM2-135M-Instruct (fetched and converted once). Blocks
are encoded in this process (the same blocks a torchrun group writes); the tests that only
ask about samples/ share one ingest of it (`samples_home`)."""

import pytest
import torch

from fakes import install_home, starqa
from starqa import corpus, engine, models
from starqa.native import ops as native
from starqa.reingest import packorder
from starqa.corpus import prompt
from starqa.models import load_model, load_tokenizer
from starqa.core.paths import contexts_dir

pytestmark = pytest.mark.model
QUESTION = "Who approved the 2026 travel budget?"


@pytest.fixture(scope="module")
def samples_ingested(tmp_path_factory, embedded_model, pytestconfig):
    """A $STARQA_HOME holding samples/ as `starqa ingest samples` leaves it (star, the
    default dtype), made once for the module."""
    home = tmp_path_factory.mktemp("samples") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STARQA_HOME", str(home))
        patch.delenv("STARQA_MODEL", raising=False)
        engine.ingest(engine.IngestOptions(paths=(str(pytestconfig.rootpath / "samples"),),
                                           model=str(embedded_model), encode_in="process"))
    return home


@pytest.fixture
def samples_home(home, samples_ingested):
    """This test's home holding a copy of `samples_ingested`."""
    install_home(samples_ingested, home)
    return home


@pytest.mark.slow
def test_dense_two_workers_equal_one_transformers_generate(embedded_model, home, request):
    """dense ingest (fp32) + 2-worker Phase 2 = greedy generate over the whole prompt."""
    samples = request.config.rootpath / "samples"
    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(samples),), model=str(embedded_model), method="dense", dtype="fp32",
        block_size=1024, encode_in="process")).manifest
    assert len(manifest.blocks) >= 4
    answer = engine.ask(engine.AskOptions(QUESTION, workers=2, max_new_tokens=12))

    tok = load_tokenizer(embedded_model)
    packed, spans = corpus.pack(packorder.as_packed(corpus.collect([samples]).files, manifest))
    context_ids = prompt.tokenize_context(tok, packed, spans).ids
    ids = context_ids + prompt.tokenize_query(tok, QUESTION)
    model = load_model(embedded_model, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    reference = [t for t in out[0, len(ids):].tolist()]
    stop = models.stop_ids(tok, embedded_model)
    reference = reference[:next((i for i, t in enumerate(reference) if t in stop), len(reference))]
    assert list(answer.token_ids) == reference
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


@pytest.mark.slow
def test_needle_file_is_the_top_source(samples_home, request):
    """The answer's attention mass, traced through the manifest, points at the file that
    holds the needle."""
    samples = request.config.rootpath / "samples"
    answer = engine.ask(engine.AskOptions(QUESTION, workers=2, max_new_tokens=24))
    assert "Quintanilla" in answer.text
    assert answer.sources[0].path == "handbook/travel-policy.md", answer.sources
    first, last = answer.sources[0].lines
    budget_line = next(i for i, line in enumerate(
        (samples / "handbook/travel-policy.md").read_text().splitlines(), 1)
        if "Quintanilla" in line)
    assert first <= budget_line + 2 and last >= budget_line - 2, (first, last, budget_line)


def _meeting_notes(week: int) -> str:
    """Notes of one weekly meeting: every week the same template, names and topics in a
    different order, so the files differ only in details."""
    people = ["Anja", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro"]
    topics = ["the Q3 roadmap", "hiring for the data team", "the office move",
              "the vendor review", "the customer survey", "the security audit",
              "the release schedule", "the budget forecast"]
    lines = [f"# Weekly meeting notes, week {week}", "",
             f"Attendees: {', '.join(people[week % 8:] + people[:week % 8])}", ""]
    for j in range(14):
        lines.append(f"- {people[(3 * j + week) % 8]} gave an update on "
                     f"{topics[(5 * j + 2 * week) % 8]}; follow-up items were assigned and "
                     "will be reviewed next week.")
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_needles_file_is_the_top_source_among_near_identical_files(embedded_model, home,
                                                                    tmp_path):
    """Six near-identical files of meeting notes, one fact in the third: attention that
    every file's template receives alike must not outweigh the one the answer copied."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for week in range(1, 7):
        text = _meeting_notes(week)
        if week == 3:
            lines = text.splitlines()
            lines.insert(9, "- The secret launch code of project Heliotrope is 4721-XQ-88.")
            text = "\n".join(lines) + "\n"
        (notes / f"notes_{week:02d}.md").write_text(text)
    engine.ingest(engine.IngestOptions(paths=(str(notes),), model=str(embedded_model),
                                       encode_in="process"))
    answer = engine.ask(engine.AskOptions("What is the secret launch code of project "
                                          "Heliotrope?", workers=1, max_new_tokens=32))
    assert "4721" in answer.text, answer.text
    assert answer.sources[0].path == "notes_03.md", answer.sources
    first, last = answer.sources[0].lines
    assert first - 2 <= 10 <= last + 2, (first, last)


@pytest.mark.slow
@pytest.mark.skipif(not native.int4_fast(), reason="no AVX-512 VNNI here: no first token "
                    "before torch (int4 weights keep torch's layout)")
def test_cold_ask_answers_its_first_token_before_torch(samples_home):
    """`starqa ask` as a user runs it, cold: the head start answers the first token before
    importing torch (starqa.coldstart.firsttoken), and the answer, its tokens and sources are those
    of the same ask without that path (STARQA_FIRST_TOKEN=0)."""
    import json

    def ask(**env):
        done = starqa("ask", QUESTION, "--json", "--max-new-tokens", "16", "--keep-alive", "0",
                      "--weights", "int4",  # (the default for the embedded model, by name)
                      env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    first = ask()  # prepares the int4 weights where they are not yet (the torch path)
    early, late = ask(), ask(STARQA_FIRST_TOKEN="0")
    assert early["timings"]["first_token_before_torch"] is True
    assert late["timings"]["first_token_before_torch"] is False
    assert "Quintanilla" in early["answer"]
    for field in ("answer", "tokens", "sources"):
        assert early[field] == late[field] == first[field]
