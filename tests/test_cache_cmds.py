"""`starqa list / info / rm / cache` on fake contexts written straight into a tmp cache.

No model and no torchrun: a context here is dummy block files of known sizes and a
manifest written by the real writer.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fakes import make_context, starqa
from typer.testing import CliRunner

from starqa.cache import store
from starqa.cli import app
from starqa.core.errors import StarqaError
from starqa.cache.manifest import MANIFEST, block_file, read_manifest, write_manifest

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


# ---------------------------------------------------------------------------------------
# list


def test_list_most_recent_first_with_default_marked(contexts):
    lines = invoke("list").output.splitlines()
    rows = [line for line in lines if any(n in line for n in ("docs", "repo", "old"))
            and "tiny-llama" in line]
    assert [row.split()[1] if row.startswith("*") else row.split()[0] for row in rows] == \
        ["docs", "repo", "old"]
    assert rows[0].startswith("*") and not rows[1].startswith("*")
    docs = rows[0]
    assert "d0c50000" in docs and "200" in docs and "star 100/100" in docs
    assert f"{store.dir_size(contexts['docs']) / 1024:.1f} KB" in docs
    assert "1 min ago" in docs
    assert "dense 100" in rows[1] and "1 h ago" in rows[1]
    assert "2 days ago" in rows[2]


def test_list_json(contexts):
    data = json.loads(invoke("list", "--json").output)
    assert [c["name"] for c in data] == ["docs", "repo", "old"]
    assert [c["default"] for c in data] == [True, False, False]
    docs = data[0]
    assert docs["key"] == "d0c5" + "0" * 12 and docs["n_tokens"] == 200
    assert docs["method"] == {"name": "star", "block_size": 100, "anchor_size": 100, "params": {}}
    assert docs["model"] == "tiny-llama" and docs["sources"] == ["/data/docs"]
    assert docs["bytes"] == store.dir_size(contexts["docs"]) > 1600
    assert docs["last_used"] > docs["created"]


def test_list_empty(home):
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0 and "No ingested context yet" in result.output
    assert json.loads(invoke("list", "--json").output) == []


# ---------------------------------------------------------------------------------------
# info


def test_info_shows_manifest_facts(contexts):
    out = invoke("info", "repo").output
    for expected in ("4e90" + "0" * 12, "/data/repo", "starqa ingest /data/repo", "tiny-llama",
                     "abababababab", "dense (block 100)", "bfloat16", "a.md", "b.py",
                     "logo.png", "binary", "2 workers", "block_00000.safetensors"):
        assert expected in out, expected
    assert "ab" * 32 not in out  # the digest is shortened


def test_info_defaults_to_the_latest_and_flags_missing_shards(contexts):
    (contexts["docs"] / block_file(1)).unlink()
    out = invoke("info").output
    assert "d0c5" + "0" * 12 in out
    assert "missing" in out


def test_info_json_is_the_manifest(contexts):
    data = json.loads(invoke("info", "--json", "old").output)
    on_disk = json.loads((contexts["old"] / MANIFEST).read_text())
    assert {k: v for k, v in data.items() if k != "dir"} == on_disk
    assert data["dir"] == str(contexts["old"])


def test_info_unknown_name(contexts):
    result = runner.invoke(app, ["info", "nope"])
    assert isinstance(result.exception, StarqaError)
    proc = starqa("info", "nope", home=contexts["docs"].parent.parent)
    assert proc.returncode == 1
    assert "No context named 'nope'" in proc.stderr and "docs, old, repo" in proc.stderr


# ---------------------------------------------------------------------------------------
# rm


def test_rm_named_removes_folders_and_reports_freed(contexts):
    size = store.dir_size(contexts["docs"])
    out = invoke("rm", "docs", "4e90").output  # a name and a key prefix
    assert not contexts["docs"].exists() and not contexts["repo"].exists()
    assert contexts["old"].exists()
    assert "Removed docs" in out and "Removed repo" in out and "Removed 2 contexts" in out
    assert f"{size / 1024:.1f} KB" in out
    assert [p.name for p in contexts["old"].parent.iterdir()] == [contexts["old"].name]  # no trash


def test_rm_typo_removes_nothing(contexts):
    result = runner.invoke(app, ["rm", "docs", "nope"])
    assert isinstance(result.exception, StarqaError)
    assert all(folder.exists() for folder in contexts.values())


def test_rm_all_needs_yes_without_a_terminal(contexts):
    proc = starqa("rm", "--all", home=contexts["docs"].parent.parent)
    assert proc.returncode == 1 and "--yes" in proc.stderr
    assert all(folder.exists() for folder in contexts.values())
    out = invoke("rm", "--all", "--yes").output
    assert "Removed 3 contexts" in out
    assert not any(folder.exists() for folder in contexts.values())
    assert "No contexts to remove" in invoke("rm", "--all", "-y").output


def test_rm_needs_names_or_all(contexts):
    assert isinstance(runner.invoke(app, ["rm"]).exception, StarqaError)
    assert isinstance(runner.invoke(app, ["rm", "docs", "--all", "--yes"]).exception, StarqaError)
    assert contexts["docs"].exists()


def test_remove_context_twice_frees_nothing(contexts):
    manifest = read_manifest(contexts["old"])
    size = store.dir_size(contexts["old"])
    assert store.remove_context(manifest) == size > 1600
    assert not contexts["old"].exists()
    assert store.remove_context(manifest) == 0


# ---------------------------------------------------------------------------------------
# cache


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cache_totals(contexts, home):
    (home / "models" / "tiny").mkdir(parents=True)
    (home / "models" / "tiny" / "model.safetensors").write_bytes(b"\0" * 5000)
    data = json.loads(invoke("cache", "--json").output)
    assert data["home"] == str(home)
    assert data["models_bytes"] == 5000 and data["n_contexts"] == 3
    assert data["contexts_bytes"] == sum(store.dir_size(f) for f in contexts.values())
    assert data["total_bytes"] == store.dir_size(home)
    assert data["leftovers"] == [] and data["cleaned_bytes"] is None
    out = invoke("cache").output
    assert str(home) in out and "3 contexts" in out and "4.9 KB" in out


def test_cache_clean_removes_stale_leftovers_only(contexts, home):
    root = home / "contexts"
    stale = root / f".staging-abcd-{dead_pid()}"
    live = root / f".staging-ef01-{os.getpid()}"
    trash = root / f".trash-abcd-{store.HOST}.{dead_pid()}"
    shared = root / ".staging-1234-shared"
    # A cache shared by several machines: another machine's pids mean nothing here, so its
    # folders go only once unchanged for a day (this pid is alive here, and no matter).
    other = root / f".staging-5678-n1-{'0' * 8}.{os.getpid()}"
    other_old = root / f".old-9abc-{'0' * 8}.{os.getpid()}"
    for folder in (stale, live, trash, shared, other, other_old):
        folder.mkdir()
        (folder / "block_00000.safetensors").write_bytes(b"\0" * 300)
    day_ago = time.time() - store.FOREIGN_STALE_S - 60
    for path in (other_old, other_old / "block_00000.safetensors", shared,
                 shared / "block_00000.safetensors"):
        os.utime(path, (day_ago, day_ago))

    data = json.loads(invoke("cache", "--json").output)
    assert {Path(x["path"]).name: x["running"] for x in data["leftovers"]} == \
        {stale.name: False, live.name: True, trash.name: False, shared.name: False,
         other.name: True, other_old.name: False}
    assert data["n_contexts"] == 3  # leftovers are not contexts
    out = invoke("cache").output
    assert "6 folders, 4 removable with --clean" in out and "in use by running process" in out
    assert "another machine's; changed 0 min ago" in out
    assert stale.exists()  # reporting deletes nothing

    out = invoke("cache", "--clean").output
    assert "freed 1.2 KB" in out
    assert live.exists() and other.exists()
    assert not any(p.exists() for p in (stale, trash, shared, other_old))
    assert all(folder.exists() for folder in contexts.values())


def test_cache_clean_removes_contexts_this_starqa_cannot_read(contexts, home):
    manifest = json.loads((contexts["old"] / MANIFEST).read_text())
    (contexts["old"] / MANIFEST).write_text(json.dumps({**manifest, "format": 0}))
    (contexts["repo"] / MANIFEST).write_text("{not json")
    size = store.dir_size(contexts["old"]) + store.dir_size(contexts["repo"])
    listed = json.loads(invoke("list", "--json").output)
    assert [c["name"] for c in listed if not c.get("damaged")] == ["docs"]
    # Damaged contexts are listed by key (issue #11: they used to vanish from `list`).
    assert {c["key"] for c in listed if c.get("damaged")} == \
        {contexts["old"].name, contexts["repo"].name}

    data = json.loads(invoke("cache", "--json").output)
    assert data["n_contexts"] == 1
    assert data["contexts_bytes"] == store.dir_size(contexts["docs"])
    states = {Path(x["path"]).name: x["state"] for x in data["leftovers"]}
    assert "incompatible starqa (format 0" in states[contexts["old"].name]
    assert "not valid JSON" in states[contexts["repo"].name]

    assert json.loads(invoke("cache", "--clean", "--json").output)["cleaned_bytes"] == size
    assert not contexts["old"].exists() and not contexts["repo"].exists()
    assert contexts["docs"].exists()


def test_contexts_past_the_window_are_marked_in_list_and_info(home):
    """A context built with --beyond-window (here: 300 tokens in a 256-token window) is marked
    in `list` (its tokens, a caption saying what the mark means, `past_window` in --json) and
    in `info`; one that fits is not."""
    from dataclasses import replace

    from starqa.cache.manifest import read_manifest

    now = time.time()
    fits = make_context(home, "fits", "f175" + "0" * 12, now - 60)
    over = make_context(home, "over", "0e7e" + "0" * 12, now - 120, (1000, 600, 600))
    manifest = read_manifest(over)
    write_manifest(over, replace(manifest, model=replace(manifest.model, window=256)))
    lines = invoke("list").output.splitlines()
    assert "300 !" in next(line for line in lines if "over" in line)
    assert "!" not in next(line for line in lines if "fits" in line and "tiny-llama" in line)
    assert any("past the model's window" in line for line in lines)
    data = {c["name"]: c for c in json.loads(invoke("list", "--json").output)}
    assert data["over"]["past_window"] and not data["fits"]["past_window"]
    assert "past the model's 256-token window" in invoke("info", "over").output
    assert "past the model's" not in invoke("info", "fits").output
    assert fits.exists()
