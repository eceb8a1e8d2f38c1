"""Bad inputs and faults from issue #11: each test failed before its fix.

No model downloads and no torchrun: the tiny model of `tiny.py` where a tokenizer is needed,
fake contexts (from test_cache_cmds) where the cache is, and Phase 1's steps
(`starqa.launchers.ingest.flow.run_phase1`) replaced by a stand-in that commits shards the
way the workers would.
"""

import json
import os
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fakes import make_context, starqa
from typer.testing import CliRunner

from starqa import corpus, engine
from starqa.core import paths
from starqa.cache import shards, store
from starqa.launchers.ingest import flow, steps
from starqa.cli import app
from starqa.core.errors import ShardError, StarqaError
from starqa.cache.manifest import MANIFEST, ModelIdentity, block_file, read_manifest, write_manifest

runner = CliRunner()

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


# ---------------------------------------------------------------------------------------
# a symlink in an ingested folder never brings in what lies outside it


@pytest.mark.parametrize("under_git", [False, True])
def test_symlinks_to_outside_the_folder_are_not_followed(tmp_path, under_git):
    """A folder holding `secret.md -> ~/.ssh/...` (here: a file beside the folder) and a
    linked folder outside it: neither is read, both are listed as skipped with the reason;
    a symlink to a file inside the folder is not refused for that (it is the same file as
    its target, read once)."""
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "key.md").write_text("PRIVATE KEY do not read")
    repo = tmp_path / "r"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("the office approved it")
    (repo / "secret.md").symlink_to(outside / "key.md")
    (repo / "linked").symlink_to(outside, target_is_directory=True)
    (repo / "inside.md").symlink_to(repo / "docs" / "a.md")
    if under_git:
        if shutil.which("git") is None:
            pytest.skip("needs git")
        git(repo, "init", "-q")
        git(repo, "add", "-A")
    found = corpus.collect([str(repo)])
    read = {f.path for f in found.files}
    assert "secret.md" not in read and not any(p.startswith("linked") for p in read)
    assert not any("PRIVATE" in f.text for f in found.files)
    assert "docs/a.md" in read
    reasons = {s.path: s.reason for s in found.skipped}
    assert "outside" not in reasons.get("inside.md", "")
    assert reasons["secret.md"].startswith("symlink to outside the folder")
    assert reasons.get("linked", reasons.get("linked/key.md", "")).startswith("symlink to outside")


def test_a_cache_folder_that_is_a_file_is_named(tmp_path, monkeypatch):
    """STARQA_HOME naming a file, or a path below one: an error naming both, no traceback."""
    from starqa.core import paths

    (tmp_path / "f").write_text("x")
    for home in (tmp_path / "f", tmp_path / "f" / "below"):
        monkeypatch.setenv("STARQA_HOME", str(home))
        with pytest.raises(StarqaError, match=f"{tmp_path / 'f'} is a file, not a folder") as err:
            paths.contexts_dir()
        assert "STARQA_HOME" in str(err.value) and "export STARQA_HOME=" in err.value.hint


# ---------------------------------------------------------------------------------------
# 1. ingesting a folder never runs a program its git config names


@needs_git
@pytest.mark.parametrize("where", ["config", "include"])
def test_git_config_of_the_folder_runs_nothing(tmp_path, where):
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("tracked")
    (repo / "b.py").write_text("untracked")
    git(repo, "add", "a.py")
    hook = "touch ../PWNED; echo"
    if where == "config":
        git(repo, "config", "core.fsmonitor", hook)
    else:  # through an included file, which the repository itself can ship
        (repo / "evil.cfg").write_text(f"[core]\n\tfsmonitor = {hook}\n")
        git(repo, "config", "include.path", "../evil.cfg")
    git(repo, "config", "core.hooksPath", str(tmp_path / "hooks"))
    git(repo, "config", "core.pager", "touch ../PWNED; cat")

    got = corpus.collect([repo])

    assert not (tmp_path / "PWNED").exists()
    expected = ["a.py", "b.py"] + (["evil.cfg"] if where == "include" else [])
    assert [f.path for f in got.files] == expected  # git's view still decides what is read


