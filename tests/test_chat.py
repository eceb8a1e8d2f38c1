"""The REPL driven as a person would, in a pseudo-terminal, plus warm `ask`, `ps`, `stop`.
A context the chat only reads is a copy of one ingest per session (`conftest.ingested`)."""

import json
import os
import subprocess
import sys
import time

import pexpect
import pytest

from fakes import install_home, starqa
from starqa import engine


@pytest.fixture
def warm_home(home, long_tiny_model, ingested):
    # A long window, so an answer can run for thousands of tokens (seconds) and be interrupted.
    install_home(ingested(long_tiny_model, block_size=60), home)
    yield home
    starqa("stop", "--all")


@pytest.mark.slow
def test_chat_session_in_a_terminal(warm_home):
    # pexpect's terminal answers no cursor-position requests; say so instead of timing out.
    # The group outlives the chat for its keep-alive (0 would stop it with the chat).
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", STARQA_KEEP_ALIVE="600")
    child = pexpect.spawn(sys.executable, ["-m", "starqa", "chat", "--max-new-tokens", "6000",
                                           "--workers", "2"],
                          encoding="utf-8", timeout=240, dimensions=(40, 120), env=env)
    child.logfile_read = open(warm_home / "chat.log", "w")  # shown by pytest on failure
    child.expect(r"2 warm workers · /help for commands")
    child.expect("›")

    # Enter is CR in a terminal (sendline's LF would add a line instead).
    child.send("who approved the travel budget\r")
    child.expect(r"first token [\d.]+ s")
    child.expect(r"sources: \S+\.(md|py):\d+")
    child.expect("›")

    child.send("/sources\r")
    child.expect(r"sources: (\S+\.(md|py):\d+(-\d+)? \(\d+%\)(, )?)+")
    child.expect("›")

    child.send("/help\r")
    child.expect("/context NAME")
    child.expect("›")

    # A long answer, interrupted: the session goes on.
    child.send("what is the retry limit of the long context code document\r")
    # ^C once the answer streams: after the prompt has let the terminal go (bracketed paste
    # off, then cooked mode again, so ^C is a SIGINT to the REPL) and the answer's first
    # word has shown, with thousands of tokens to go. (The REPL asks the group to stop.)
    child.expect(r"\?2004l")
    child.expect(r"[a-z]{2,}")
    time.sleep(0.3)
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect("›")

    child.send("/stats\r")
    child.expect(r"group: 2 workers · \d+ answered")
    child.expect("›")

    # Another client (`ask`) is served while the chat stays connected.
    side = json.loads(starqa("ask", "who approved the travel budget", "--json",
                             "--max-new-tokens", "4").stdout)
    assert side["warm"] is True

    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    # The workers stayed warm: ps lists them, ask uses them, stop ends them.
    groups = json.loads(starqa("ps", "--json").stdout)
    assert len(groups) == 1 and groups[0]["workers"] == 2 and groups[0]["answered"] >= 2
    answer = json.loads(starqa("ask", "who approved the travel budget", "--json",
                               "--max-new-tokens", "4").stdout)
    assert answer["warm"] is True and answer["sources"]
    assert "Stopped docs" in starqa("stop", "docs").stderr
    assert json.loads(starqa("ps", "--json").stdout) == []


@pytest.mark.slow
def test_chat_with_keep_alive_zero_leaves_no_group(warm_home):
    """--keep-alive 0: the group the chat started ends with the chat."""
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1")
    child = pexpect.spawn(sys.executable, ["-m", "starqa", "chat", "--keep-alive", "0"],
                          encoding="utf-8", timeout=240, dimensions=(40, 120), env=env)
    child.expect(r"warm worker")
    child.expect("›")
    assert len(json.loads(starqa("ps", "--json").stdout)) == 1
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert json.loads(starqa("ps", "--json").stdout) == []


@pytest.mark.slow
def test_chat_from_a_pipe_answers_every_line(home, docs_context):
    """`starqa chat < questions.txt`: every non-empty line is a question (or a command),
    answered in turn; the end of the input ends the chat and, with --keep-alive 0, its group."""
    out = starqa("chat", "--keep-alive", "0", "--max-new-tokens", "4",
                 input="who approved the travel budget\n\n/help\nwhat is the retry limit\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 2  # two answers (on stdout, the rest not)
    assert out.stderr.count("first token") == 2
    assert "/context NAME" in out.stdout + out.stderr  # and the command run between them
    assert json.loads(starqa("ps", "--json").stdout) == []


@pytest.mark.slow
def test_chat_switches_to_a_reingested_version_between_questions(home, docs, tiny_model):
    """A context re-ingested while a chat is open: before its next question the chat says
    so and answers from the new version (its group), the conversation kept."""
    def ingest():  # in this process: the chat, not the encoding, is the point
        return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model),
                                                  dtype="fp32", block_size=60,
                                                  encode_in="process")).manifest

    old = ingest()
    chat = subprocess.Popen([sys.executable, "-m", "starqa", "chat", "--keep-alive", "0",
                             "--max-new-tokens", "4"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        chat.stdin.write("who approved the travel budget\n")
        chat.stdin.flush()
        seen = []
        while not any("first token" in line for line in seen):  # the first answer is done
            line = chat.stderr.readline()
            assert line, "chat ended early: " + "".join(seen)
            seen.append(line)
        (docs / "code.py").write_text((docs / "code.py").read_text() + "retry limit is nine\n")
        new = ingest()
        assert new.key != old.key and new.name == old.name
        out, err = chat.communicate("what is the retry limit\n/stats\n", timeout=300)
    finally:
        if chat.poll() is None:
            chat.kill()
            starqa("stop", "--all")
    assert chat.returncode == 0, err
    assert f"{old.name} was re-ingested; answering from the new version ({new.key[:8]})" in \
        " ".join(err.split())
    assert "conversation: 2 turns" in err  # the turn before the switch was kept
    assert not any(g["key"] == old.key for g in json.loads(starqa("ps", "--json").stdout))
