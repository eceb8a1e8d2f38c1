"""A cold ask's head start (starqa.coldstart.headstart): the Phase 2 process forked as the command
starts. Driven through `python -m starqa` (the fork must happen before torch is imported,
which a pytest process has done long ago)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from starqa import engine
from starqa.coldstart import headstart
from starqa.core import paths
from starqa.cache import store
from fakes import starqa
from tiny import make_tiny_model

QUESTION = "who approved the travel budget"


@pytest.fixture
def context(docs_context):
    """`docs` as `ingest --dtype fp32 --block-size 60` leaves it (a copy of one ingest per
    session): the head start reads it, how it was encoded is not the point here."""
    return store.find_context(paths.contexts_dir(), None)


def test_wanted_only_for_an_ask_no_warm_group_answers(home, monkeypatch):
    monkeypatch.delenv("STARQA_COLD", raising=False)
    monkeypatch.delenv("STARQA_HEADSTART", raising=False)
    assert headstart._wanted(["ask", QUESTION])
    assert not headstart._wanted(["ask", QUESTION, "--help"])
    assert not headstart._wanted(["list"]) and not headstart._wanted([])
    for more in (["--workers", "2"], ["-w", "3"], ["--nnodes=2"], ["--nnodes", "2"]):
        assert not headstart._wanted(["ask", QUESTION, *more])  # torchrun answers
    assert headstart._wanted(["ask", QUESTION, "--workers", "1"])
    monkeypatch.setenv("STARQA_WORKERS", "2")
    assert not headstart._wanted(["ask", QUESTION])
    monkeypatch.delenv("STARQA_WORKERS")
    monkeypatch.setenv("STARQA_HEADSTART", "0")
    assert not headstart._wanted(["ask", QUESTION])
    monkeypatch.delenv("STARQA_HEADSTART")

    run = home / "run"
    run.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    (run / "gone.json").write_text(json.dumps({"pid": int(done.stdout)}))  # a dead launcher
    (run / "junk.json").write_text("not json")
    assert headstart._wanted(["ask", QUESTION])
    (run / "live.json").write_text(json.dumps({"pid": os.getpid()}))  # a live group
    assert not headstart._wanted(["ask", QUESTION])  # likely warm: no torch import beside it
    assert headstart._wanted(["ask", QUESTION, "--cold"])
    monkeypatch.setenv("STARQA_COLD", "1")
    assert headstart._wanted(["ask", QUESTION])


@pytest.mark.slow
def test_head_start_answers_as_the_ask_in_process(context):
    """The same answer either way; and the head start really answered: a fault injected
    into a worker's ask (which the in-process path never passes) fails it."""
    args = ("ask", QUESTION, "--json", "--max-new-tokens", "6", "--keep-alive", "0")
    forked = starqa(*args)
    assert forked.returncode == 0, forked.stderr
    here = starqa(*args, env={"STARQA_HEADSTART": "0"})
    assert here.returncode == 0, here.stderr
    a, b = json.loads(forked.stdout), json.loads(here.stdout)
    assert a["answer"] == b["answer"] and a["tokens"] == b["tokens"] and a["answer"]
    assert a["workers"] == 1 and a["sources"] == b["sources"]
    assert a["timings"]["first_token_s"] > 0

    died = starqa(*args, env={"STARQA_FAULT": "ask:0"})
    assert died.returncode == 1 and "A worker died (exit code 3)" in died.stderr
    assert "injected fault in ask on rank 0" in died.stderr  # its last lines, shown
    assert starqa(*args, env={"STARQA_FAULT": "ask:0", "STARQA_HEADSTART": "0"}).returncode == 0