@needs_git
def test_reading_commit_times_runs_no_signature_program(tmp_path):
    """`collect` reads the files' last commit times with `git log`, which a repository's own
    config can make verify signatures with a program it names (log.showSignature,
    gpg.program): never run."""
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("tracked")
    git(repo, "add", "a.py")
    tree = subprocess.run(["git", "write-tree"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()
    signed = (f"tree {tree}\nauthor a <a@x> 1700000000 +0000\n"
              "committer a <a@x> 1700000000 +0000\ngpgsig -----BEGIN PGP SIGNATURE-----\n \n"
              " AAAA\n -----END PGP SIGNATURE-----\n\nsigned\n")
    commit = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--stdin"], cwd=repo,
                            input=signed, check=True, capture_output=True,
                            text=True).stdout.strip()
    git(repo, "update-ref", "HEAD", commit)
    program = tmp_path / "gpg"
    program.write_text(f"#!/bin/sh\ntouch {tmp_path / 'PWNED'}\nexit 1\n")
    program.chmod(0o755)
    git(repo, "config", "log.showSignature", "true")
    git(repo, "config", "gpg.program", str(program))
    subprocess.run(["git", "log", "-n1"], cwd=repo, capture_output=True)  # plain git runs it
    assert (tmp_path / "PWNED").exists()
    (tmp_path / "PWNED").unlink()

    got = corpus.collect([repo])

    assert not (tmp_path / "PWNED").exists()
    assert [(f.path, f.changed) for f in got.files] == [("a.py", 1700000000)]


# ---------------------------------------------------------------------------------------
# 6. an unreadable sub-folder is skipped and reported, never a traceback


def _plain_tree(tmp_path: Path) -> Path:
    root = tmp_path / "plain"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "secret.py").write_text("secret")
    (root / "ok.py").write_text("ok")
    return root


