"""Bad inputs and faults from issue #11: each test failed before its fix.

No model downloads and no torchrun: the tiny model of `tiny.py` where a tokenizer is needed,
fake contexts (from test_cache_cmds) where the cache is, and `engine._encode` replaced by a
stand-in that commits shards the way the workers would.
"""

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
