"""An interrupted ingest resumes: the blocks Phase 1 finished before Ctrl-C (or before its
process died) are kept in the block store, and the same command encodes only the rest,
committing a context equal, byte for byte, to one encoded without a stop. Tiny random Llama
in fp32, blocks encoded in this process."""

import os
import shutil
import subprocess

import pytest

from starqa import engine
from starqa.cache import store
from starqa.core import paths
from starqa.core.progress import UI


def _ingest(docs, model, ui=UI(), method="star"):
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                              dtype="fp32", method=method, block_size=40,
                                              encode_in="process"), ui)


class _StopAfter(UI):
    """Ctrl-C once `blocks` blocks are encoded; what the ingest said meanwhile."""

    def __init__(self, blocks: int):
        self.left, self.notes = blocks, []

    def advance(self, tokens: int) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt

    def note(self, message: str) -> None:
        self.notes.append(message)


def _shards(manifest) -> list[tuple[dict, dict]]:
    """Each block file's metadata and each tensor's bytes: bit for bit what it holds (the
    header's JSON may list the metadata in any order)."""
    from safetensors import safe_open

    found = []
    for block in manifest.blocks:
        with safe_open(manifest.folder / block.file, "pt") as fh:
            found.append((fh.metadata(), {name: fh.get_tensor(name).numpy().tobytes()
                                          for name in fh.keys()}))
    return found


@pytest.fixture
def uninterrupted(tmp_path_factory, docs, tiny_model, monkeypatch):
    """The shards of the same ingest run to its end, in a home of its own."""
    with monkeypatch.context() as patch:
        patch.setenv("STARQA_HOME", str(tmp_path_factory.mktemp("reference")))
        return _shards(_ingest(docs, tiny_model).manifest)


@pytest.mark.parametrize("method", ["star", "dense"])
def test_an_interrupted_ingest_resumes_bit_for_bit(home, docs, tiny_model, uninterrupted,
                                                   method, monkeypatch):
    if method == "dense":  # its reference is dense's own
        with monkeypatch.context() as patch:
            patch.setenv("STARQA_HOME", str(home.parent / "dense-reference"))
            uninterrupted = _shards(_ingest(docs, tiny_model, method="dense").manifest)
    stop = _StopAfter(2)
    with pytest.raises(KeyboardInterrupt):
        _ingest(docs, tiny_model, stop, method)
    assert stop.notes and "Kept the 2 blocks encoded before the interruption" in stop.notes[0]
    assert "the same command resumes from them" in stop.notes[0]
    assert store.list_contexts(paths.contexts_dir()) == []  # nothing half-committed
    resumed = _ingest(docs, tiny_model, method=method)
    assert resumed.reuse is not None and resumed.reuse.reused == 2
    assert len(resumed.manifest.blocks) > 2
    assert _shards(resumed.manifest) == uninterrupted


def test_a_crashed_ingest_leaves_blocks_the_next_one_takes(home, docs, tiny_model,
                                                           uninterrupted, monkeypatch):
    """A process killed mid-ingest cannot keep its blocks itself: its staging folder stays,
    named for a process that is gone, and the next ingest of the same inputs takes the
    finished blocks from it (and removes it)."""
    from starqa.launchers.ingest import steps

    with monkeypatch.context() as killed:  # as a kill leaves it: nothing kept, nothing removed
        killed.setattr(steps, "_keep_finished", lambda plan, ui: None)
        killed.setattr(steps.shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(KeyboardInterrupt):
            _ingest(docs, tiny_model, _StopAfter(3))
    root = paths.contexts_dir()
    [left] = root.glob(".staging-*")
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = left.with_name(left.name.rsplit(".", 1)[0] + f".{dead.pid}")
    os.rename(left, crashed)
    resumed = _ingest(docs, tiny_model)
    assert resumed.reuse is not None and resumed.reuse.reused == 3
    assert _shards(resumed.manifest) == uninterrupted
    assert not crashed.exists()


def test_a_running_ingests_staging_is_never_taken(home, docs, tiny_model):
    """A staging folder whose process runs (another ingest of the same inputs, right now) is
    not a crash's: nothing is taken from it."""
    root = paths.contexts_dir()
    root.mkdir(parents=True)
    busy = root / f".staging-{'0' * 16}-{store.HOST}.{os.getpid()}"
    busy.mkdir()
    assert store.stale_staging(root, "0" * 16) == []
    shutil.rmtree(busy)
