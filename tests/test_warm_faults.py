"""Warm groups under faults (issue 45, items 5, 6, 12 and 13, and what was found trying
more): a long or read-only cache root, signals, files changed under a running group, a
socket folder someone else made. Each drives the `starqa` command as a user would, in a
subprocess, on the tiny model of `tiny.py`; each failed before its fix. The context is a
copy of one ingest per session (`conftest.docs_context`): none of these is about encoding."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import install_home, starqa

QUESTION = "who approved the travel budget"


def groups() -> list[dict]:
    out = starqa("ps", "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout)


def clean(out: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in out.stderr + out.stdout


@pytest.fixture
def served(docs_context):
    """A context with a warm group of one worker (a background `starqa serve`)."""
    from starqa.workers import client

    group = client.start(docs_context.key, None, keepalive=120)
    yield docs_context, group
    starqa("stop", "--all")


@pytest.fixture(scope="module")
def shared_group(tmp_path_factory, tiny_model, ingested):
    """`served` once for the module, for the tests that only ask its group (or rename its
    context, which the group takes): a home of its own, a group that no keep-alive ends,
    stopped after the module's last test."""
    from starqa.workers import client

    home = tmp_path_factory.mktemp("shared") / "home"
    manifest = install_home(ingested(tiny_model, block_size=60), home)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STARQA_HOME", str(home))
        patch.delenv("STARQA_MODEL", raising=False)
        group = client.start(manifest.key, None, keepalive=-1)
        try:
            yield manifest, group
        finally:
            starqa("stop", "--all")


# ---------------------------------------------------------------------------------------
# item 5: a cache root longer than a socket path may be


@pytest.mark.slow
def test_a_200_character_home_keeps_warm_groups(home, tiny_model, ingested, monkeypatch):
    """AF_UNIX paths hold 107 bytes: a socket under a long $STARQA_HOME could not be bound,
    so every `ask` was cold, `serve` said "already running" then printed a traceback and
    `chat` died. Sockets now live in a short private folder, whatever the root."""
    long_home = home.parent / ("h" * (200 - len(str(home.parent)) - 1))
    assert len(str(long_home)) == 200
    monkeypatch.setenv("STARQA_HOME", str(long_home))
    install_home(ingested(tiny_model, block_size=60), long_home)

    first = starqa("ask", QUESTION, "--max-new-tokens", "3", "--keep-alive", "60")
    assert first.returncode == 0 and clean(first), first.stderr
    running = groups()
    assert len(running) == 1 and running[0]["answered"] == 0
    assert len(os.fsencode(running[0]["socket"])) <= 107
    assert oct(os.stat(Path(running[0]["socket"]).parent).st_mode & 0o777) == "0o700"
    warm = starqa("ask", QUESTION, "--max-new-tokens", "3", "--json")
    assert warm.returncode == 0 and json.loads(warm.stdout)["warm"] is True, warm.stderr

    again = starqa("serve")  # one group per context: refused in a line, no traceback
    assert again.returncode == 1 and clean(again) and "already running" in again.stderr

    chat = starqa("chat", "--max-new-tokens", "3", input=QUESTION + "\n")
    assert chat.returncode == 0 and clean(chat) and "first token" in chat.stderr, chat.stderr

    stopped = starqa("stop", "--all")
    assert stopped.returncode == 0 and "Stopped docs" in stopped.stderr
    assert groups() == []
    assert not Path(running[0]["socket"]).exists()


@pytest.mark.slow
def test_two_homes_with_one_context_get_a_socket_each(home, docs_context, monkeypatch):
    """The same context key under two cache roots: two groups, two sockets (a socket is
    named by a hash of the root and the key), each root's `ps` sees its own."""
    from starqa.workers import client

    other = home.parent / "other-home"
    shutil.copytree(home, other)
    sockets = []
    for root in (home, other):
        monkeypatch.setenv("STARQA_HOME", str(root))
        out = starqa("ask", QUESTION, "--max-new-tokens", "2", "--keep-alive", "60")
        assert out.returncode == 0, out.stderr
        [group] = groups()
        sockets.append(group["socket"])
    assert sockets[0] != sockets[1]
    for root in (home, other):
        monkeypatch.setenv("STARQA_HOME", str(root))
        assert starqa("stop", "--all").returncode == 0
        assert client.running() == []


