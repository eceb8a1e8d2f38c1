"""The room kept to ask: `ingest` refuses a context that leaves no room for a question and
an answer (512 tokens, a quarter of small windows), and an `ask` over the window offers only
the fixes that can work. The workers are a stand-in that says the window check let the
context through."""

import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import make_context
from typer.testing import CliRunner

from starqa import corpus, engine
from starqa.launchers.ingest import flow
from starqa.cli import app
from starqa.core.errors import StarqaError
from starqa.cache.manifest import ModelIdentity, read_manifest, write_manifest

runner = CliRunner()


class Encoded(Exception):
    """Raised by the stand-in for the workers: the window check let the context through."""


def _context_tokens(docs: Path, model: Path) -> int:
    from starqa import models
    from starqa.corpus import prompt

    packed, spans = corpus.pack(corpus.collect([docs]).files)
    return len(prompt.tokenize_context(models.load_tokenizer(model), packed, spans).ids)


def test_ingest_keeps_room_for_a_question_and_an_answer(home, tiny_model, tmp_path,
                                                        monkeypatch):
    from tiny import make_tiny_model

    docs = tmp_path / "long"
    docs.mkdir()
    (docs / "a.md").write_text("the travel budget was approved by the office . " * 250)
    n = _context_tokens(docs, tiny_model)
    assert n > 2048  # so that the reserve is the full 512, not a quarter of the window
    model = make_tiny_model(tmp_path / "w", window=n + 100)  # fits alone, not with 512 more
    monkeypatch.setattr(flow, "run_phase1", lambda *a, **k: (_ for _ in ()).throw(Encoded()))
    # dense keeps every position (star would move its blocks within the window: test_planner)
    opts = engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                method="dense")
    with pytest.raises(StarqaError) as error:
        engine.ingest(opts)
    assert f"{n:,} tokens + 512 reserved for a question and an answer = {n + 512:,} tokens > " \
           f"{n + 100:,} the model was trained on, and --method dense places positions past " \
           "it" in str(error.value)
    hint = error.value.hint
    assert "--reserve 100 or lower" in hint and "--beyond-window" in hint
    assert hint.startswith("leave --method dense out")
    assert "--model qwen2.5-coder-1.5b: 32,768 tokens" in hint
    assert hint.count("use a model with a longer window") == 1  # one fix, every such model

    with pytest.raises(Encoded):  # a smaller reserve lets it through, from the option ...
        engine.ingest(replace(opts, reserve=100))
    result = runner.invoke(app, ["ingest", str(docs), "--model", str(model),  # ... or the env
                                 "--method", "dense"],
                           env={"STARQA_RESERVE": "64"})
    assert isinstance(result.exception, Encoded), result.output


def test_small_windows_reserve_a_quarter(home, docs, tiny_model, monkeypatch):
    """The tiny model's 512-token window holds the 186-token docs with 128 reserved."""
    monkeypatch.setattr(flow, "run_phase1", lambda *a, **k: (_ for _ in ()).throw(Encoded()))
    assert engine.default_reserve(512) == 128 and engine.default_reserve(8192) == 512
    with pytest.raises(Encoded):
        engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model)))


@pytest.mark.parametrize("room", [10, 0, -5])
def test_ask_over_window_suggests_max_new_tokens_only_when_it_helps(home, tiny_model, room):
    """A context made before the reserve, `room` tokens short of holding the question and a
    64-token answer... or the question alone (room <= 0)."""
    from starqa import models
    from starqa.corpus import prompt

    question = "who approved the travel budget"
    m = len(prompt.tokenize_query(models.load_tokenizer(tiny_model), question))
    folder = make_context(home, "full", "f011" + "0" * 12, time.time())
    manifest = read_manifest(folder)
    window = manifest.n_tokens + m + room
    write_manifest(folder, replace(manifest, model=ModelIdentity.of(
        tiny_model, manifest.model.spec, window, models.fingerprint(tiny_model))))

    with pytest.raises(StarqaError, match=f"> {window:,} the model was trained on") as error:
        engine.ask(engine.AskOptions(question=question, max_new_tokens=64, warm=False))
    if room > 0:
        assert f"--max-new-tokens {room} or lower" in error.value.hint
    else:  # no answer length fits: lowering it cannot help
        assert "--max-new-tokens" not in error.value.hint
        assert "shorter question" in error.value.hint
