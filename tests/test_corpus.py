"""Tests for corpus selection (git and plain folders) and packing with spans."""

import os
import subprocess
from pathlib import Path

import pytest

from fakes import needs_git
from starqa.corpus import git as corpus_git
from starqa.corpus import FileSpan, TextFile, collect, content_hash, line_of, pack
from starqa.core.errors import StarqaError


def write(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def paths(corpus) -> list[str]:
    return [f.path for f in corpus.files]


def reasons(corpus) -> dict[str, str]:
    return {s.path: s.reason for s in corpus.skipped}


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t",
                    "-c", "commit.gpgsign=false", *args], cwd=repo, check=True,
                   capture_output=True)


# ---------------------------------------------------------------- selection


def test_plain_folder(tmp_path):
    write(tmp_path, {"b.py": "print(1)\n", "a.md": "# A\n", "sub/c.txt": "c"})
    corpus = collect([tmp_path])
    assert paths(corpus) == ["a.md", "b.py", "sub/c.txt"]
    assert corpus.roots == (str(tmp_path.resolve()),)
    assert corpus.files[1].text == "print(1)\n" and corpus.files[1].size == 9
    assert corpus.skipped == ()


def test_nested_gitignore_outside_git(tmp_path):
    write(tmp_path, {
        ".gitignore": "*.log\nbuild/\n",
        "keep.py": "x",
        "run.log": "log",
        "build/out.py": "x",
        "build/deep/more.py": "x",
        "pkg/.gitignore": "secret.txt\n!important.log\n",
        "pkg/secret.txt": "s",
        "pkg/important.log": "i",
        "pkg/mod.py": "m",
        "other/secret.txt": "not ignored here",
    })
    corpus = collect([tmp_path])
    assert paths(corpus) == ["keep.py", "other/secret.txt", "pkg/important.log", "pkg/mod.py"]
    why = reasons(corpus)
    assert why["run.log"] == "ignored by .gitignore"
    assert why["build"] == "ignored by .gitignore"  # the folder once, not each file
    assert not any(p.startswith("build/") for p in why)
    assert why["pkg/secret.txt"] == "ignored by .gitignore"


@needs_git
def test_git_repo(tmp_path):
    write(tmp_path, {
        ".gitignore": "*.log\nnode_modules/\n",
        "tracked.py": "t",
        "sub/.gitignore": "gen.py\n",
        "sub/gen.py": "generated",
        "sub/kept.py": "k",
        "node_modules/lib.js": "x",
    })
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    write(tmp_path, {"forced.log": "tracked despite the ignore rule"})
    git(tmp_path, "add", "-f", "forced.log")
    git(tmp_path, "commit", "-q", "-m", "init")
    write(tmp_path, {"untracked.py": "u", "debug.log": "d", "sub/gen2.py": "g"})
    corpus = collect([tmp_path])
    # forced.log is tracked, so git (not the .gitignore) decides: only git mode includes it.
    assert paths(corpus) == ["forced.log", "sub/gen2.py", "sub/kept.py", "tracked.py",
                             "untracked.py"]
    why = reasons(corpus)
    assert why["debug.log"] == "ignored by .gitignore"
    assert why["sub/gen.py"] == "ignored by .gitignore"
    assert why["node_modules"] == "ignored by .gitignore"
    assert why[".gitignore"] == "hidden"
    assert not any(p.startswith(".git/") or p == ".git" for p in why)

    # A subfolder of the repository: paths are relative to it, its .gitignore still applies.
    sub = collect([tmp_path / "sub"])
    assert paths(sub) == ["gen2.py", "kept.py"]

    # A folder the repository ignores is still walked when named, honouring .gitignores in it.
    ignored = collect([tmp_path / "node_modules"])
    assert paths(ignored) == ["lib.js"]


def test_without_git_binary(tmp_path, monkeypatch):
    write(tmp_path, {".gitignore": "*.log\n", "a.py": "a", "b.log": "b"})
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # `git` cannot be found
    corpus = collect([tmp_path])
    assert paths(corpus) == ["a.py"]
    assert reasons(corpus)["b.log"] == "ignored by .gitignore"


def test_hidden_skipped(tmp_path):
    write(tmp_path, {"a.py": "a", ".env": "SECRET=1", ".cache/x.py": "x", ".cache/y.py": "y"})
    corpus = collect([tmp_path])
    assert paths(corpus) == ["a.py"]
    assert reasons(corpus) == {".env": "hidden", ".cache": "hidden"}


def test_binary_too_large_bad_utf8_empty_lock(tmp_path):
    write(tmp_path, {
        "ok.txt": "fine",
        "img.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00",
        "big.txt": "x" * 2_000,
        "latin1.txt": "caf\xe9".encode("latin-1"),
        "blank.txt": "  \n\n",
        "poetry.lock": "[[package]]",
        "web/package-lock.json": "{}",
    })
    corpus = collect([tmp_path], max_file_bytes=1_000)
    assert paths(corpus) == ["ok.txt"]
    assert reasons(corpus) == {
        "img.png": "binary (NUL byte)",
        "big.txt": "too large (2.0 KB > 1.0 KB cap)",
        "latin1.txt": "not UTF-8",
        "blank.txt": "empty",
        "poetry.lock": "lock file",
        "web/package-lock.json": "lock file",
    }


