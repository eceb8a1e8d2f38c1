"""Bad inputs and faults from issue #11: each test failed before its fix.

No model downloads and no torchrun: the tiny model of `tiny.py` where a tokenizer is needed,
fake contexts (from test_cache_cmds) where the cache is, and `engine._encode` replaced by a
stand-in that commits shards the way the workers would.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from starqa import corpus

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


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
