"""The REPL driven as a person would, in a pseudo-terminal, plus warm `ask`, `ps`, `stop`."""

import json
import subprocess
import sys

import pexpect
import pytest

from starqa import engine


def starqa(*args, env=None):
    return subprocess.run([sys.executable, "-m", "starqa", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture
def warm_home(home, docs, tiny_model):
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model), dtype="fp32",
                                       block_size=60))
    yield home
    starqa("stop", "--all")


def test_chat_session_in_a_terminal(warm_home):
    child = pexpect.spawn(sys.executable, ["-m", "starqa", "chat", "--max-new-tokens", "300",
                                           "--workers", "2"],
                          encoding="utf-8", timeout=240, dimensions=(40, 120))
    child.expect(r"2 warm workers · /help for commands")
    child.expect("› ")

    child.sendline("who approved the travel budget")
    child.expect(r"first token [\d.]+ s")
    child.expect(r"sources: \S+\.(md|py):\d+")
    child.expect("› ")

    child.sendline("/sources")
    child.expect(r"sources: (\S+\.(md|py):\d+(-\d+)? \(\d+%\)(, )?)+")
    child.expect("› ")

    child.sendline("/help")
    child.expect("/context NAME")
    child.expect("› ")

    # A long answer, interrupted: the session goes on.
    child.sendline("what is the retry limit of the long context code document")
    child.expect(r"\w")  # the answer has begun streaming
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect("› ")

    child.sendline("/stats")
    child.expect(r"group: 2 workers · \d+ answered")
    child.expect("› ")

    child.sendline("/exit")
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
