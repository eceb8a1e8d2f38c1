"""Git and file selection on hostile or odd folders (issue #45 items 1, 7, 8, 9, 12, and the
campaign after it): a repository's config runs nothing, files are those under the path the
user named, any depth walks, starqa's cache is never ingested. Through the CLI, with the
tiny model of `tiny.py` and the workers replaced by a stand-in that commits shards.
"""

import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from starqa import corpus
from starqa.corpus import selection
from starqa.core import paths
from starqa.cache import store
from starqa.corpus import watch as watch_mod
from starqa.cli import app
from starqa.core.errors import StarqaError

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
runner = CliRunner()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout


def committed(folder: Path, files: dict[str, str]) -> Path:
    """A repository at `folder` whose one commit holds `files` ({path: text})."""
    folder.mkdir(parents=True, exist_ok=True)
    git(folder, "init", "-q")
    for name, text in files.items():
        (folder / name).write_text(text)
    git(folder, "add", ".")
    git(folder, "commit", "-qm", "m")
    return folder


def ingest(folder: Path, model: Path, *extra: str):
    return runner.invoke(app, ["ingest", str(folder), "--model", str(model), "--dtype", "fp32",
                               "--block-size", "40", "--reserve", "64", *extra])


def ingested(name: str) -> list[str]:
    return sorted(f.path for f in store.find_context(paths.contexts_dir(), name).files)


# ---------------------------------------------------------------------------------------
# 1. a repository's config runs nothing: every key that names a program, every way in

# The keys of git's config that name a program (git 2.39's documentation), each set to a
# program that leaves a marker named after it.
PROGRAM_KEYS = (
    "core.fsmonitor", "core.pager", "core.sshCommand", "core.editor", "core.askPass",
    "core.alternateRefsCommand", "core.gitProxy", "sequence.editor", "diff.external",
    "credential.helper", "gpg.program", "gpg.openpgp.program", "gpg.ssh.program",
    "gpg.x509.program", "uploadpack.packObjectsHook", "filter.clean.clean",
    "filter.clean.smudge", "filter.proc.process", "diff.drv.textconv", "diff.drv.command",
    "merge.drv.driver", "pager.log", "pager.ls-files", "alias.ls-files",
)
HOOKS = ("pre-commit", "post-commit", "post-checkout", "post-index-change", "pre-auto-gc",
         "reference-transaction", "fsmonitor-watchman", "post-rewrite", "pre-push")
ATTRIBUTES = "*.md filter=clean diff=drv merge=drv\n*.txt filter=proc diff=drv\n"


def marker_program(bin_dir: Path, marks: Path, name: str) -> str:
    program = bin_dir / name
    program.write_text(f"#!/bin/sh\ntouch '{marks / name}'\nexit 1\n")
    program.chmod(0o755)
    return str(program)


def arm(dot_git: Path, bin_dir: Path, marks: Path) -> None:
    """Make the repository at `dot_git` name a marker program in every such key, its hooks
    (both .git/hooks and core.hooksPath), and an `ext::` promisor remote."""
    bin_dir.mkdir(exist_ok=True)
    marks.mkdir(exist_ok=True)
    lines = []
    for key in PROGRAM_KEYS:
        section, _, name = key.rpartition(".")
        head, _, sub = section.partition(".")
        lines.append(f'[{head} "{sub}"]' if sub else f"[{head}]")
        bang = "!" if head == "alias" else ""  # an alias that runs a shell command
        lines.append(f"\t{name} = {bang}{marker_program(bin_dir, marks, key)}")
    hooks_path = dot_git / "other-hooks"
    for folder in (dot_git / "hooks", hooks_path):
        folder.mkdir(exist_ok=True)
        for hook in HOOKS:
            shutil.copy(marker_program(bin_dir, marks, f"hook.{hook}"), folder / hook)
    ext = marker_program(bin_dir, marks, "protocol.ext")
    lines += ["[filter \"clean\"]", "\trequired = true", "[log]", "\tshowSignature = true",
              "[core]", f"\thooksPath = {hooks_path}", "\trepositoryformatversion = 1",
              "[extensions]", "\tpartialClone = origin",
              "[protocol \"ext\"]", "\tallow = always", "[protocol]", "\tallow = always",
              "[remote \"origin\"]", f"\turl = ext::{ext}", "\tpromisor = true",
              "[status]", "\tshowUntrackedFiles = all"]
    with open(dot_git / "config", "a") as fh:
        fh.write("\n".join(lines) + "\n")