@pytest.mark.slow
def test_head_start_error_is_the_workers_message(context):
    block = context.folder / context.blocks[0].file
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    proc = starqa("ask", QUESTION, "--keep-alive", "0")
    assert proc.returncode == 1
    assert "fails its checksum" in proc.stderr and "Traceback" not in proc.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _gone(pid: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):  # exited; only its parent's (or init's) wait remains
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the head start is Linux's")
@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_head_start_never_outlives_the_command(home, docs, tmp_path, how):
    model = make_tiny_model(tmp_path / "long-tiny", window=8192, never_stops=True)
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                       block_size=60))
    # Ctrl-C at its default, as in a terminal's foreground job, whatever this test inherited
    # (a runner started as `cmd &` by a shell without job control ignores SIGINT, and Python
    # keeps an inherited SIG_IGN: the ask would rightly go on answering)
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "ask", QUESTION, "--keep-alive",
                             "0", "--max-new-tokens", "7000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1)  # the answer streams: the child is answering
        children = _children(proc.pid)
        assert len(children) == 1
        if how == "SIGKILL":
            proc.kill()
        else:  # the terminal's Ctrl-C reaches the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert _gone(children[0])
        if how == "Ctrl-C":
            assert proc.returncode == 130 and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_cold_answer_reads_the_shard_where_it_lies(context):
    """On the CPU the shard is never copied: each layer's pieces are the block files'
    pages, memory-mapped (a cold ask copied 4.7K tokens' KV, 0.03 s, before its first
    token), and answering reads them in place."""
    import torch

    from starqa.runtime import dist
    from starqa.phase2.answerer import Answerer
    from starqa.cache.shards import block_file

    answerer = Answerer.from_cache(context, dist.local_world("cpu"), context.model.path)
    pieces = answerer.hook.shard[0]
    assert len(pieces) == len(context.blocks)
    maps = open("/proc/self/maps").read().splitlines()
    for (k, v), block in zip(pieces, context.blocks):
        path = str(context.folder / block_file(block.index))
        for tensor in (k, v):
            start = tensor.data_ptr()
            lines = [line for line in maps if line.endswith(path)]
            spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in lines]
            assert any(a <= start < b for a, b in spans), f"{path} is not mapped at the piece"
    before = [k.clone() for k, _ in pieces]
    tokens, _ = answerer.answer([5, 6, 7, 8], 6, set())
    assert tokens
    assert all(torch.equal(k, old) for (k, _), old in zip(pieces, before))  # never written


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the head start is Linux's")
def test_a_cold_ask_goes_on_as_the_warm_group(context):
    """Warm by default without a second start: the head start that answered a cold ask
    goes on as the context's warm group (its own session, its output in the group's log),
    listening before the command ends, so the next question, asked at once, is warm and
    nothing loads the model again; `starqa stop` ends it."""
    from starqa.workers import client

    cold = starqa("ask", QUESTION, "--keep-alive", "60", "--max-new-tokens", "4", "--json")
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["warm"] is False
    group = client.find(context.key)  # listening before the command ended: no wait
    try:
        assert group is not None, (client.run_dir() / f"{context.key}.log").read_text()
        assert group.keepalive == 60 and group.workers == 1
        # the forked ask itself, not a `starqa serve` started after it
        argv = open(f"/proc/{group.pid}/cmdline").read().split("\0")
        assert "ask" in argv and "serve" not in argv
        assert os.getsid(group.pid) == group.pid  # out of the command's session
        warm = starqa("ask", QUESTION, "--max-new-tokens", "4", "--json")
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["warm"] is True
        assert json.loads(warm.stdout)["answer"] == json.loads(cold.stdout)["answer"]
        # a chat turn: its history takes transformers' tokenizer, loaded now, not at start
        conn = client.Client(group)
        try:
            done = list(conn.ask(QUESTION, [("who paid?", "the company")], 4))[-1]
        finally:
            conn.close()
        assert done.turns_used == 1 and done.token_ids
    finally:
        stopped = starqa("stop", "--all")
    assert stopped.returncode == 0, stopped.stderr
    assert group is None or _gone(group.pid)
    assert client.find(context.key) is None


@pytest.mark.slow
def test_an_ask_that_cannot_fork_answers_in_its_own_process(context):
    """No process to spare (fork fails): the ask answers in its own process, as it would
    with STARQA_HEADSTART=0 (the fault injected into a worker's ask is never reached)."""
    script = ("import errno, os, sys\n"
              "def refuse():\n"
              "    raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
              "os.fork = refuse\n"
              f"sys.argv = ['starqa', 'ask', {QUESTION!r}, '--json', '--max-new-tokens', '4',"
              " '--keep-alive', '0']\n"
              "from starqa.__main__ import main\n"
              "main()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "STARQA_FAULT": "ask:0"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["answer"]
