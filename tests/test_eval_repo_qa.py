"""`starqa eval --tasks repo_qa`: questions derived from a package's AST (each kind, its
answer, file and line; ambiguous ones skipped), samples that fill the budget with the
package's files, and one run end to end on the tiny random model."""

import json

import pytest
from typer.testing import CliRunner

from starqa.cli import app
from starqa.core.errors import StarqaError
from starqa.corpus import TextFile
from starqa.measure.evals import generators, repo_qa

NET = '''\
"""Networking."""

RETRY_LIMIT = 5
BACKOFF_MS = 250
TIMEOUT_S = 90
DEBUG_WIRE = True
MODE = "mode"
GREETING = "hello there"
SPEED = 1_000


class Client:
    def connect(self, host, timeout=90, *, scheme="gopher"):
        if not host:
            raise ValueError("no host")
        return host

    def close(self):
        pass


class Server:
    def close(self):
        pass

    def listen(self, port=8080, *, backlog=64):
        raise ServerError(port)


def parse(text):
    if text:
        raise KeyError(text)
    raise TypeError(text)


def retry(call):
    try:
        return call()
    except OSError as err:
        raise err


def outer():
    def inner():
        raise PermissionError("inner")
    return inner


def helper(x=1234):
    return x
'''

ERRORS = '''\
class ServerError(Exception):
    pass


class ServerErrorGroup(Exception):
    pass


def helper(x=1234):
    return x
'''


def write_package(folder):
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text('"""A tiny package for repo_qa."""\n')
    (folder / "net.py").write_text(NET)
    (folder / "errors.py").write_text(ERRORS)
    return folder


@pytest.fixture
def package(tmp_path, monkeypatch):
    """The tiny package, set as the one repo_qa asks about."""
    folder = write_package(tmp_path / "tinypkg")
    monkeypatch.setenv(repo_qa.PACKAGE_VARIABLE, str(folder))
    return folder


# ---------------------------------------------------------------------------------------
# questions


def test_each_kind_its_answer_file_and_line_and_ambiguity_skipped(package):
    loaded = repo_qa.load(str(package))
    assert loaded.name == "tinypkg" and [f.path for f in loaded.files] == [
        "__init__.py", "errors.py", "net.py"]
    got = {(q.kind, q.answer, q.file, q.line) for q in loaded.questions}
    assert got == {
        # RETRY_LIMIT: one character; TIMEOUT_S: 90 is written twice in net.py; DEBUG_WIRE:
        # not an int or a string; MODE: the answer is in the question; SPEED: not decimal
        ("constant", "250", "net.py", 4),
        ("constant", "hello there", "net.py", 8),
        # close: defined twice; listen's class, Server, is inside ServerError
        ("method", "Client", "net.py", 13),
        # connect's timeout: 90 twice in its file; helper: defined twice
        ("default", "gopher", "net.py", 13),
        ("default", "8080", "net.py", 26),
        ("default", "64", "net.py", 26),
        # listen's ServerError is inside ServerErrorGroup; parse raises two; retry re-raises
        # a variable; outer raises nothing itself, inner does
        ("raises", "ValueError", "net.py", 15),
        ("raises", "PermissionError", "net.py", 45),
    }
    by_answer = {q.answer: q for q in loaded.questions}
    assert by_answer["250"].text == ("What is the value of the module constant `BACKOFF_MS`? "
                                     "Answer with the value only.")
    assert by_answer["Client"].text.startswith("Which class defines the method `connect`?")
    assert "`backlog` parameter of `listen`" in by_answer["64"].text
    assert by_answer["PermissionError"].text.startswith("Which exception does `inner` raise?")
    lines = NET.splitlines()
    for q in loaded.questions:  # the line holds the answer (a method: its def)
        line = lines[q.line - 1]
        assert q.answer in line if q.kind != "method" else "def connect" in line


def test_a_file_python_cannot_parse_asks_nothing_and_mentions_are_whole_words():
    files = [TextFile("bad.py", "X_LIMIT = 77\ndef (:\n", 20),
             TextFile("good.py", "Y_LIMIT = 78\n", 13)]
    assert [(q.answer, q.file) for q in repo_qa.derive(files)] == [("78", "good.py")]
    assert repo_qa.mentions("78", "x = 78; y = 1978; z = 78_0; w = '78'") == 2
    assert repo_qa.mentions("dim red", "DIM RED, dim reddish") == 1