FILES = {"a.md": "the star answer", "b.txt": "the block query", "sub/c.md": "the long context"}


def hostile(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """(the folder to ingest, the marker folder) for one way a hostile repository arrives."""
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q")
    for rel, text in FILES.items():
        (src / rel).parent.mkdir(exist_ok=True)
        (src / rel).write_text(text)
    (src / ".gitattributes").write_text(ATTRIBUTES)
    git(src, "add", ".")
    git(src, "commit", "-qm", "one")
    (src / "sub" / "c.md").write_text("the long context answer")  # a second commit
    git(src, "commit", "-qam", "two")
    tree = git(src, "rev-parse", "HEAD~1:sub").strip()  # an object gone: a lazy fetch
    (src / ".git" / "objects" / tree[:2] / tree[2:]).unlink()
    marks = tmp_path / "marks"
    arm(src / ".git", tmp_path / "bin", marks)
    for path in src.rglob("*.*"):  # every tracked file stat-dirty, its bytes the same
        if ".git" not in path.parts[len(src.parts):]:
            os.utime(path, (1_800_000_000, 1_800_000_000))
    if how == "dirty":
        return src, marks
    if how == "untarred":
        archive = tmp_path / "r.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(src, arcname="r")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path / "untarred")
        return tmp_path / "untarred" / "r", marks
    work = tmp_path / "work"  # a `.git` file: the config lies outside the folder
    shutil.copytree(src, work, ignore=shutil.ignore_patterns(".git"))
    (work / ".git").write_text(f"gitdir: {src / '.git'}\n")
    if how == "worktree":  # the config points the work tree elsewhere
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "decoy.md").write_text("the decoy")
        with open(src / ".git" / "config", "a") as fh:
            fh.write(f"[core]\n\tworktree = {elsewhere}\n")
    return work, marks


def test_the_markers_work_when_git_itself_runs(tmp_path):
    """The test below is not vacuous: plain git in such a repository runs the programs."""
    folder, marks = hostile(tmp_path, "dirty")
    for command in (["status"], ["diff", "HEAD"], ["log", "--name-only", "-n3"]):
        subprocess.run(["git", *command], cwd=folder, capture_output=True, check=False,
                       stdin=subprocess.DEVNULL, timeout=60)
    ran = {p.name for p in marks.iterdir()}
    assert {"core.fsmonitor", "protocol.ext"} <= ran, ran
    assert ran & {"filter.clean.clean", "filter.proc.process"}, ran


def watch_once(monkeypatch, edit) -> list[int]:
    """`ingest --watch` stops after its first re-ingest (`edit` is repeated until then)."""
    real = watch_mod.watch
    done: list[int] = []

    def once(selection, reingest, on_error, **kw):
        stop = threading.Event()

        def reingest_then_stop():
            reingest()
            done.append(1)
            stop.set()

        def editing():
            while not stop.wait(1.0):
                edit()

        threading.Thread(target=editing, daemon=True).start()
        threading.Thread(target=lambda: stop.wait(60) or stop.set(), daemon=True).start()
        real(selection, reingest_then_stop, on_error, quiet_ms=200, stop_event=stop)
        raise KeyboardInterrupt

    monkeypatch.setattr(watch_mod, "watch", once)
    return done


@pytest.mark.parametrize("how", ["dirty", "untarred", "gitfile", "worktree"])
def test_a_hostile_repository_runs_nothing(home, tiny_model, fake_workers, tmp_path,
                                           monkeypatch, how):
    folder, marks = hostile(tmp_path, how)
    expected = sorted(FILES)

    first = ingest(folder, tiny_model)
    assert first.exit_code == 0, first.output
    assert ingested(folder.name) == expected  # the folder's own files, whatever the config
    assert ".gitattributes" not in first.output or "hidden" in first.output
    again = ingest(folder, tiny_model)  # a re-ingest: a cache hit
    assert again.exit_code == 0 and "cache" in again.output.lower(), again.output
    (folder / "a.md").write_text("the star answer query")
    assert ingest(folder, tiny_model).exit_code == 0  # an incremental re-ingest
    done = watch_once(monkeypatch, lambda: (folder / "b.txt").write_text(
        f"the block query {time.monotonic()}"))
    watched = ingest(folder, tiny_model, "--watch")
    assert watched.exit_code == 0 and done == [1], watched.output
    for command in (["list"], ["info", folder.name], ["list", "--json"]):
        assert runner.invoke(app, command).exit_code == 0

    assert sorted(p.name for p in marks.iterdir()) == []
    assert ingested(folder.name) == expected


