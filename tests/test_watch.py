"""`starqa ingest --watch` (issue #14): a debounced incremental re-ingest after edits to
what ingest reads, never after edits to ignored files; a clean stop; and a warm group
handed over to the new version. Tiny random Llama in fp32, blocks encoded in process."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from starqa.workers import client
from starqa import engine
from starqa.core import paths
from starqa.cache import shards, store
from starqa.cli import app
from starqa.corpus.watch import Selection

@pytest.fixture
def repo(repo):
    """`conftest.repo`'s nine files (about ten blocks of 40), and files that ingest leaves
    out: one by .starqaignore, one by .gitignore, one by --exclude, one hidden."""
    folder = repo
    (folder / ".starqaignore").write_text("skip.md\n")
    (folder / ".gitignore").write_text("build/\n")
    (folder / "skip.md").write_text("the star")
    (folder / "build").mkdir()
    (folder / "build" / "out.md").write_text("the star")
    (folder / "notes.log").write_text("the star")
    (folder / ".hidden.md").write_text("the star")
    return folder


def test_selection_counts_only_what_ingest_reads(repo):
    selection = Selection((str(repo),), (), ("*.log",)).refreshed()
    assert {os.path.basename(p) for p in selection.files} == {f"f{i}.md" for i in range(9)}
    for ignored in ("skip.md", "build/out.md", "notes.log", ".hidden.md"):
        assert not selection.touched([str(repo / ignored)]), ignored
    assert selection.touched([str(repo / "f3.md")])
    (repo / "new.md").write_text("the answer")  # an added file the rules take
    assert selection.touched([str(repo / "new.md")])
    assert selection.touched([str(repo / ".starqaignore")])  # the rules themselves changed


class Watcher:
    """`starqa ingest --watch` as a subprocess, its stderr lines read as they come."""

    def __init__(self, repo, model, home):
        env = {**os.environ, "STARQA_HOME": str(home), "PYTHONUNBUFFERED": "1",
               "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "starqa", "ingest", str(repo), "--model", str(model),
             "--dtype", "fp32", "--block-size", "40", "--encode-in", "process",
             "--exclude", "*.log", "--reserve", "64", "--watch"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, text, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.seen)
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} in {''.join(self.seen)}")

    def rest(self) -> str:
        """Everything it printed, once it has exited."""
        self.reader.join(timeout=30)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)

    def quiet_for(self, seconds):
        """The lines printed in the next `seconds`."""
        got = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                got.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                pass
        self.seen += got
        return got


@pytest.mark.slow
def test_watch_reingests_after_an_edit_and_stops_cleanly(home, repo, tiny_model):
    watcher = Watcher(repo, tiny_model, home)
    try:
        watcher.wait_for("Watching")
        old = store.find_context(paths.contexts_dir(), "repo")
        (repo / "skip.md").write_text("the star the answer")  # ignored: no work
        (repo / "build" / "out.md").write_text("the answer")
        (repo / "notes.log").write_text("the answer")
        assert not [line for line in watcher.quiet_for(3.0) if "ingest" in line.lower()]
        with open(repo / "f6.md", "a") as fh:
            fh.write(" the answer")
        line = watcher.wait_for("Re-ingested repo")
        assert "f6.md changed" in line and "reused" in line
    finally:
        watcher.proc.send_signal(signal.SIGTERM)
        rc = watcher.proc.wait(timeout=60)
    rest = watcher.rest()
    assert rc == 0 and "Stopped watching" in rest and "Traceback" not in rest
    new = store.find_context(paths.contexts_dir(), "repo")  # the name: the newest version
    assert new.key != old.key
    assert {f.path: f.sha256 for f in new.files}["f6.md"] != \
        {f.path: f.sha256 for f in old.files}["f6.md"]
    assert not list(paths.contexts_dir().glob(".staging*"))  # nothing half-written
    for manifest in (new, store.find_context(paths.contexts_dir(), old.key)):
        shards.verify_checksums(manifest)  # the old version is intact too
        answer = engine.ask(engine.AskOptions(question="what is the answer",
                                              context=manifest.key, max_new_tokens=4,
                                              warm=False))
        assert answer.context.key == manifest.key and answer.token_ids


@pytest.mark.slow
def test_a_warm_group_serves_the_new_version_after_a_reingest(home, repo, tiny_model):
    args = ["ingest", str(repo), "--model", str(tiny_model), "--dtype", "fp32",
            "--block-size", "40", "--encode-in", "process", "--exclude", "*.log",
            "--reserve", "64"]
    assert CliRunner().invoke(app, args).exit_code == 0
    old = store.find_context(paths.contexts_dir(), "repo")
    group = client.start(old.key, 1, keepalive=120)
    try:
        assert group.key == old.key
        with open(repo / "f6.md", "a") as fh:
            fh.write(" the answer")
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        new = store.find_context(paths.contexts_dir(), "repo")
        assert new.key != old.key and "restarted for the new version" in result.output
        deadline = time.monotonic() + 180
        while client.find(new.key) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.find(new.key) is not None and client.find(old.key) is None
        question = "what is the answer"
        warm = engine.ask(engine.AskOptions(question=question, context="repo",
                                            max_new_tokens=6))
        cold = engine.ask(engine.AskOptions(question=question, context=new.key,
                                            max_new_tokens=6, warm=False))
        assert warm.warm and warm.context.key == new.key
        assert warm.token_ids == cold.token_ids  # the new shards, not the old ones
    finally:
        for key in {old.key, *(g.key for g in client.running())}:
            client.stop_group(key)
