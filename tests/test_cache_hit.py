"""An ingest of input already cached: the cache hit verifies what it reuses (a shard with a
flipped byte is encoded again, a manifest whose model digest was edited is rebuilt) without
hashing unchanged shards again; the re-ingest hint works pasted in any folder; `--name`
renames; a second identical ingest at once waits and is a hit. The workers are the stand-in
of `conftest.fake_workers`."""

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from starqa import engine
from starqa.core import paths
from starqa.cache import shards, store
from starqa.launchers.ingest import steps
from starqa.cli import app
from starqa.core.errors import ShardError, StarqaError
from starqa.cache.manifest import MANIFEST, read_manifest

runner = CliRunner()


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


def test_name_given_on_a_cache_hit_renames_the_context(home, docs, tiny_model, fake_workers):
    """`--name` is not ignored when the input is already cached (issue #11, item 10)."""
    first = _ingest(docs, tiny_model, name="first")
    hit = _ingest(docs, tiny_model, name="second")
    assert hit.cache_hit and hit.manifest.key == first.manifest.key
    assert hit.manifest.name == "second"
    assert read_manifest(hit.manifest.folder).name == "second"
    assert store.find_context(paths.contexts_dir(), "second").key == first.manifest.key
    assert _ingest(docs, tiny_model).manifest.name == "second"  # no --name: kept


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