@pytest.mark.parametrize("in_git", [False, pytest.param(True, marks=needs_git)])
def test_unreadable_sub_folder_is_skipped_and_reported(tmp_path, monkeypatch, in_git):
    """As root chmod cannot lock a folder, so the OS's refusal is simulated where it struck:
    checking for the folder's .gitignore (or, in git, whether a tracked path is a file)."""
    root = _plain_tree(tmp_path)
    if in_git:
        git(root, "init", "-q")
        git(root, "add", ".")
    real_is_file = Path.is_file

    def is_file(self):
        if self.parent.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    got = corpus.collect([root])
    assert [f.path for f in got.files] == ["ok.py"]
    where = "locked/secret.py" if in_git else "locked"  # git lists files, not folders
    assert {s.path: s.reason for s in got.skipped} == {where: "unreadable (Permission denied)"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads folders whatever their mode")
def test_unreadable_sub_folder_for_real(tmp_path):
    root = _plain_tree(tmp_path)
    (root / "locked").chmod(0)
    try:
        got = corpus.collect([root])
    finally:
        (root / "locked").chmod(0o755)
    assert [f.path for f in got.files] == ["ok.py"]
    assert {s.path: s.reason for s in got.skipped} == {"locked": "unreadable (Permission denied)"}


# ---------------------------------------------------------------------------------------
# 2. one damaged manifest is named and set aside; it never breaks the other contexts

DAMAGE = {"list": "[]", "null": "null", "no fields": '{"format": 4}',
          "truncated": '{"format": 4, "ke', "old format": '{"format": 1, "name": "x"}',
          "not utf-8": b"\xff\xfe{"}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_manifest_is_named_and_set_aside(contexts, home, damage):
    bad = contexts["docs"]  # the most recently used: what a plain `ask` would take
    text = DAMAGE[damage]
    (bad / MANIFEST).write_bytes(text if isinstance(text, bytes) else text.encode())

    listed = json.loads(runner.invoke(app, ["list", "--json"]).output)
    assert [c["name"] for c in listed if not c.get("damaged")] == ["repo", "old"]
    [shown] = [c for c in listed if c.get("damaged")]
    assert shown["key"] == bad.name and shown["default"]  # a plain ask means it: it says so
    table = runner.invoke(app, ["list"])
    assert table.exit_code == 0 and "damaged" in table.output and bad.name[:8] in table.output

    with pytest.raises(ShardError, match=f"most recently used context \\({bad.name}\\) is "
                                         "damaged") as error:
        engine.ask(engine.AskOptions(question="who approved the budget"))
    assert f"starqa rm {bad.name}" in error.value.hint
    assert isinstance(runner.invoke(app, ["info"]).exception, ShardError)
    assert runner.invoke(app, ["info", "repo"]).exit_code == 0  # the others still work
    assert store.find_context(home / "contexts", "old").name == "old"

    usage = json.loads(runner.invoke(app, ["cache", "--json"]).output)
    assert usage["n_contexts"] == 2
    assert [Path(x["path"]).name for x in usage["leftovers"]] == [bad.name]
    assert usage["leftovers"][0]["state"].startswith("damaged: ")


def test_damaged_context_removed_by_rm_and_by_cache_clean(contexts, home):
    for folder in (contexts["docs"], contexts["repo"]):
        (folder / MANIFEST).write_text("[]")
    proc = starqa("rm", contexts["docs"].name[:6], home=home)  # by key prefix
    assert proc.returncode == 0, proc.stderr
    assert "Removed damaged context" in proc.stdout and "Traceback" not in proc.stderr
    assert not contexts["docs"].exists()
    assert runner.invoke(app, ["cache", "--clean"]).exit_code == 0
    assert not contexts["repo"].exists() and contexts["old"].exists()


def test_rm_all_removes_damaged_contexts_too(contexts, home):
    (contexts["old"] / MANIFEST).write_text("null")
    assert "Removed 3 contexts" in runner.invoke(app, ["rm", "--all", "--yes"]).output
    assert not any(folder.exists() for folder in contexts.values())


def test_manifest_naming_a_file_outside_its_folder_is_damaged(contexts, home):
    manifest = json.loads((contexts["old"] / MANIFEST).read_text())
    manifest["blocks"][0]["file"] = "../../../../etc/passwd"
    (contexts["old"] / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="names '../../../../etc/passwd'"):
        store.find_context(home / "contexts", "01d0")


# ---------------------------------------------------------------------------------------
# 3. `rm`, `info`, `ask` and `stop` never guess which context a name means


def test_empty_name_is_an_error_and_removes_nothing(contexts, home):
    proc = starqa("rm", "", home=home)
    assert proc.returncode == 1 and "context name is empty" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(folder.exists() for folder in contexts.values())
    with pytest.raises(StarqaError, match="empty"):
        store.find_context(home / "contexts", " ")


@pytest.mark.parametrize("by", ["key prefix", "name"])
def test_ambiguous_name_lists_the_matches_and_does_nothing(contexts, home, by):
    now = time.time()
    twins = [make_context(home, "twin", "abcd1111" + "0" * 8, now - 10),
             make_context(home, "twin", "abcd2222" + "0" * 8, now - 20, method="dense")]
    name = "abcd" if by == "key prefix" else "twin"
    proc = starqa("rm", name, home=home)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "matches 2 contexts" in proc.stderr
    assert twins[0].name in proc.stderr and twins[1].name in proc.stderr
    assert all(folder.exists() for folder in [*contexts.values(), *twins])
    for command in (["info", name], ["stop", name]):
        assert "matches 2" in str(runner.invoke(app, command).exception)
    with pytest.raises(StarqaError, match="matches 2"):
        engine.ask(engine.AskOptions(question="who", context=name))
    # a longer prefix, or the full key, picks one
    assert "Removed twin (abcd2222" in runner.invoke(app, ["rm", "abcd2"]).output
    assert store.find_context(home / "contexts", "twin").key == twins[0].name


# ---------------------------------------------------------------------------------------
# 5. ingest keeps room to ask; over-window errors offer fixes that can work


class Encoded(Exception):
    """Raised by the stand-in for the workers: the window check let the context through."""


def _context_tokens(docs: Path, model: Path) -> int:
    from starqa import models
    from starqa.corpus import prompt

    packed, spans = corpus.pack(corpus.collect([docs]).files)
    return len(prompt.tokenize_context(models.load_tokenizer(model), packed, spans).ids)


def test_ingest_keeps_room_for_a_question_and_an_answer(home, tiny_model, tmp_path,
                                                        monkeypatch):
    from tiny import make_tiny_model

    docs = tmp_path / "long"
    docs.mkdir()
    (docs / "a.md").write_text("the travel budget was approved by the office . " * 250)
    n = _context_tokens(docs, tiny_model)
    assert n > 2048  # so that the reserve is the full 512, not a quarter of the window
    model = make_tiny_model(tmp_path / "w", window=n + 100)  # fits alone, not with 512 more
    monkeypatch.setattr(flow, "run_phase1", lambda *a, **k: (_ for _ in ()).throw(Encoded()))
    opts = engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32")
    with pytest.raises(StarqaError) as error:
        engine.ingest(opts)
    assert f"{n:,} tokens + 512 reserved for a question and an answer = {n + 512:,} tokens > " \
           f"{n + 100:,} the model was trained on" in str(error.value)
    hint = error.value.hint
    assert "--reserve 100 or lower" in hint and "--beyond-window" in hint
    assert "--model qwen2.5-coder-1.5b: 32,768 tokens" in hint
    assert hint.count("use a model with a longer window") == 1  # one fix, every such model

    with pytest.raises(Encoded):  # a smaller reserve lets it through, from the option ...
        engine.ingest(replace(opts, reserve=100))
    result = runner.invoke(app, ["ingest", str(docs), "--model", str(model)],  # ... or the env
                           env={"STARQA_RESERVE": "64"})
    assert isinstance(result.exception, Encoded), result.output


def test_small_windows_reserve_a_quarter(home, docs, tiny_model, monkeypatch):
    """The tiny model's 512-token window holds the 186-token docs with 128 reserved."""
    monkeypatch.setattr(flow, "run_phase1", lambda *a, **k: (_ for _ in ()).throw(Encoded()))
    assert engine.default_reserve(512) == 128 and engine.default_reserve(8192) == 512
    with pytest.raises(Encoded):
        engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model)))