# ---------------------------------------------------------------------------------------
# item 6: a read-only cache root

READ_ONLY_DRIVER = """
import json, subprocess, sys
def run(*args):
    out = subprocess.run([sys.executable, "-m", "starqa", *args], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=120)
    return {"args": list(args), "rc": out.returncode, "out": out.stdout, "err": out.stderr}
print(json.dumps([run("ask", "who approved the travel budget", "--max-new-tokens", "2",
                      "--keep-alive", "60"),
                  run("ps", "--json"),
                  run("ask", "who approved the travel budget", "--max-new-tokens", "2",
                      "--json"),
                  run("list"),
                  run("ingest", sys.argv[1], "--name", "another"),
                  run("stop", "--all"),
                  run("ps", "--json")]))
"""


def _read_only_runs(home: Path, docs: Path) -> list[dict]:
    """The commands of READ_ONLY_DRIVER run on `home` made read-only: a read-only bind
    mount in a mount namespace of its own as root (root writes whatever the modes say),
    else the folders' write bits taken away."""
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare to make a read-only mount as root")
        script = ('mount --bind -o ro "$STARQA_HOME" "$STARQA_HOME" || exit 77\n'
                  f'exec {sys.executable} -c "$DRIVER" {docs}')
        out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                             text=True, timeout=600,
                             env={**os.environ, "DRIVER": READ_ONLY_DRIVER, "COLUMNS": "200"})
        if out.returncode == 77 or "unshare failed" in out.stderr:
            pytest.skip(f"cannot make a read-only mount here: {out.stderr.strip()}")
    else:
        subprocess.run(["chmod", "-R", "a-w", str(home)], check=True)
        try:
            out = subprocess.run([sys.executable, "-c", READ_ONLY_DRIVER, str(docs)],
                                 capture_output=True, text=True, timeout=600,
                                 env={**os.environ, "COLUMNS": "200"})
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(home)], check=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_read_only_home_answers_and_says_what_it_cannot_do(home, docs, docs_context):
    """`client.run_dir` made and chmod-ed the run folder on every call: on a read-only root
    `ask`, `ps`, `stop --all` and `ingest` were tracebacks. Now read-only commands work (a
    warm group's run files go to a private folder outside the root) and `ingest` names the
    read-only folder and the way out."""
    ask, ps, warm, listed, again, stop, after = _read_only_runs(home, docs)
    for run in (ask, ps, warm, listed, again, stop, after):
        assert "Traceback" not in run["err"] + run["out"], run
    assert ask["rc"] == 0 and "first token" in ask["err"], ask
    assert ps["rc"] == 0 and len(json.loads(ps["out"])) == 1, ps
    assert warm["rc"] == 0 and json.loads(warm["out"])["warm"] is True, warm
    assert listed["rc"] == 0 and "docs" in listed["out"]
    assert again["rc"] == 1, again
    assert f"cache folder {home} is on a read-only file system" in again["err"] or \
        f"cache folder {home} is not writable by you" in again["err"], again["err"]
    assert "hint: make it writable" in again["err"] and "export STARQA_HOME=" in again["err"]
    assert stop["rc"] == 0 and "Stopped docs" in stop["err"], stop
    assert after["rc"] == 0 and json.loads(after["out"]) == []


# ---------------------------------------------------------------------------------------
# item 12: exit codes


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "starqa", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def _wait_for_group(proc: subprocess.Popen, timeout: float = 120):
    from starqa.workers import client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := client.running():
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("no group started")