def test_too_large_is_not_read(tmp_path, monkeypatch):
    write(tmp_path, {"small.txt": "s", "huge.txt": "h" * 5_000})
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open",
                        lambda p, *a, **k: opened.append(Path(p).name) or real_open(p, *a, **k))
    collect([tmp_path], max_file_bytes=100)
    assert opened == ["small.txt"]


def test_include_exclude(tmp_path):
    write(tmp_path, {
        "src/a.py": "a", "src/deep/b.py": "b", "src/c.js": "c",
        "tests/test_a.py": "t", "README.md": "r",
    })
    corpus = collect([tmp_path], include=["*.py", "README.md"], exclude=["tests/**"])
    assert paths(corpus) == ["README.md", "src/a.py", "src/deep/b.py"]
    # Excluded files are reported, files not included are silently left out.
    assert reasons(corpus) == {"tests": "excluded by --exclude"}

    only_deep = collect([tmp_path], include=["src/**/*.py"], exclude=["a.py"])
    assert paths(only_deep) == ["src/deep/b.py"]
    assert reasons(only_deep) == {"src/a.py": "excluded by --exclude"}


def test_missing_path(tmp_path):
    with pytest.raises(StarqaError, match="No such file or directory: .*nope"):
        collect([tmp_path / "nope"])


def test_empty_folder_error_with_hint(tmp_path):
    write(tmp_path, {"a.bin": b"\x00\x01", "b.bin": b"\x00", ".hidden": "h"})
    with pytest.raises(StarqaError, match="Nothing to ingest") as info:
        collect([tmp_path])
    assert info.value.hint == "skipped: 2 binary, 1 hidden"

    (tmp_path / "empty").mkdir()
    with pytest.raises(StarqaError) as info:
        collect([tmp_path / "empty"])
    assert info.value.hint == "no files found"


def test_symlink_loop_does_not_hang(tmp_path):
    write(tmp_path, {"root/a.txt": "a", "root/sub/b.txt": "b"})
    try:
        os.symlink(tmp_path / "root", tmp_path / "root" / "sub" / "up", target_is_directory=True)
        os.symlink("self", tmp_path / "root" / "self")
    except (OSError, NotImplementedError):
        pytest.skip("symlinks not supported here")
    corpus = collect([tmp_path / "root"])
    assert paths(corpus) == ["a.txt", "sub/b.txt"]
    assert reasons(corpus) == {"sub/up": "symlink loop", "self": "symlink loop"}


def test_single_file_argument(tmp_path):
    write(tmp_path, {"docs/.notes.md": "named explicitly", "docs/other.md": "o", "x/other.md": "x"})
    corpus = collect([tmp_path / "docs" / ".notes.md"])
    assert paths(corpus) == [".notes.md"]  # hidden, but the user asked for it

    several = collect([tmp_path / "docs" / "other.md", tmp_path / "x", tmp_path / "x"])
    assert paths(several) == ["other.md", "x/other.md"]
    assert len(several.roots) == 2


def test_duplicate_file_by_real_path(tmp_path):
    write(tmp_path, {"d/a.txt": "a"})
    corpus = collect([tmp_path / "d", tmp_path / "d" / "a.txt"])
    assert [f.text for f in corpus.files] == ["a"]


def test_crlf_and_bom_normalised(tmp_path):
    write(tmp_path, {"w.txt": b"\xef\xbb\xbfone\r\ntwo\r\n"})
    (f,) = collect([tmp_path]).files
    assert f.text == "one\ntwo\n"
    assert f.size == 13