@pytest.mark.parametrize("room", [10, 0, -5])
def test_ask_over_window_suggests_max_new_tokens_only_when_it_helps(home, tiny_model, room):
    """A context made before the reserve, `room` tokens short of holding the question and a
    64-token answer... or the question alone (room <= 0)."""
    from starqa import models
    from starqa.corpus import prompt

    question = "who approved the travel budget"
    m = len(prompt.tokenize_query(models.load_tokenizer(tiny_model), question))
    folder = make_context(home, "full", "f011" + "0" * 12, time.time())
    manifest = read_manifest(folder)
    window = manifest.n_tokens + m + room
    write_manifest(folder, replace(manifest, model=ModelIdentity.of(
        tiny_model, manifest.model.spec, window, models.fingerprint(tiny_model))))

    with pytest.raises(StarqaError, match=f"> {window:,} the model was trained on") as error:
        engine.ask(engine.AskOptions(question=question, max_new_tokens=64, warm=False))
    if room > 0:
        assert f"--max-new-tokens {room} or lower" in error.value.hint
    else:  # no answer length fits: lowering it cannot help
        assert "--max-new-tokens" not in error.value.hint
        assert "shorter question" in error.value.hint


# ---------------------------------------------------------------------------------------
# 6. a cache hit verifies what it reuses; the re-ingest hint works from any folder