def test_git_runs_only_commands_that_never_read_work_tree_content(tmp_path, monkeypatch):
    """The structural guarantee: the git commands `collect` runs are reads of the index,
    objects and refs (no diff, status or refresh, which hash files through filters)."""
    folder, _ = hostile(tmp_path, "dirty")
    seen = []
    real_run = subprocess.run

    def record(cmd, *a, **k):
        if cmd[0] == "git":
            seen.append(next(c for c in cmd[1:] if not c.startswith("--") and "=" not in c
                             and c != "-c"))
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", record)
    corpus.collect([folder])
    assert set(seen) <= {"rev-parse", "check-ignore", "ls-files", "ls-tree", "log"}, seen


def test_commit_times_are_kept_without_asking_git_about_the_work_tree(tmp_path):
    """A file left as committed keeps its commit's time (packing order), though stat-dirty;
    an edited one takes its mtime. Also in a sha256 repository."""
    for fmt in ("sha1", "sha256"):
        repo = tmp_path / fmt
        repo.mkdir()
        git(repo, "init", "-q", f"--object-format={fmt}")
        (repo / "kept.md").write_text("kept")
        (repo / "edited.md").write_text("edited")
        git(repo, "add", ".")
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                        "m"], cwd=repo, check=True,
                       env={**os.environ, "GIT_COMMITTER_DATE": "1700000000 +0000"})
        (repo / "edited.md").write_text("edited again")
        for p in repo.glob("*.md"):
            os.utime(p, (1_800_000_000, 1_800_000_000))
        got = {f.path: f.changed for f in corpus.collect([repo]).files}
        assert got == {"kept.md": 1_700_000_000, "edited.md": 1_800_000_000}, fmt


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
# 9. files are those under the path the user named, whatever the config says


