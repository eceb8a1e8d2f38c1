"""A run's processes under faults: the launcher (`starqa ingest`) or `starqa serve` killed
takes torchrun and its workers down with it; a run leaves nothing in the temp folder; a
worker killed or out of disk space is named as such and nothing of its run is kept."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from fakes import starqa

from starqa import engine
from starqa.core import paths
from starqa.cache import store
from starqa.core.errors import StarqaError


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process we can read in /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if state == "Z":  # exited, not yet reaped
            continue
        found[int(entry.name)] = (int(ppid), cmdline)
    return found


def _descendants(root: int) -> dict[int, str]:
    procs = _processes()
    out, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in procs.items():
            if ppid == parent and pid not in out:
                out[pid] = cmdline
                frontier.append(pid)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists() or os.uname().sysname != "Linux",
                    reason="parent-death signals are Linux's")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
@pytest.mark.torchrun
def test_killing_the_launcher_takes_torchrun_and_the_workers_down(home, docs, tiny_model, how):
    """`kill -9` of `starqa ingest` (no chance to clean up) and SIGTERM (handled as Ctrl-C):
    within a few seconds no torchrun or worker of that run is left."""
    import contextlib
    import signal
    import sys

    env = {**os.environ, "STARQA_HOME": str(home), "STARQA_SLOW": "60", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "ingest", str(docs), "--model",
                             str(tiny_model), "--dtype", "fp32", "--workers", "2"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 90
        while True:  # until both workers run (they sleep in STARQA_SLOW before encoding)
            seen = _descendants(proc.pid)
            # torchrun + 2 workers
            if sum("starqa.workers.worker" in c for c in seen.values()) >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"workers did not start: {seen}"
            time.sleep(0.3)
        time.sleep(1.0)  # past the workers' start-up
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=30)
        # With the parent-death signals they are gone in well under a second here; without
        # them they outlived the launcher by 4 s or more (until torchrun next wrote to its
        # closed pipe), and in the runs until their next block.
        deadline = time.monotonic() + 2
        while alive := {p: c for p, c in seen.items() if p in _processes()}:
            assert time.monotonic() < deadline, f"survived the launcher: {alive}"
            time.sleep(0.2)
    finally:
        for pid in list(seen) + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if how == "SIGTERM":
        assert proc.returncode == 130  # as after Ctrl-C


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists() or os.uname().sysname != "Linux",
                    reason="parent-death signals are Linux's")
def test_killing_serve_leaves_no_group_and_ps_shows_none(home, docs, tiny_model):
    """`kill -9` of `starqa serve` running a torchrun group (kept forever: --keep-alive 0):
    torchrun and both workers die with it, and `ps` lists no group afterwards."""
    import contextlib
    import signal
    import sys

    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model), dtype="fp32",
                                       block_size=60))
    env = {**os.environ, "STARQA_HOME": str(home), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "serve", "--workers", "2",
                             "--keep-alive", "0"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while not json.loads(starqa("ps", "--json", env=env).stdout):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the group did not become ready"
            time.sleep(0.5)
        seen = _descendants(proc.pid)
        assert sum("starqa.workers.worker" in c for c in seen.values()) >= 3  # torchrun + 2 workers
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 3
        while alive := {p: c for p, c in seen.items() if p in _processes()}:
            assert time.monotonic() < deadline, f"survived serve: {alive}"
            time.sleep(0.2)
        ps = starqa("ps", "--json", env=env)
        assert json.loads(ps.stdout) == []
    finally:
        for pid in list(seen) + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_run_leaves_nothing_in_the_temp_folder(home, docs, tiny_model, tmp_path, monkeypatch):
    """torchrun's `torchelastic_*` folders and the job file live in one folder per run,
    removed when the run ends (issue #11, item 4)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model), dtype="fp32",
                                       workers=2, block_size=60))
    assert list(tmp.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_says_what_happened_and_keeps_the_cache(home, docs, tiny_model, monkeypatch):
    """A worker whose writes fail for want of space: a message that says so, what was kept
    (nothing of this run; the previous cache answers) and what to do; no traceback."""
    first = engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model),
                                               dtype="fp32", workers=2, block_size=40)).manifest
    monkeypatch.setenv("STARQA_FAULT", "ingest:1:disk-full")
    with pytest.raises(StarqaError, match="Worker 1 ran out of disk space") as err:
        engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model),
                                           dtype="fp32", workers=2, block_size=40, force=True))
    assert "Nothing of this run was kept" in str(err.value)
    assert "starqa cache --clean" in err.value.hint and "Traceback" not in str(err.value)
    assert store.find_context(paths.contexts_dir(), first.key).key == first.key


def test_a_killed_worker_is_named_as_such():
    from starqa.runtime.launch import _death

    summary = ["  exitcode  : -9 (pid: 5774)", "  exitcode  : 1 (pid: 5775)"]
    assert "out-of-memory" in _death(summary, 1)
    assert _death(["  exitcode  : -15 (pid: 1)"], 1) == "killed by SIGTERM"
    assert _death([], 3) == "exit code 3"
