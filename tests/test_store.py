"""Contexts in the cache as `starqa.cache.store` finds and commits them: a damaged one is
named and set aside, never breaking the others; a name never guesses which context it
means; a cache folder that is a file is named; concurrent commits of one context leave one
intact context. On fake contexts (`fakes.make_context`) and the CLI in this process."""

import json
import shutil
import time
from pathlib import Path

import pytest
from fakes import make_context, starqa
from typer.testing import CliRunner

from starqa import engine
from starqa.cache import shards, store
from starqa.cli import app
from starqa.core.errors import ShardError, StarqaError
from starqa.cache.manifest import MANIFEST, block_file, read_manifest

runner = CliRunner()


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
# one damaged manifest is named and set aside; it never breaks the other contexts


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
# `rm`, `info`, `ask` and `stop` never guess which context a name means


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
# concurrent commits of one context


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