@pytest.mark.parametrize("under_git", [False, pytest.param(True, marks=needs_git)])
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
        git(repo, "init", "-q")
        git(repo, "add", "-A")
    found = collect([str(repo)])
    read = {f.path for f in found.files}
    assert "secret.md" not in read and not any(p.startswith("linked") for p in read)
    assert not any("PRIVATE" in f.text for f in found.files)
    assert "docs/a.md" in read
    why = reasons(found)
    assert "outside" not in why.get("inside.md", "")
    assert why["secret.md"].startswith("symlink to outside the folder")
    assert why.get("linked", why.get("linked/key.md", "")).startswith("symlink to outside")


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
    got = collect([root])
    assert [f.path for f in got.files] == ["ok.py"]
    where = "locked/secret.py" if in_git else "locked"  # git lists files, not folders
    assert {s.path: s.reason for s in got.skipped} == {where: "unreadable (Permission denied)"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads folders whatever their mode")
def test_unreadable_sub_folder_for_real(tmp_path):
    root = _plain_tree(tmp_path)
    (root / "locked").chmod(0)
    try:
        got = collect([root])
    finally:
        (root / "locked").chmod(0o755)
    assert [f.path for f in got.files] == ["ok.py"]
    assert {s.path: s.reason for s in got.skipped} == {"locked": "unreadable (Permission denied)"}


# ---------------------------------------------------------------- packing


def test_pack_format_and_spans():
    files = [TextFile("a.py", "x = 1\ny = 2\n\n", 13), TextFile("b/c.md", "# T", 3)]
    packed, spans = pack(files)
    assert packed == (
        '<document path="a.py">\nx = 1\ny = 2\n</document>'
        "\n\n"
        '<document path="b/c.md">\n# T\n</document>'
    )
    assert [s.path for s in spans] == ["a.py", "b/c.md"]
    for f, s in zip(files, spans):
        body = f.text.rstrip()
        assert packed[s.text_start:s.text_start + len(body)] == body
        assert packed[s.char_start:s.char_end].startswith(f'<document path="{f.path}">')
        assert packed[s.char_start:s.char_end].endswith("</document>")
    assert spans[0].char_start == 0 and spans[1].char_end == len(packed)
    assert spans[1].char_start == spans[0].char_end + 2
    assert [s.lines for s in spans] == [2, 1]


def test_line_of():
    packed, (a, b) = pack([TextFile("a", "l1\nl2\nl3", 8), TextFile("b", "only", 4)])
    assert line_of(a, packed, a.text_start) == 1
    assert line_of(a, packed, packed.index("l2")) == 2
    assert line_of(a, packed, packed.index("l3") + 1) == 3
    assert line_of(a, packed, a.char_start) == 1  # in the header: clamps to the first line
    assert line_of(a, packed, a.char_end - 1) == 3  # in the closing tag: clamps to the last
    assert line_of(b, packed, packed.index("only")) == 1


def test_content_hash():
    files = [TextFile("a", "one", 3), TextFile("b", "two", 3)]
    h = content_hash(files)
    assert h == content_hash([TextFile("a", "one", 3), TextFile("b", "two", 3)])
    assert len(h) == 64
    assert h != content_hash([TextFile("a", "one", 3), TextFile("b", "two!", 4)])
    assert h != content_hash([TextFile("a", "on", 3), TextFile("b", "etwo", 3)])
    assert h != content_hash([TextFile("a", "one", 3), TextFile("c", "two", 3)])


def test_content_hash_from_disk(tmp_path):
    write(tmp_path, {"a.txt": "one", "b.txt": "two"})
    first = content_hash(collect([tmp_path]).files)
    assert content_hash(collect([tmp_path]).files) == first
    write(tmp_path, {"b.txt": "two changed"})
    assert content_hash(collect([tmp_path]).files) != first


def test_filespan_is_frozen():
    span = FileSpan("a", 0, 10, 5, 1)
    with pytest.raises(AttributeError):
        span.lines = 2  # type: ignore[misc]


def test_starqaignore_at_the_top_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("alpha\n")
    (tmp_path / "docs" / "questions.jsonl").write_text('{"q": 1}\n')
    (tmp_path / "docs" / ".starqaignore").write_text("questions.jsonl\n")
    corpus = collect([tmp_path / "docs"])
    assert [f.path for f in corpus.files] == ["a.md"]
    assert ("questions.jsonl", "ignored by .starqaignore") in {
        (s.path, s.reason) for s in corpus.skipped}


@needs_git
def test_files_know_when_they_last_changed(tmp_path, monkeypatch):
    """In a git work tree a file left as committed changed at its last commit (0 when that
    is older than the history read); an edited or untracked file at its mtime. Outside git,
    at its mtime."""
    def commit(when, *names):
        for name in names:
            (repo / name).write_text(f"{name} at {when}")
        git(repo, "add", *names)
        subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c",
                        "commit.gpgsign=false", "commit", "-q", "-m", str(when)], cwd=repo,
                       check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_DATE": f"@{when} +0000",
                            "GIT_COMMITTER_DATE": f"@{when} +0000"})

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    commit(1_600_000_000, "old.txt", "a.txt", "b.txt")
    commit(1_650_000_000, "a.txt")
    commit(1_700_000_000, "b.txt")
    (repo / "b.txt").write_text("edited, not committed")
    (repo / "new.txt").write_text("untracked")
    os.utime(repo / "b.txt", (1_800_000_000, 1_800_000_000))
    os.utime(repo / "new.txt", (1_800_000_100, 1_800_000_100))
    when = {f.path: f.changed for f in collect([repo]).files}
    assert when == {"old.txt": 1_600_000_000, "a.txt": 1_650_000_000,
                    "b.txt": 1_800_000_000, "new.txt": 1_800_000_100}
    monkeypatch.setattr(corpus_git, "GIT_HISTORY", 2)  # old.txt's commit is not read
    assert {f.path: f.changed for f in collect([repo]).files}["old.txt"] == 0

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_text("x")
    os.utime(plain / "x.txt", (1_234_567_890, 1_234_567_890))
    assert [f.changed for f in collect([plain]).files] == [1_234_567_890]