def test_the_package_is_an_installed_one_or_a_folder_and_errors_are_clear(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv(repo_qa.PACKAGE_VARIABLE, raising=False)
    assert repo_qa.package_spec() == repo_qa.DEFAULT_PACKAGE == "typer"
    name, folder = repo_qa.locate("typer")
    assert name == "typer" and (folder / "main.py").is_file()
    with pytest.raises(StarqaError, match="'no_such_pkg_x' is not an installed package"):
        repo_qa.locate("no_such_pkg_x")
    with pytest.raises(StarqaError, match="is not a folder"):
        repo_qa.locate(str(tmp_path / "missing"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.py").write_text("x = 1\n")
    with pytest.raises(StarqaError, match="no question with one exact answer"):
        repo_qa.load(str(tmp_path / "plain"))


# ---------------------------------------------------------------------------------------
# samples


def test_a_package_shorter_than_the_budget_is_packed_whole(package, tok):
    s = generators.generate("repo_qa", 3000, 0, tok)
    assert s.tokens < 3000 and s.meta["cut"] is None and s.meta["files"] == 3
    assert [f.path for f in s.files] == ["__init__.py", "errors.py", "net.py"]  # path order
    assert s.meta["package"]["name"] == "tinypkg" and s.meta["package"]["questions"] == 8
    assert s.meta["source"]["file"] == "net.py" and s.question in {
        q.text for q in repo_qa.load(str(package)).questions}
    with pytest.raises(StarqaError, match="too short for repo_qa over tinypkg"):
        generators.generate("repo_qa", 50, 0, tok)


@pytest.mark.parametrize("length", [1500, 4000])
def test_samples_fill_the_budget_hold_their_file_whole_and_follow_the_seed(tok, length,
                                                                          monkeypatch):
    monkeypatch.delenv(repo_qa.PACKAGE_VARIABLE, raising=False)
    package = repo_qa.load("typer")
    whole = {f.path: f.text for f in package.files}
    seen = set()
    for seed in range(4):
        s = generators.generate("repo_qa", length, seed, tok)
        assert length - max(64, length // 20) <= s.tokens <= length
        again = generators.generate("repo_qa", length, seed, tok)
        assert (again.context_ids, again.question, again.meta) == (
            s.context_ids, s.question, s.meta)
        seen.add((s.question, s.context_text))
        source = s.meta["source"]
        paths = [f.path for f in s.files]
        assert paths == sorted(paths) and source["file"] in paths
        gold = whole[source["file"]]
        assert f'<document path="{source["file"]}">\n{gold.rstrip()}\n</document>' in \
            s.context_text  # the question's file, whole
        line = gold.splitlines()[source["line"] - 1]
        assert s.answers[0] in line or s.meta["kind"] == "method" and "def " in line
        cut = [p for p in paths if p != source["file"] and
               whole[p].rstrip() not in s.context_text]
        assert cut == ([s.meta["cut"]] if s.meta["cut"] else [])  # one file at most is cut
        assert s.meta["package"]["sha256"] == package.digest
    assert len(seen) == 4


def test_the_samples_of_a_seed_and_length_ask_about_one_context(tok, monkeypatch):
    monkeypatch.delenv(repo_qa.PACKAGE_VARIABLE, raising=False)
    samples = [generators.generate("repo_qa", 4000, 7, tok, i) for i in range(6)]
    assert len({tuple(s.context_ids) for s in samples}) == 1  # one context ...
    whole = {f.path for f in samples[0].files} - {samples[0].meta["cut"]}
    held = [q for q in repo_qa.load("typer").questions if q.file in whole]
    asked = [next(q for q in held if q.text == s.question) for s in samples]
    n = min(len(held), len(asked))
    assert len(set(asked[:n])) == n > 1  # ... distinct questions about it, till they run out
    assert asked[n:] == asked[:len(asked) - n]  # (then again from the first)
    kinds = {q.kind for q in held}
    assert len({q.kind for q in asked[:len(kinds)]}) == len(kinds) > 1  # the kinds in turn
    for s in samples:  # each about a file the context holds whole
        assert s.meta["source"]["file"] != s.meta["cut"] and s.tokens <= 4000
    other = generators.generate("repo_qa", 4000, 8, tok, 0)
    assert other.context_ids != samples[0].context_ids  # another seed, another context


def test_eval_encodes_a_shared_context_once_a_method(home, long_tiny_model, tmp_path,
                                                    monkeypatch):
    from starqa.measure.evals import runner
    monkeypatch.delenv(repo_qa.PACKAGE_VARIABLE, raising=False)
    encoded = []
    real = runner.Evaluator.encode

    def counting(self, sample, method):
        encoded.append((sample.index, method))
        return real(self, sample, method)

    monkeypatch.setattr(runner.Evaluator, "encode", counting)
    out = tmp_path / "shared.json"
    result = CliRunner().invoke(app, [
        "eval", "--model", str(long_tiny_model), "--tasks", "repo_qa", "--lengths", "2k",
        "--methods", "dense,star", "--samples", "3", "--dtype", "fp32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert encoded == [(0, "dense"), (0, "star")]
    samples = json.loads(out.read_text())["samples"]
    assert len(samples) == 3 and all(set(s["results"]) == {"dense", "star"} for s in samples)


# ---------------------------------------------------------------------------------------
# end to end


def test_eval_runs_repo_qa_and_scores_sources(home, long_tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv(repo_qa.PACKAGE_VARIABLE, raising=False)
    out = tmp_path / "repo_qa.json"
    result = CliRunner().invoke(app, [
        "eval", "--model", str(long_tiny_model), "--tasks", "repo_qa", "--lengths", "2k",
        "--methods", "dense,star", "--samples", "1", "--dtype", "fp32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["status"] == "complete" and "repo_qa" in saved["settings"]["tasks"]
    [sample] = saved["samples"]
    assert sample["task"] == "repo_qa" and sample["length"] == 2048
    assert sample["meta"]["package"]["name"] == "typer"
    assert sum(sample["tokens"].values()) <= 2048
    for method in ("dense", "star"):
        r = sample["results"][method]
        assert isinstance(r["correct"], bool) and r["sources"]
        # the sources machinery scored the named sources against the answer's file
        assert r["source_score"]["top1"] == (
            r["sources"][0]["path"] == sample["meta"]["source"]["file"])
    assert [row["task"] for row in saved["summary"]] == ["repo_qa"]


def test_repo_qa_is_registered_with_the_other_tasks():
    assert "repo_qa" in generators.TASKS and "repo_qa" in generators.GROUPS["all"]
    assert generators.resolve_tasks("repo_qa,vt") == ["repo_qa", "vt"]