@pytest.mark.slow
def test_sigterm_ends_serve_with_143_and_cleans_up(home, docs_context):
    """`kill` of `starqa serve` exited 130 (Ctrl-C's code); now 143, the code of a process
    ended by SIGTERM, with its run file and socket removed."""
    manifest = docs_context
    proc = _serve("--keep-alive", "60")
    try:
        group = _wait_for_group(proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "stopped by SIGTERM" in err
    assert not Path(group.socket).exists()
    assert not (home / "run" / f"{manifest.key}.json").exists()
    assert groups() == []


@pytest.mark.slow
def test_chat_from_a_file_exits_1_when_a_line_failed(shared_group):
    """`starqa chat < script` exited 0 when a question or command in it failed; now 1
    (each failure printed as it happened, the lines after it still answered), and 0 when
    everything succeeded."""
    too_long = " ".join(["travel"] * 600)  # does not fit the tiny model's 512-token window
    failed = starqa("chat", "--max-new-tokens", "2",
                    input=f"{QUESTION}\n{too_long}\n{QUESTION}\n")
    assert failed.returncode == 1, failed.stderr
    assert clean(failed) and failed.stderr.count("first token") == 2
    assert "error:" in failed.stderr
    unknown = starqa("chat", "--max-new-tokens", "2", input=f"/nosuch\n{QUESTION}\n")
    assert unknown.returncode == 1 and "Unknown command /nosuch" in unknown.stderr
    fine = starqa("chat", "--max-new-tokens", "2", input=f"{QUESTION}\n/help\n")
    assert fine.returncode == 0, fine.stderr


# ---------------------------------------------------------------------------------------
# item 13: the files of a running group changed on disk


def _flip_a_byte(path: Path) -> None:
    """Rewrite a byte in place (same file, same size), as a disk error or an editor would."""
    with open(path, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_a_shard_changed_under_a_warm_group_is_refused(served):
    """A warm group went on answering from a shard rewritten after it loaded it (on the
    CPU the shard is memory-mapped: it answered from the damaged bytes), while a cold ask
    named the corruption. Now each question first compares a stat of the context's files
    with what was loaded: a shard only touched (same bytes) is taken as it is; a changed
    one is named, the group stops, and the next ask (cold) names the damage."""
    manifest, group = served
    shard = manifest.folder / manifest.blocks[1].file
    os.utime(shard, ns=(time.time_ns(), time.time_ns()))  # touched: the bytes are the same
    touched = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json")
    assert touched.returncode == 0 and json.loads(touched.stdout)["warm"] is True

    _flip_a_byte(shard)
    refused = starqa("ask", QUESTION, "--max-new-tokens", "2")
    assert refused.returncode == 1 and clean(refused), refused.stderr
    assert f"The shard {shard} was changed on disk after this warm group" in refused.stderr
    assert "hint: ask again" in refused.stderr and "starqa ingest" in refused.stderr
    deadline = time.monotonic() + 30
    while groups() and time.monotonic() < deadline:  # the group has stopped
        time.sleep(0.1)
    assert groups() == []
    cold = starqa("ask", QUESTION, "--max-new-tokens", "2")
    assert cold.returncode == 1 and f"Shard {shard} fails its checksum" in cold.stderr


@pytest.mark.slow
def test_a_manifest_rewritten_with_the_same_blocks_is_taken(shared_group):
    """A rename rewrites the manifest but not the shards: the group goes on answering."""
    manifest, group = shared_group
    path = manifest.folder / "manifest.json"
    data = json.loads(path.read_text())
    data["name"] = "renamed"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    out = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json", "--context", manifest.key)
    assert out.returncode == 0 and json.loads(out.stdout)["warm"] is True, out.stderr


# ---------------------------------------------------------------------------------------
# found by trying more (each row of the campaign's table names its test)


def _plant_dead_group(key: str, pid: int) -> tuple[Path, Path]:
    """What a group killed with -9 leaves when its pid lives on (a zombie not yet reaped,
    or the number reused): a run file naming a live pid and a socket nobody listens on."""
    import socket

    from starqa.workers import client
    from starqa.core import paths

    sock_path = paths.socket_path(key)
    sock_path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()  # bound, never listening: a connect is refused, as a dead group's is
    run_file = client.run_dir() / f"{key}.json"
    run_file.write_text(json.dumps({"key": key, "name": "docs", "pid": pid, "workers": 1,
                                    "socket": str(sock_path), "started": time.time(),
                                    "keepalive": 300.0}))
    return run_file, sock_path


@pytest.mark.slow
def test_a_dead_groups_leftovers_never_block_ask_or_stop(home, docs_context):
    """A group gone without cleaning up, its pid still alive (a zombie its init had not
    reaped yet, or the number reused): `ask` failed with "Cannot reach the worker group"
    instead of answering, and `stop --all` stopped at it with the same error."""
    manifest = docs_context
    stand_in = subprocess.Popen(["sleep", "120"])
    try:
        run_file, sock_path = _plant_dead_group(manifest.key, stand_in.pid)
        ps = starqa("ps")
        assert ps.returncode == 0 and clean(ps)
        asked = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json")
        assert asked.returncode == 0 and json.loads(asked.stdout)["warm"] is False, asked.stderr
        assert not run_file.exists()  # forgotten: the next ask does not try it again

        run_file, sock_path = _plant_dead_group(manifest.key, stand_in.pid)
        stopped = starqa("stop", "--all")
        assert stopped.returncode == 0 and clean(stopped), stopped.stderr
        assert "had already died" in stopped.stderr
        assert not run_file.exists() and not sock_path.exists()
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.slow
def test_garbage_in_the_run_folder_is_ignored(home, docs_context):
    """Files in the run folder that are not run files of this starqa (a run file missing
    fields, as another version's would, one of the wrong kinds, a list, a folder named
    like a run file): `ps` printed a KeyError traceback; now they are passed over."""
    run = home / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "old.json").write_text(json.dumps({"key": "k", "pid": os.getpid(), "socket": None}))
    (run / "kinds.json").write_text(json.dumps({"key": 1, "name": "x", "pid": "me",
                                                "workers": 1, "socket": None,
                                                "started": 0, "keepalive": 1}))
    (run / "list.json").write_text("[1, 2]")
    (run / "dir.json").mkdir()
    (run / "junk.json").write_bytes(b"\xff\xfe not json")
    for args in (("ps",), ("ps", "--json"), ("stop", "--all")):
        out = starqa(*args)
        assert out.returncode == 0 and clean(out), (args, out.stderr)
    assert json.loads(starqa("ps", "--json").stdout) == []
    asked = starqa("ask", QUESTION, "--max-new-tokens", "2")
    assert asked.returncode == 0 and clean(asked), asked.stderr


@pytest.mark.slow
def test_a_socket_folder_someone_else_made_is_refused(home, docs_context, tmp_path):
    """The sockets' folder is the first thing another local user could plant (a symlink to
    a folder of theirs, in /tmp or $XDG_RUNTIME_DIR): `serve` refuses it with the way out;
    `ask` still answers (cold, leaving no group there)."""
    runtime = tmp_path / "rt"
    elsewhere = tmp_path / "theirs"
    runtime.mkdir()
    elsewhere.mkdir(mode=0o777)
    (runtime / "starqa").symlink_to(elsewhere, target_is_directory=True)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    served = starqa("serve", "--keep-alive", "5", env=env)
    assert served.returncode == 1 and clean(served), served.stderr
    assert f"{runtime / 'starqa'}, is a symlink" in served.stderr
    assert "hint: use a private folder" in served.stderr
    asked = starqa("ask", QUESTION, "--max-new-tokens", "2", "--keep-alive", "30", env=env)
    assert asked.returncode == 0 and clean(asked), asked.stderr
    assert list(elsewhere.iterdir()) == []  # nothing of ours went into their folder
    assert groups() == []


@pytest.mark.slow
def test_huge_max_new_tokens_on_a_warm_group_is_a_one_line_error(shared_group):
    """Already fine: the room check names a value that fits; the group keeps serving."""
    out = starqa("ask", QUESTION, "--max-new-tokens", str(10**12))
    assert out.returncode == 1 and clean(out) and "--max-new-tokens" in out.stderr
    again = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["warm"] is True


@pytest.fixture
def long_answers(home, long_tiny_model, ingested):
    """A context on a model that never ends an answer (so one runs for thousands of
    tokens), with a warm group of one worker."""
    from starqa.workers import client

    manifest = install_home(ingested(long_tiny_model, block_size=60), home)
    client.start(manifest.key, None, keepalive=120)
    yield manifest
    starqa("stop", "--all")


@pytest.mark.slow
def test_stop_while_an_answer_streams_stops_at_once(long_answers):
    """`starqa stop` while the group answered waited for the whole answer, then failed
    with a TimeoutError traceback after 30 s (the answer running on). Now the stop ends
    the answer at the next token; the asker is told its answer was cut short."""
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "ask", QUESTION,
                             "--max-new-tokens", "7000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.read(1)  # the answer streams
        started = time.monotonic()
        stopped = starqa("stop", "--all", timeout=60)
        assert stopped.returncode == 0 and clean(stopped), stopped.stderr
        assert time.monotonic() - started < 20
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "was stopped (starqa stop) while it answered" in err
    assert groups() == []


@pytest.mark.slow
def test_chat_goes_on_when_its_group_went_away(home, docs_context):
    """A chat whose group went away between questions (its keep-alive ran out while the
    chat sat idle, or `starqa stop` elsewhere): the next question killed the chat with no
    message (a BrokenPipeError; exit 1). Now the chat starts the group again and answers,
    its conversation kept."""
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "chat", "--max-new-tokens", "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(QUESTION + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [g for g in groups()
                                                   if g.get("answered") == 1]:
            time.sleep(0.2)
        assert starqa("stop", "--all").returncode == 0
        out, err = proc.communicate(QUESTION + "\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert err.count("first token") == 2
    assert "(the warm group had stopped; starting it again)" in err
    assert groups() == []  # the chat's own group (keep-alive 0) stopped with it


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_sigterm_while_a_group_of_two_loads(home, docs_context):
    """SIGTERM while torchrun's workers load: exit 143 (was 130), no traceback, no worker
    left, no run file."""
    proc = _serve("--workers", "2", "--keep-alive", "60")
    try:
        deadline = time.monotonic() + 60
        while not _children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        torchrun = _children(proc.pid)
        assert torchrun, "torchrun did not start"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err
    time.sleep(1)
    assert all(not Path(f"/proc/{pid}").exists() for pid in torchrun)
    assert groups() == [] and not list((home / "run").glob("*.json"))


FULL_DRIVER = """
import json, subprocess, sys
def run(*args, input=None):
    out = subprocess.run([sys.executable, "-m", "starqa", *args], capture_output=True,
                         text=True, input=input, timeout=120)
    return {"rc": out.returncode, "out": out.stdout, "err": out.stderr}
print(json.dumps([run("ask", "who approved the travel budget", "--max-new-tokens", "2",
                      "--keep-alive", "30"),
                  run("chat", "--max-new-tokens", "2", input="who\\n"),
                  run("stop", "--all")]))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a full tmpfs in a mount namespace: needs root and unshare")
def test_a_full_run_folder_costs_the_warm_group_not_the_answer(home, docs_context):
    """The run folder on a full disk: `ask` printed its answer, then failed (exit 1, "Worker
    0 ran out of disk space ... Nothing of this run was kept") because the group it leaves
    could not write its run file; `chat` said only "exited while starting:" with an empty
    log. Now the ask succeeds without a group, and chat names the folder and the fix."""
    (home / "run").mkdir(exist_ok=True)
    script = ('mount -t tmpfs -o size=16k tmpfs "$STARQA_HOME/run" || exit 77\n'
              'dd if=/dev/zero of="$STARQA_HOME/run/fill" bs=4k count=100 2>/dev/null\n'
              f'exec {sys.executable} -c "$DRIVER"')
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "DRIVER": FULL_DRIVER, "COLUMNS": "200"})
    if out.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    ask, chat, stop = json.loads(out.stdout)
    assert ask["rc"] == 0 and "first token" in ask["err"], ask
    assert "Traceback" not in ask["err"] + chat["err"] + stop["err"]
    assert chat["rc"] == 1 and "leaving nothing in its log" in chat["err"], chat
    assert "hint: free space there (df -h" in chat["err"]
    assert stop["rc"] == 0


@pytest.mark.slow
def test_stop_right_after_a_group_was_started_stops_it(home, docs_context):
    """`stop --all` just after an `ask` (or an `ingest`) started a group in the background
    said "No matching worker group is running." and the group came up a second later,
    running on. The slot is now taken as the group is spawned, and `stop` waits for a
    group still starting, then stops it."""
    asked = starqa("ask", QUESTION, "--max-new-tokens", "2", "--keep-alive", "60",
                   env={"STARQA_HEADSTART": "0"})  # in-process answer: `serve` is spawned
    assert asked.returncode == 0, asked.stderr
    stopped = starqa("stop", "--all")
    assert stopped.returncode == 0 and clean(stopped), stopped.stderr
    assert "Stopped docs" in stopped.stderr
    time.sleep(3)
    assert groups() == []


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file owned by another user: needs root")
def test_another_users_group_in_a_shared_cache_is_not_ours(home, docs_context):
    """A cache shared by a team holds the run file of another user's group (their socket,
    which we may not enter): `ps` listed it and `ask` tried it and failed ("Cannot reach
    the worker group"). Run files are now taken only from their owner; the ask answers."""
    import socket

    manifest = docs_context
    theirs = home / "theirs"
    theirs.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(theirs / "s.sock"))
    sock.close()
    run = home / "run"
    run.mkdir(exist_ok=True)
    stand_in = subprocess.Popen(["sleep", "120"])
    try:
        run_file = run / f"{manifest.key}.json"
        run_file.write_text(json.dumps({"key": manifest.key, "name": "docs",
                                        "pid": stand_in.pid, "workers": 1,
                                        "socket": str(theirs / "s.sock"),
                                        "started": time.time(), "keepalive": 300.0}))
        os.chown(run_file, 65534, 65534)
        assert groups() == []
        asked = starqa("ask", QUESTION, "--max-new-tokens", "2", "--json")
        assert asked.returncode == 0 and json.loads(asked.stdout)["warm"] is False, asked.stderr
        assert run_file.exists()  # theirs: left alone
    finally:
        stand_in.kill()
        stand_in.wait()


CHAT_DRIVER = """
import io, os, sys, pexpect
child = pexpect.spawn(sys.executable, ["-m", "starqa", "chat", "--max-new-tokens", "2"],
                      encoding="utf-8", timeout=120, dimensions=(40, 120),
                      env=dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1"))
child.logfile_read = seen = io.StringIO()
child.expect("/help for commands")
child.expect("›")
child.send("who approved the travel budget\\r")
child.expect(r"first token [\\d.]+ s")
child.expect("›")
child.send("/exit\\r")
child.expect(pexpect.EOF)
child.close()
print("EXIT", child.exitstatus, any(bad in seen.getvalue() for bad in ("Traceback", "ENTER")))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="makes a read-only mount in a mount namespace: needs root")
def test_chat_at_a_terminal_on_a_read_only_home(home, docs_context):
    """At a terminal, chat appends each question to `$STARQA_HOME/chat_history`: on a
    read-only cache the first question ended the chat ("cache folder … read-only").
    The history is now kept for the session only there."""
    script = ('mount --bind -o ro "$STARQA_HOME" "$STARQA_HOME" || exit 77\n'
              f'exec {sys.executable} -c "$DRIVER"')
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "DRIVER": CHAT_DRIVER})
    if out.returncode == 77:
        pytest.skip(f"cannot make a read-only mount here: {out.stderr.strip()}")
    assert "EXIT 0 False" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------
# a warm group's socket: a malformed request gets an error; `rm` of its context stops it


@pytest.mark.slow
def test_malformed_requests_get_an_error_and_the_group_keeps_serving(served):
    from starqa.workers import client, messages

    manifest, group = served
    conn = client.Client(group)
    try:
        for bad in (b"[]", b"null", b"not json",
                    json.dumps({"op": "ask", "question": "who", "max_new_tokens": "x"}).encode(),
                    json.dumps({"op": "ask", "question": 5}).encode(),
                    json.dumps({"op": "ask", "question": "who", "history": [[1]]}).encode(),
                    json.dumps({"op": "ask", "question": "who", "max_new_tokens": 0}).encode(),
                    json.dumps({"op": "ask", "question": "who", "draft_tokens": -1}).encode(),
                    json.dumps({"op": "ask", "question": "who", "draft_tokens": "3"}).encode()):
            conn.sock.sendall(bad + b"\n")
            event = next(conn.events())
            assert isinstance(event, messages.Failed) and "Bad request" in event.message, \
                (bad, event)
        done = [e for e in conn.ask("who approved the travel budget", (), 4)][-1]
        assert isinstance(done, messages.Finished) and done.token_ids
        plain = [e for e in conn.ask("who approved the travel budget", (), 4, draft_tokens=0)]
        assert plain[-1].token_ids == done.token_ids  # drafts never change the answer
    finally:
        conn.close()


@pytest.mark.slow
def test_rm_of_a_served_context_stops_its_group(served):
    from starqa.workers import client

    manifest, group = served
    removed = starqa("rm", manifest.key)
    assert removed.returncode == 0 and clean(removed), removed.stderr
    deadline = time.monotonic() + 30
    while client.find(manifest.key) is not None:
        assert time.monotonic() < deadline, "the group still runs after rm"
        time.sleep(0.2)
    assert not manifest.folder.exists()
