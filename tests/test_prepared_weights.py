"""Phase 2's prepared weights are built as `ingest` ends, not by the first `ask` (issue 48,
item 3): after an ingest the file is there and current, the first ask maps it (the builder
is never called), and an ingest that fails or is interrupted leaves no half-made file that
a later ask would use. Two processes that find none build it once.

On a tiny random Llama of its own per test (prepared files live beside the model), with
$STARQA_WEIGHTS=int4: the tiny model is no embedded model, so its default format is dense.
"""

import threading
import time
from pathlib import Path

import pytest
import torch

from fakes import QUESTION
from starqa import engine
from starqa.core import tensorfile
from starqa.core.progress import UI
from starqa.launchers.ingest import flow
from starqa.models import decoder_io as decoder_mod
from starqa.models.prepared import prepared_file
from tiny import make_tiny_model


class StatusUI(UI):
    """The progress statuses an ingest showed, in order."""

    def __init__(self):
        self.statuses: list[str] = []

    def status(self, message: str):
        self.statuses.append(message)
        return super().status(message)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A fresh tiny model (no prepared file yet); the first ask's default format int4."""
    monkeypatch.setenv("STARQA_WEIGHTS", "int4")
    return make_tiny_model(tmp_path / "models" / "tiny")


def prepared(model: Path) -> Path:
    return prepared_file(model, "int4", "bfloat16")


def leftovers(model: Path) -> list[str]:
    """Staging files of a prepared file in the model's folder."""
    return sorted(p.name for p in model.glob(".starqa-phase2-*.tmp"))


def ingest(docs, model, ui=UI()):
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                              dtype="bf16", device="cpu",
                                              encode_in="process"), ui)


def first_ask() -> engine.Answer:
    """The ask `starqa ask QUESTION` runs here (the CLI reads $STARQA_WEIGHTS into
    --weights; the engine takes it as given), in this process."""
    return engine.ask(engine.AskOptions(QUESTION, max_new_tokens=3, keepalive=0, workers=1,
                                        device="cpu", weights="int4"))


def never(*args, **kwargs):
    raise AssertionError("the prepared weights were built again")


def test_ingest_prepares_and_the_first_ask_only_maps(home, docs, tiny, monkeypatch, tmp_path):
    ui = StatusUI()
    result = ingest(docs, tiny, ui)
    file = prepared(tiny)
    assert file.is_file() and not leftovers(tiny)
    stamp = tensorfile.header(file)[1]["__metadata__"]
    assert stamp["int4"] in ("tiles", "torch") and stamp["torch"] == torch.__version__
    assert any(s.startswith("Preparing int4 weights") for s in ui.statuses), ui.statuses
    assert 0 < result.prepare_seconds <= result.seconds  # ingest's time counts it

    monkeypatch.setattr(decoder_mod, "_build", never)
    answer = first_ask()
    assert answer.weights == "int4" and answer.token_ids

    # a second ingest with the model (another corpus) finds the file: nothing built, no status
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("the office approved the leave policy . " * 4)
    ui = StatusUI()
    again = ingest(other, tiny, ui)
    assert not any(s.startswith("Preparing") for s in ui.statuses)
    assert again.prepare_seconds < result.prepare_seconds + 1


def test_dense_by_default_prepares_nothing(home, docs, tiny, monkeypatch):
    """A model whose first ask runs dense weights (any model but the embedded ones) gets no
    file: there is nothing to prepare."""
    monkeypatch.delenv("STARQA_WEIGHTS")
    result = ingest(docs, tiny)
    assert result.prepare_seconds == 0
    assert not list(tiny.glob(".starqa-phase2-*"))


def test_a_failed_ingest_prepares_nothing(home, docs, tiny, monkeypatch):
    class Broken(Exception):
        pass

    def fail(*args, **kwargs):
        raise Broken()

    monkeypatch.setattr(flow, "run_phase1", fail)
    with pytest.raises(Broken):
        ingest(docs, tiny)
    assert not list(tiny.glob(".starqa-phase2-*"))


def test_an_interrupted_build_leaves_no_file_an_ask_would_use(home, docs, tiny, monkeypatch):
    """Interrupted half way through writing: no prepared file, no staging file; a crash's
    staging file (killed, no clean-up) is never read and the next build removes it; the
    first ask then builds the file itself and answers."""
    real = tensorfile.save_aligned

    def half_then_interrupted(tensors, path, metadata):
        real(tensors, path, metadata)
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(tensorfile, "save_aligned", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ingest(docs, tiny)
    assert not prepared(tiny).exists() and not leftovers(tiny)

    crashed = prepared(tiny).with_name(f"{prepared(tiny).stem}.crashed.tmp")
    crashed.write_bytes(b"half a file")
    monkeypatch.setattr(tensorfile, "save_aligned", real)
    answer = first_ask()
    assert answer.weights == "int4" and answer.token_ids
    assert prepared(tiny).is_file() and not leftovers(tiny)


def test_two_builders_at_once_build_once(tiny, monkeypatch):
    """Two processes (here threads, each with its own lock file handle) that find no file:
    one builds while the other waits, then maps what the first wrote."""
    real, calls = decoder_mod._build, []

    def slow(*args, **kwargs):
        calls.append(threading.get_ident())
        time.sleep(0.3)  # the other one arrives while this one builds
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder_mod, "_build", slow)
    built: list[bool] = []
    threads = [threading.Thread(target=lambda: built.append(
        decoder_mod.prepare_weights(tiny, torch.bfloat16, "int4"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and sorted(built) == [False, True]
    monkeypatch.setattr(decoder_mod, "_build", never)
    decoder = decoder_mod.load_decoder(tiny, torch.bfloat16, "int4")
    assert decoder.weights == "int4"