def test_core_worktree_elsewhere_keeps_the_folders_files(home, tiny_model, fake_workers,
                                                         tmp_path):
    repo = committed(tmp_path / "repo", {"real.md": "the star answer"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".gitattributes").write_text("*.md text\n")
    (elsewhere / "decoy.md").write_text("the decoy")
    git(repo, "config", "core.worktree", str(elsewhere))
    result = ingest(repo, tiny_model)
    assert result.exit_code == 0, result.output
    assert ingested("repo") == ["real.md"]
    assert "decoy" not in result.output and ".gitattributes" not in result.output


def test_a_git_file_reports_only_what_is_in_the_folder(home, tiny_model, fake_workers,
                                                       tmp_path):
    store_ = committed(tmp_path / "store", {".gitattributes": "*.md text\n",
                                            "a.md": "the star answer"})
    work = tmp_path / "work"
    work.mkdir()
    (work / ".git").write_text(f"gitdir: {store_ / '.git'}\n")
    (work / "a.md").write_text("the star answer")
    (work / "new.md").write_text("the new query")
    result = ingest(work, tiny_model)
    assert result.exit_code == 0, result.output
    assert ingested("work") == ["a.md", "new.md"]
    assert ".gitattributes" not in result.output  # not in the folder: not reported


# ---------------------------------------------------------------------------------------
# 7. any depth of folders walks


def test_thousands_of_nested_folders_walk(home, tiny_model, fake_workers, tmp_path):
    top = tmp_path / "deep"
    d = str(top)
    os.mkdir(d)
    for _ in range(1100):  # one at a time: os.makedirs itself recurses
        d += "/d"
        os.mkdir(d)
    Path(d, "bottom.md").write_text("the star answer")
    (top / "top.md").write_text("the block query")
    try:
        result = ingest(top, tiny_model, "--beyond-window")  # its path alone: 2,000 tokens
        assert result.exit_code == 0, result.output
        assert ingested("deep") == sorted(["top.md", "d/" * 1100 + "bottom.md"])
    finally:
        remove_deep(top)


def remove_deep(top: Path) -> None:
    """Remove a deep chain of folders bottom-up (shutil.rmtree, pytest's too, recurses)."""
    chain = [str(top)]
    while os.path.isdir(chain[-1] + "/d"):
        chain.append(chain[-1] + "/d")
    for d in reversed(chain):
        for entry in os.scandir(d):
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        os.rmdir(d)


# ---------------------------------------------------------------------------------------
# 8. starqa's cache is never ingested, and the report says so


@pytest.mark.parametrize("in_git", [False, True])
def test_a_cache_inside_the_folder_is_skipped(tiny_model, fake_workers, tmp_path, monkeypatch,
                                              in_git):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("the star answer")
    if in_git:
        git(folder, "init", "-q")
        git(folder, "add", ".")
    monkeypatch.setenv("STARQA_HOME", str(folder / "cache"))
    (folder / "cache" / "models").mkdir(parents=True)  # a model converted before
    (folder / "cache" / "models" / "config.json").write_text('{"the": "star"}')
    first = ingest(folder, tiny_model)
    assert first.exit_code == 0, first.output
    assert f"cache: {corpus.CACHE}" in " ".join(first.output.split()), first.output
    second = ingest(folder, tiny_model)  # its own first manifest is in the folder now
    assert second.exit_code == 0, second.output
    assert "cache" in second.output.lower() and "hit" in second.output.lower(), second.output
    assert ingested("docs") == ["a.md"]
    info = runner.invoke(app, ["info", "docs", "--json"])
    skipped = {s["path"]: s["reason"] for s in json.loads(info.output)["skipped"]}
    assert skipped == {"cache": corpus.CACHE}


# ---------------------------------------------------------------------------------------
# 12. an --include that matches nothing; submodules and nested repositories named


@pytest.mark.parametrize("pattern, fix", [("*.MD", "--include '*.md'"),
                                          ("", "--include '*.md'"),
                                          ("*.rst", "--include '*.md'")])
def test_include_matching_nothing_says_what_was_found(home, tiny_model, fake_workers, tmp_path,
                                                      pattern, fix):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.md", "b.md", "c.py"):
        (folder / name).write_text("the star")
    err = ingest(folder, tiny_model, "--include", pattern).exception  # printed by cli.main
    assert isinstance(err, StarqaError)
    text = f"{err} {err.hint}"
    assert "no files found" not in text and "3 file(s) found" in text, text
    assert "2 .md" in text and fix in text
    fixed = ingest(folder, tiny_model, *fix.replace("'", "").split())  # the hint, pasted
    assert fixed.exit_code == 0 and ingested("docs") == ["a.md", "b.md"], fixed.output


def test_submodules_and_nested_repositories_get_a_line(home, tiny_model, fake_workers,
                                                       tmp_path):
    inner = committed(tmp_path / "inner", {"x.md": "the inner"})
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    (outer / "a.md").write_text("the star answer")
    git(outer, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(inner), "mod")
    shutil.copytree(inner, outer / "nested")  # untracked, a repository of its own
    result = ingest(outer, tiny_model)
    assert result.exit_code == 0, result.output
    assert ingested("outer") == ["a.md"]
    info = json.loads(runner.invoke(app, ["info", "outer", "--json"]).output)
    skipped = {s["path"]: s["reason"] for s in info["skipped"]}
    assert skipped["mod"] == corpus.SUBMODULE and skipped["nested"] == corpus.NESTED


# ---------------------------------------------------------------------------------------
# campaign: odd folders and files a user meets


def skipped_of(name: str) -> dict[str, str]:
    info = json.loads(runner.invoke(app, ["info", name, "--json"]).output)
    return {s["path"]: s["reason"] for s in info["skipped"]}


@pytest.mark.parametrize("in_git", [False, True])
def test_names_that_are_not_utf8_are_skipped_and_named(home, tiny_model, fake_workers, tmp_path,
                                                       in_git):
    """A file name with bytes that are not UTF-8 (an old Latin-1 archive) was a
    UnicodeEncodeError traceback when the context was hashed."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "ok.md").write_text("the star answer")
    with open(os.fsencode(folder) + b"/caf\xe9.md", "wb") as fh:
        fh.write(b"the block query")
    if in_git:
        git(folder, "init", "-q")
        git(folder, "add", ".")
    result = ingest(folder, tiny_model)
    assert result.exit_code == 0, result.exception or result.output
    assert ingested("docs") == ["ok.md"]
    assert skipped_of("docs") == {"caf\\xe9.md": corpus.NOT_UTF8_NAME}


def test_a_fifo_put_in_a_files_place_is_skipped_not_waited_on(home, tiny_model, fake_workers,
                                                              tmp_path, monkeypatch):
    """A file replaced by a named pipe between the walk and the read: reading it waited for
    a writer forever."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("the star answer")
    (folder / "b.md").write_text("the block query")
    real_read = selection._read

    def swap_then_read(path, *args, **kw):
        if path.name == "b.md" and path.is_file():
            path.unlink()
            os.mkfifo(path)
        return real_read(path, *args, **kw)

    monkeypatch.setattr(selection, "_read", swap_then_read)
    got = []
    worker = threading.Thread(target=lambda: got.append(ingest(folder, tiny_model)), daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # let the stuck read go, then fail
        os.close(os.open(folder / "b.md", os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("ingest waited on a FIFO")
    assert got[0].exit_code == 0, got[0].output
    assert ingested("docs") == ["a.md"] and skipped_of("docs") == {"b.md": "not a regular file"}


def test_a_file_growing_while_read_is_held_to_the_cap(home, tiny_model, fake_workers, tmp_path,
                                                      monkeypatch):
    """A log still being written: it grew past --max-file-size between the size check and
    the read, and all of it was ingested."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("the star answer")
    (folder / "grows.md").write_text("the block")
    real_stat = Path.stat

    def stat_then_grow(self, *args, **kw):
        got = real_stat(self, *args, **kw)
        if self.name == "grows.md":
            with open(self, "a") as fh:
                fh.write(" the block" * 500)
        return got

    monkeypatch.setattr(Path, "stat", stat_then_grow)
    result = ingest(folder, tiny_model, "--max-file-size", "1000")
    assert result.exit_code == 0, result.output
    assert ingested("docs") == ["a.md"]
    assert skipped_of("docs")["grows.md"].startswith("too large")


def test_a_bare_repository_says_so_and_its_hint_works(home, tiny_model, fake_workers, tmp_path,
                                                      monkeypatch):
    """A bare repository (`x.git`): its HEAD, config and hook samples were ingested as if
    they were the project."""
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q")
    (src / "a.md").write_text("the star answer")
    git(src, "add", ".")
    git(src, "commit", "-qm", "m")
    git(tmp_path, "clone", "-q", "--bare", str(src), "x.git")
    monkeypatch.chdir(tmp_path)
    err = ingest(Path("x.git"), tiny_model).exception
    assert isinstance(err, StarqaError) and "bare git repository" in str(err), err
    assert err.hint == "git clone x.git x-files && starqa ingest x-files"
    git(tmp_path, "clone", "-q", "x.git", "x-files")  # the hint, pasted
    assert ingest(Path("x-files"), tiny_model).exit_code == 0
    assert ingested("x-files") == ["a.md"]


def test_a_damaged_index_is_named_and_the_hint_repairs_it_running_nothing(
        home, tiny_model, fake_workers, tmp_path):
    """A truncated .git/index: `git ls-files failed` with git's message as the hint; the
    fix a user would reach for (`git status`, `git reset`) runs the repository's programs."""
    folder, marks = hostile(tmp_path, "dirty")
    (folder / ".git" / "index").write_bytes(b"DIRC\0\0")
    err = ingest(folder, tiny_model).exception
    assert isinstance(err, StarqaError) and "index file smaller" in str(err), err
    assert err.hint.count("git -C") == 1
    fix = err.hint[err.hint.index("git -C"):]
    subprocess.run(fix, shell=True, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    assert ingest(folder, tiny_model).exit_code == 0
    assert ingested(folder.name) == sorted(FILES)
    assert sorted(p.name for p in marks.iterdir()) == []


def test_symlink_loops_git_tracks_get_a_line(home, tiny_model, fake_workers, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    git(folder, "init", "-q")
    (folder / "a.md").write_text("the star answer")
    os.symlink("l2", folder / "l1")
    os.symlink("l1", folder / "l2")
    os.symlink("gone.md", folder / "broken")
    git(folder, "add", ".")
    assert ingest(folder, tiny_model).exit_code == 0
    assert skipped_of("docs") == {"l1": "symlink loop", "l2": "symlink loop",
                                  "broken": "broken symlink"}