def _ingest(docs, model, **kw):
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                              block_size=60, **kw))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_cache_hit_reencodes_a_shard_with_a_flipped_byte(home, docs, tiny_model, fake_workers):
    first = _ingest(docs, tiny_model).manifest
    assert _ingest(docs, tiny_model).cache_hit and len(fake_workers) == 1
    shard = first.folder / first.blocks[1].file
    _flip_a_byte(shard)  # same size: the old size-only test took it for intact
    with pytest.raises(ShardError, match="fails its checksum"):
        shards.load_block(read_manifest(first.folder), 1)

    again = _ingest(docs, tiny_model, encode_in="group")
    assert not again.cache_hit and len(fake_workers) == 2
    assert fake_workers[-1]["todo"] == [1]  # the damaged block only (the others are intact)
    shards.load_block(again.manifest, 1)  # rebuilt: passes its checksum
    assert _ingest(docs, tiny_model).cache_hit and len(fake_workers) == 2


def test_cache_hit_rebuilds_a_manifest_whose_model_digest_was_edited(home, docs, tiny_model,
                                                                     fake_workers):
    folder = _ingest(docs, tiny_model).manifest.folder
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["model"]["digest"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StarqaError, match="does not match the model"):
        engine.manifest_model(read_manifest(folder), None)

    # Not a hit: the manifest is rebuilt. Its blocks come from the block store, which
    # addresses them by the real model's fingerprint, so none is encoded again (issue #14).
    again = _ingest(docs, tiny_model)
    assert not again.cache_hit and again.reuse.encoded == 0
    assert again.manifest.model.digest != "0" * 64
    engine.manifest_model(read_manifest(folder), None)  # the suggested fix fixed it


def test_cache_hit_does_not_rehash_unchanged_shards(home, docs, tiny_model, fake_workers,
                                                    monkeypatch):
    _ingest(docs, tiny_model)

    def no_hashing(path):
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(shards, "sha256_file", no_hashing)
    assert _ingest(docs, tiny_model).cache_hit  # sizes and times match what commit hashed


def test_rebuild_hint_works_when_pasted_in_another_folder(home, docs, tiny_model, fake_workers,
                                                          tmp_path, monkeypatch):
    import shlex
    import sys

    monkeypatch.chdir(docs.parent)
    args = ["ingest", docs.name, "--model", str(tiny_model), "--block-size", "60"]
    monkeypatch.setattr(sys, "argv", ["starqa", *args])
    assert runner.invoke(app, args).exit_code == 0
    manifest = store.find_context(home / "contexts", "docs")
    _flip_a_byte(manifest.folder / manifest.blocks[0].file)
    with pytest.raises(ShardError) as error:
        shards.load_block(manifest, 0)
    hint = error.value.hint.removeprefix("re-ingest to rebuild it: ")
    assert hint == f"cd {shlex.quote(str(docs.parent))} && starqa {shlex.join(args)}"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the user pastes it here: `cd DIR && starqa ARGS`
    cd, command = hint.split(" && ")
    monkeypatch.chdir(shlex.split(cd)[1])
    result = runner.invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0
    # Only the damaged block is encoded again (in this process: the others are reused).
    assert len(fake_workers) == 1 and "1 encoded" in result.output, result.output
    shards.load_block(store.find_context(home / "contexts", "docs"), 0)


# ---------------------------------------------------------------------------------------
# 7, 8. a warm group: malformed requests get an error and it keeps serving; rm stops it


@pytest.fixture
def warm_group(home, docs, tiny_model):
    """A real warm group of one worker (`starqa serve` in the background) on the tiny model."""
    from starqa.workers import client

    manifest = engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(tiny_model),
                                                  dtype="fp32", block_size=60)).manifest
    group = client.start(manifest.key, None, keepalive=120)
    yield manifest, group
    client.stop_group(manifest.key)


@pytest.mark.slow
def test_malformed_requests_get_an_error_and_the_group_keeps_serving(warm_group):
    from starqa.workers import client, messages

    manifest, group = warm_group
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
def test_rm_of_a_served_context_stops_its_group(warm_group):
    from starqa.workers import client

    manifest, group = warm_group
    result = runner.invoke(app, ["rm", manifest.key])
    assert result.exit_code == 0, result.output
    deadline = time.monotonic() + 30
    while client.find(manifest.key) is not None:
        assert time.monotonic() < deadline, "the group still runs after rm"
        time.sleep(0.2)
    assert not manifest.folder.exists()


# ---------------------------------------------------------------- 11: no pickle on the wire

_TORCH_OBJECT_COLLECTIVES = {"gather_object", "all_gather_object", "broadcast_object_list",
                             "scatter_object_list", "send_object_list", "recv_object_list"}


def _pickle_uses(path: Path) -> list[str]:
    """Imports of pickle (or its kin) and calls of torch.distributed's object collectives,
    however torch.distributed is aliased in the module."""
    import ast

    tree = ast.parse(path.read_text())
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
                    found.append(f"import {a.name}")
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in ("pickle", "_pickle", "dill", "cloudpickle"):
                found.append(f"from {mod} import")
            for a in node.names:
                if mod == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                if mod == "torch.distributed" and a.name in _TORCH_OBJECT_COLLECTIVES:
                    found.append(f"from torch.distributed import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _TORCH_OBJECT_COLLECTIVES:
            if ast.unparse(node.value) in aliases | {"torch.distributed"}:
                found.append(ast.unparse(node))
    return found


def test_no_module_pickles_or_uses_torch_object_collectives():
    package = Path(__file__).parents[1] / "starqa"
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 10
    found = {str(p.relative_to(package)): uses for p in modules if (uses := _pickle_uses(p))}
    assert found == {}


def test_pickle_use_detector_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch.distributed as td\nfrom torch import "
                   "distributed as d2\ntd.broadcast_object_list([1])\nd2.gather_object(1, [])\n")
    assert _pickle_uses(bad) == ["import pickle", "td.broadcast_object_list",
                                 "d2.gather_object"]


_JSON_RANKS = """
import json, os
from starqa.runtime import dist
from starqa.phase2 import sources
info = dist.init("cpu")
r = info.rank
part = {f"doc{r}.md": {1: 0.5, 10 + r: 0.25}, "shared.py": {3: 1.0}}
gathered = dist.gather_object(info, part, dst=1)
request = {"op": "ask", "query_ids": [1, 2, 3], "nested": {5: {"x": None, "s": "é—✓"}},
           "max_new_tokens": 4} if r == 1 else None
got = dist.broadcast_object(info, request, src=1)
with open(os.path.join(os.environ["OUT_DIR"], f"rank{r}.json"), "w") as f:
    keys = lambda parts: sorted({type(k).__name__ for p in parts for v in p.values() for k in v})
    json.dump({"rank": r, "gathered": gathered, "request": got,
               "types": keys(gathered or []) + [type(next(iter(got["nested"]))).__name__]
               + keys([sources.add(gathered or [])]),
               "sum": sources.add(gathered) if gathered else None,
               "traffic": info.traffic.as_dict()["by_op"]}, f)
dist.barrier(info)
os._exit(0)
"""


def test_objects_cross_two_gloo_ranks_as_json(tmp_path):
    """Two real gloo ranks: nested dicts with int keys gathered and broadcast; they arrive
    as JSON (int keys as strings) and sources.add turns the lines back into ints."""
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_JSON_RANKS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1",
           "OUT_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["gathered"] is None
    # the keys as the ranks saw them: strings after the wire, ints again after sources.add
    assert ranks[1]["types"] == ["str", "str", "int"] and ranks[0]["types"] == ["str"]
    assert ranks[1]["gathered"] == [{"doc0.md": {"1": 0.5, "10": 0.25}, "shared.py": {"3": 1.0}},
                                    {"doc1.md": {"1": 0.5, "11": 0.25}, "shared.py": {"3": 1.0}}]
    assert ranks[1]["sum"] == {"doc0.md": {"1": 0.5, "10": 0.25}, "shared.py": {"3": 2.0},
                               "doc1.md": {"1": 0.5, "11": 0.25}}  # printed as JSON again
    want = {"op": "ask", "query_ids": [1, 2, 3], "nested": {"5": {"x": None, "s": "é—✓"}},
            "max_new_tokens": 4}
    assert ranks[0]["request"] == ranks[1]["request"] == want
    sent = len(json.dumps({"doc0.md": {1: 0.5, 10: 0.25}, "shared.py": {3: 1.0}},
                          separators=(",", ":")).encode())
    assert ranks[0]["traffic"]["gather_object"] == {"calls": 1, "sent": sent, "received": 0}
    assert ranks[1]["traffic"]["gather_object"] == {"calls": 1, "sent": 0, "received": sent}


def test_sources_add_takes_lines_gathered_as_json():
    from starqa.runtime import dist
    from starqa.phase2 import sources

    info = dist.local_world()
    parts = dist.gather_object(info, {"a.py": {2: 0.5, 7: 0.25}}, dst=0)
    assert parts == [{"a.py": {"2": 0.5, "7": 0.25}}]  # as across ranks
    assert sources.add(parts + [{"a.py": {2: 0.5}}]) == {"a.py": {2: 1.0, 7: 0.25}}
    assert sources.top_sources(sources.add(parts))[0]["lines"] == [2, 2]


# ---------------------------------------------------------------- 9: concurrent commits

def _default_signals() -> None:
    """A pool worker's signal handlers: the defaults, whatever the forking process had."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def _commit_many(root: str, key: str, template: str, manifest, n: int,
                 replace_existing: bool) -> list[str]:
    """`n` commits of context `key` (`manifest`) from copies of the folder `template`, in this
    (forked) process."""
    errors = []
    for _ in range(n):
        try:
            staging = store.staging_dir(Path(root), key)
            shutil.copytree(template, staging, dirs_exist_ok=True)
            store.commit(staging, Path(root) / key, manifest, replace_existing=replace_existing)
        except Exception as error:  # noqa: BLE001 (the test reports every one)
            errors.append(repr(error))
    return errors


@pytest.mark.parametrize("replace_existing", [False, True], ids=["keep", "replace"])
def test_concurrent_commits_of_one_context(home, tmp_path, replace_existing):
    """8 processes x 20 commits of the same key: no error, one intact context, no leftovers
    (before the lock, the two renames of one commit interleaved with another's: OSError)."""
    import multiprocessing

    key = "c0ffee" + "0" * 10
    template = make_context(home, "docs", key, time.time())
    manifest = read_manifest(template)
    shutil.move(template, tmp_path / "template")
    root = home / "contexts"
    # The workers take the default signal handlers (a forked worker inherits the test
    # process's, whatever an earlier test left) and end by closing the pool, not by its
    # terminate: a worker that caught terminate's SIGTERM once hung the suite in its exit,
    # waiting on the pool's queue (an in-process `cli.main` then left its handler behind).
    with multiprocessing.get_context("fork").Pool(8, initializer=_default_signals) as pool:
        results = pool.starmap(_commit_many, [(str(root), key, str(tmp_path / "template"),
                                               manifest, 20, replace_existing)] * 8, chunksize=1)
        pool.close()
        pool.join()
    assert [e for errors in results for e in errors] == []
    manifest = read_manifest(root / key)
    shards.verify_checksums(manifest)  # every shard matches the hash committed with it
    assert sorted(p.name for p in (root / key).iterdir() if p.name.startswith("block_")) == \
        [block_file(0), block_file(1)]
    assert store.find_leftovers(root) == []
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [key]


def test_second_identical_ingest_waits_and_is_a_cache_hit(home, docs, tiny_model,
                                                          fake_workers, monkeypatch):
    """Two ingests of the same input at once: the second waits for the first's lock and
    reuses its context instead of encoding everything again."""
    import threading

    encode = steps.run_workers

    def slow_workers(job, launch, on_event):
        time.sleep(1.0)  # the second ingest arrives while the first encodes
        encode(job, launch, on_event)

    monkeypatch.setattr(steps, "run_workers", slow_workers)
    results, errors = [], []

    def one():
        try:
            results.append(_ingest(docs, tiny_model))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(fake_workers) == 1
    assert sorted(r.cache_hit for r in results) == [False, True]
    assert results[0].manifest.key == results[1].manifest.key
    shards.verify_checksums(read_manifest(results[1].manifest.folder))


# ---------------------------------------------------------------- 4: workers die with it

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


def test_name_given_on_a_cache_hit_renames_the_context(home, docs, tiny_model, fake_workers):
    """`--name` is not ignored when the input is already cached (issue #11, item 10)."""
    first = _ingest(docs, tiny_model, name="first")
    hit = _ingest(docs, tiny_model, name="second")
    assert hit.cache_hit and hit.manifest.key == first.manifest.key
    assert hit.manifest.name == "second"
    assert read_manifest(hit.manifest.folder).name == "second"
    assert store.find_context(paths.contexts_dir(), "second").key == first.manifest.key
    assert _ingest(docs, tiny_model).manifest.name == "second"  # no --name: kept


def test_ingest_on_a_gpu_without_bf16_encodes_in_fp16(home, docs, tiny_model, fake_workers,
                                                       monkeypatch):
    """The default dtype is chosen for the device ingest runs on (`auto`: the GPU torch
    sees), so a GPU without bf16 gets fp16; it was chosen for the CPU, so such GPUs got bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    gpu = _ingest(docs, tiny_model, workers=1).manifest
    assert fake_workers[0]["dtype"] == gpu.dtype == "float16"
    cpu = _ingest(docs, tiny_model, workers=1, device="cpu").manifest
    assert fake_workers[1]["dtype"] == cpu.dtype == "bfloat16" and cpu.key != gpu.key


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_names_the_cpu_fix(home, docs, tiny_model):
    """`--device cuda` where torch sees no GPU: a clear error before any worker starts."""
    from starqa.runtime.launch import check_gpus

    with pytest.raises(StarqaError, match="no CUDA GPU") as err:
        check_gpus("cuda", 2)
    assert "--device cpu" in err.value.hint
    check_gpus("auto", 2)  # auto falls back to the CPU quietly
    check_gpus("cpu", 2)


def test_asking_with_another_embedded_model_fails_before_fetching_it(home, monkeypatch):
    """A context made with one embedded model, asked with another: the error comes from the
    manifest's recorded model name, before the other model is downloaded and converted."""
    from starqa.cache import manifest as manifest_mod
    from starqa import models

    folder = make_context(home, "notes", "k" * 16, time.time())
    recorded = manifest_mod.read_manifest(folder)
    made = replace(recorded, model=replace(recorded.model, spec="smollm2-135m", name="smollm2-135m"))
    manifest_mod.write_manifest(folder, made)

    def no_download(model):
        raise AssertionError(f"{model.name} was fetched")

    monkeypatch.setattr(models, "ensure_embedded", no_download)
    with pytest.raises(StarqaError, match="ingested with smollm2-135m; --model asks for "
                                          "qwen2.5-coder-1.5b") as err:
        engine.manifest_model(manifest_mod.read_manifest(folder), "qwen2.5-coder-1.5b")
    assert "--model smollm2-135m" in err.value.hint


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
def test_a_deleted_local_model_is_named_as_such(home, docs, tmp_path):
    """The local model folder a context was made with, deleted: the error says that folder
    is gone and how to go on, instead of 'Model not found'."""
    from tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "gone-model")
    engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                       workers=1))
    shutil.rmtree(model)
    with pytest.raises(StarqaError, match="ingested with the model at .*gone-model, which is "
                                          "no longer there") as err:
        engine.ask(engine.AskOptions(question="who", max_new_tokens=2))
    assert "--model PATH" in err.value.hint
