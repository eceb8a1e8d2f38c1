"""Incremental re-ingest (issue #14): blocks that follow files, content-addressed block
files shared between contexts, reuse per method, the report, and what a crash or `rm`
can and cannot do to shared blocks. Tiny random Llama in fp32; blocks encoded in process
(`encode_in="process"`) unless a test is about the worker group."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from starqa.cache import blockstore, shards, store
from starqa import engine, methods
from starqa.reingest import packorder
from starqa.core import paths
from starqa.corpus import TextFile, collect
from starqa.cli import app
from starqa.cache.manifest import read_manifest
from starqa.methods import method_config, plan_blocks, plan_file_blocks


def _ingest(docs, model, method="star", **kw):
    kw.setdefault("encode_in", "process")
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model),
                                              dtype="fp32", method=method, block_size=40, **kw))


def _append(path, text=" the answer"):
    path.write_text(path.read_text() + text)


def _kv(manifest):
    return [load_file(str(manifest.folder / b.file)) for b in manifest.blocks]


# ---------------------------------------------------------------------------------------
# the plan


FILES = [("a", 5, 40), ("b", 42, 60), ("c", 62, 300), ("d", 302, 310), ("e", 312, 330),
         ("f", 331, 360), ("g", 361, 380)]


def test_blocks_follow_files_and_large_files_are_cut_at_fixed_offsets():
    blocks = plan_file_blocks(380, 50, FILES)
    assert blocks[0] == (0, 50)  # block 0 (the anchor's) at a fixed size
    assert [s for s, _ in blocks[1:]] == sorted({s for s, _ in blocks[1:]})
    assert all(b - a <= 50 for a, b in blocks) and blocks[-1][1] == 380
    assert all(blocks[i][1] == blocks[i + 1][0] for i in range(len(blocks) - 1))
    starts = {s for s, _ in blocks}
    # c (238 tokens) is cut at 62, 112, 162, ... from its own start, its blocks its own
    assert {62, 112, 162, 212, 262, 302} <= starts
    # every small file starts inside the block where it lies whole
    for _, s, e in FILES[3:]:
        assert any(a <= s and e <= b for a, b in blocks)


def test_a_grown_file_regroups_no_block_after_the_next_cut_point():
    files = [(f"file{i}", 100 + 20 * i, 118 + 20 * i) for i in range(40)]
    n = files[-1][2] + 2
    before = plan_file_blocks(n, 64, files)
    grown = [(p, s + 15 * (i > 10), e + 15 * (i >= 10)) for i, (p, s, e) in enumerate(files)]
    after = plan_file_blocks(n + 15, 64, grown)

    def groups(blocks, fs):
        return [tuple(p for p, s, _ in fs if a <= max(s, 64) < b) for a, b in blocks]

    old, new = groups(before, files), groups(after, grown)
    assert old[0] == new[0] and old[-1] == new[-1]  # later groups are the same files again
    assert len(set(old) ^ set(new)) <= 4  # only around file10 do the groups differ


def test_default_block_is_stable_under_small_edits():
    sizes = {method_config("star", n).block_size for n in range(20_000, 20_400)}
    assert len(sizes) == 1
    assert len(plan_blocks(20_000, sizes.pop())) == 4


def test_block_addresses_change_only_where_the_method_says():
    """An edit of block 2 (same length) changes the inputs of exactly the blocks that
    `Method.invalidated` names for star and dense; pulsar's (by its assembled input) never
    more than that."""
    ids = [(i * 7919) % 50 for i in range(200)]
    edited = list(ids)
    edited[85] = (edited[85] + 1) % 50
    blocks = plan_blocks(200, 40)
    for name in ("star", "dense", "pulsar"):
        config = method_config(name, 200, block_size=40)
        entry = methods.get(name)
        prepared, prepared2 = entry.prepare(ids, config, blocks), entry.prepare(edited, config,
                                                                                blocks)
        changed = [i for i in range(len(blocks))
                   if entry.block_inputs(ids, config, blocks, i, prepared)
                   != entry.block_inputs(edited, config, blocks, i, prepared2)]
        stale = entry.invalidated(config, blocks, 2)
        assert 2 in changed and set(changed) <= set(stale), name
        if name != "pulsar":
            assert changed == stale, name


# ---------------------------------------------------------------------------------------
# reuse per method


def test_dense_prefix_reuse_is_bit_identical_to_a_full_encoding(home, repo, tiny_model):
    old = _ingest(repo, tiny_model, "dense").manifest
    _append(repo / "f6.md")
    result = _ingest(repo, tiny_model, "dense")
    r, new = result.reuse, result.manifest
    assert r.reused > 0 and r.encoded > 0 and r.reused + r.encoded == len(new.blocks)
    for i in range(r.reused):  # the kept prefix: the very same files
        assert os.path.samefile(old.folder / old.blocks[i].file, new.folder / new.blocks[i].file)
    incremental = _kv(new)
    full = _kv(_ingest(repo, tiny_model, "dense", force=True).manifest)
    assert len(full) == len(incremental)
    for a, b in zip(incremental, full):
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


@pytest.mark.slow
@pytest.mark.parametrize("encode_in", ["process", "group"])
def test_ring_prefix_reuse_equals_a_full_encoding(home, repo, tiny_model, encode_in):
    old = _ingest(repo, tiny_model, "ring").manifest
    _append(repo / "f6.md")
    result = _ingest(repo, tiny_model, "ring", encode_in=encode_in, workers=2)
    assert result.reuse.reused > 0 and result.reuse.encoded > 1
    assert os.path.samefile(old.folder / old.blocks[1].file,
                            result.manifest.folder / result.manifest.blocks[1].file)
    incremental = _kv(result.manifest)
    full = _kv(_ingest(repo, tiny_model, "dense", force=True).manifest)
    for a, b in zip(incremental, full):  # exact up to rounding (the merge order differs)
        torch.testing.assert_close(a["k"], b["k"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a["v"], b["v"], rtol=1e-5, atol=1e-5)


def test_star_reuses_unchanged_blocks_and_rerotates_moved_ones(home, repo, tiny_model):
    old = _ingest(repo, tiny_model).manifest
    _append(repo / "f5.md")
    result = _ingest(repo, tiny_model)
    r, new = result.reuse, result.manifest
    assert r.changes.changed == ("f5.md",) and not r.changes.added and not r.changes.removed
    assert r.reused > 0 and r.rotated > 0 and 1 <= r.encoded <= 2
    assert r.in_process and r.why is None
    kept = {b.sha256 for b in old.blocks}
    assert sum(b.sha256 in kept for b in new.blocks) == r.reused
    incremental = _kv(new)  # before --force replaces the context (the same key)
    fresh = _kv(_ingest(repo, tiny_model, force=True).manifest)
    moved = [i for i, (a, b) in enumerate(zip(incremental, fresh))
             if not torch.equal(a["k"], b["k"])]
    assert len(moved) == r.rotated  # reused and encoded blocks are exactly the fresh ones
    for i in moved:
        a, b = incremental[i], fresh[i]
        # layer 0: keys depend on the token and its position only, so re-rotation is exact
        torch.testing.assert_close(a["k"][0], b["k"][0], rtol=1e-4, atol=1e-5)
        assert torch.equal(a["v"][0], b["v"][0])
        assert not torch.equal(a["k"][-1], b["k"][-1])  # deeper: an approximation


def test_an_edit_in_the_anchor_reencodes_every_block_and_says_why(home, repo, tiny_model):
    _ingest(repo, tiny_model)
    (repo / "f0.md").write_text("travel " + (repo / "f0.md").read_text())  # in the anchor
    r = _ingest(repo, tiny_model).reuse
    assert r.reused == r.rotated == 0 and r.encoded == r.blocks
    assert "f0.md is in the anchor" in r.why


def test_files_go_oldest_first_and_keep_their_place_until_the_head_changes(home, repo,
                                                                           tiny_model):
    """A first ingest packs the least recently changed files first; a re-ingest keeps the
    previous order (an edited file stays where it was, a new one goes last); an edit in the
    first block, which re-encodes everything anyway, lays the files out afresh."""
    def touch(name, when):
        os.utime(repo / name, (when, when))

    for i in range(9):  # f8 changed longest ago, f0 last
        touch(f"f{i}.md", 1_700_000_000 - 1000 * i)
    first = _ingest(repo, tiny_model, reserve=0).manifest
    assert [f.path for f in first.files] == [f"f{i}.md" for i in range(8, -1, -1)]
    rebuilt = packorder.as_packed(collect([repo]).files, first)  # a reference prompt's files
    assert [f.path for f in rebuilt] == [f.path for f in first.files]

    _append(repo / "f5.md")  # in the middle, now the newest
    (repo / "new.md").write_text("seven")
    touch("f5.md", 1_800_000_000)
    touch("new.md", 1_800_000_100)
    result = _ingest(repo, tiny_model, reserve=0)
    assert [f.path for f in result.manifest.files] == [f.path for f in first.files] + ["new.md"]
    assert 0 < result.reuse.encoded < result.reuse.blocks

    order = [f.path for f in result.manifest.files]
    _append(repo / "f8.md")  # the first file, but past the first block: the head is kept
    touch("f8.md", 1_800_000_200)
    result = _ingest(repo, tiny_model, reserve=0)
    assert [f.path for f in result.manifest.files] == order and result.reuse.encoded == 1

    (repo / "f8.md").write_text("travel " + (repo / "f8.md").read_text())  # in the head
    touch("f8.md", 1_800_000_200)
    result = _ingest(repo, tiny_model, reserve=0)
    assert result.reuse.encoded == result.reuse.blocks
    assert "f8.md is in the anchor" in result.reuse.why
    assert [f.path for f in result.manifest.files] == [
        *(f"f{i}.md" for i in (7, 6, 4, 3, 2, 1, 0)), "f5.md", "new.md", "f8.md"]

    _append(repo / "f8.md")  # now last: its next edit re-encodes only the end
    result = _ingest(repo, tiny_model, reserve=0)
    assert [f.path for f in result.manifest.files][-1] == "f8.md"
    assert result.reuse.encoded == 1 and result.reuse.reused > 0


def test_pack_order_by_age_and_keeping():
    files = [TextFile(p, p, 1, when) for p, when in
             (("b", 5), ("a", 5), ("c", 1), ("d", 9))]
    assert [f.path for f in packorder.by_age(files)] == ["c", "a", "b", "d"]
    assert [f.path for f in packorder.keeping(files, ["d", "gone", "a"])] == ["d", "a", "c", "b"]


def test_unchanged_sources_are_a_cache_hit_and_force_encodes_all(home, repo, tiny_model):
    _ingest(repo, tiny_model)
    assert _ingest(repo, tiny_model).cache_hit
    r = _ingest(repo, tiny_model, force=True).reuse
    assert r.encoded == r.blocks and "--force" in r.why


@pytest.mark.slow
def test_report_line_names_the_changes(home, repo, tiny_model):
    runner = CliRunner()
    args = ["ingest", str(repo), "--model", str(tiny_model), "--dtype", "fp32",
            "--block-size", "40", "--encode-in", "process"]  # no group: the report is the point
    assert runner.invoke(app, args).exit_code == 0
    _append(repo / "f4.md")
    (repo / "new.md").write_text("the answer is seven")
    (repo / "f8.md").unlink()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Re-ingested repo:" in text and "reused" in text and "encoded" in text
    assert "(f4.md changed; 1 file added, 1 removed)" in text


# ---------------------------------------------------------------------------------------
# the shared store


def _store_files(home):
    folder = blockstore.store_dir(home / "contexts")
    return {p.name for p in folder.glob("*.safetensors")}


def test_a_block_shared_by_two_contexts_survives_rm_of_one(home, repo, tiny_model):
    first = _ingest(repo, tiny_model, name="first").manifest
    _append(repo / "f7.md")
    second = _ingest(repo, tiny_model, name="second").manifest
    shared = [b for b in second.blocks if os.path.samefile(
        second.folder / b.file, first.folder / first.blocks[b.index].file)]
    assert shared  # the blocks before the edit are one file in both contexts
    result = CliRunner().invoke(app, ["rm", "first"])
    assert result.exit_code == 0, result.output
    shards.verify_checksums(read_manifest(second.folder))  # every block there and intact
    assert len(_store_files(home)) == len(second.blocks)  # first's own blocks dropped
    CliRunner().invoke(app, ["rm", "second"])
    assert _store_files(home) == set()


def test_cache_clean_drops_only_blocks_no_context_links(home, repo, tiny_model):
    manifest = _ingest(repo, tiny_model).manifest
    folder = blockstore.store_dir(home / "contexts")
    orphan = folder / "0123abcd-7.safetensors"
    orphan.write_bytes(b"x" * 100)
    result = CliRunner().invoke(app, ["cache", "--clean"])
    assert result.exit_code == 0, result.output
    assert not orphan.exists()
    assert len(_store_files(home)) == len(manifest.blocks)
    shards.verify_checksums(read_manifest(manifest.folder))


def test_a_damaged_shared_block_is_encoded_again_not_reused(home, repo, tiny_model):
    first = _ingest(repo, tiny_model).manifest
    damaged = first.folder / first.blocks[2].file
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))  # the same inode as the store's file
    _append(repo / "f8.md")
    result = _ingest(repo, tiny_model)
    shards.verify_checksums(result.manifest)  # the new context is sound
    assert result.reuse.reused + result.reuse.rotated < len(result.manifest.blocks) - 1


@pytest.mark.slow
def test_kill_9_during_an_incremental_reingest_keeps_the_previous_context(
        home, repo, tiny_model):
    """The launcher killed while it encodes (the reused blocks already linked into its
    staging folder): the previous context answers as before, every block file a manifest
    names is there, and the next ingest completes from the store."""
    previous = _ingest(repo, tiny_model).manifest
    _append(repo / "f6.md")
    env = {**os.environ, "STARQA_HOME": str(home), "STARQA_SLOW": "60", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "starqa", "ingest", str(repo), "--model",
                             str(tiny_model), "--dtype", "fp32", "--block-size", "40",
                             "--encode-in", "process"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not any(p.glob("block_*.safetensors")
                      for p in (home / "contexts").glob(".staging-*")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no staging folder with blocks appeared"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    good, damaged = store.scan_contexts(paths.contexts_dir())
    assert not damaged and [m.key for m in good] == [previous.key]
    shards.verify_checksums(good[0])
    assert CliRunner().invoke(app, ["cache", "--clean"]).exit_code == 0
    shards.verify_checksums(read_manifest(previous.folder))
    result = _ingest(repo, tiny_model)
    assert result.reuse.reused > 0
    for manifest in store.list_contexts(paths.contexts_dir()):
        shards.verify_checksums(manifest)


def test_info_says_which_files_each_block_holds(home, repo, tiny_model):
    manifest = _ingest(repo, tiny_model).manifest
    result = CliRunner().invoke(app, ["info", manifest.key], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "block_000" in line]
    assert len(rows) == len(manifest.blocks)
    for block, row in zip(manifest.blocks, rows):
        held = [f.path for f in manifest.files
                if f.token_start < block.end and block.start < f.token_end]
        assert held and all(path in row for path in held[:4])


def test_a_reingest_keeps_the_previous_block_size_while_the_default_moves(home, repo,
                                                                          tiny_model):
    """The default block follows the context's length; a re-ingest that moves it a step
    keeps the previous version's block size, so the unchanged blocks are reused."""
    opts = engine.IngestOptions(paths=(str(repo),), model=str(tiny_model), dtype="fp32",
                                method="star", encode_in="process", reserve=16)
    first = engine.ingest(opts).manifest
    (repo / "g.md").write_text(" ".join(["the answer"] * 40))  # sorts last: moves nothing
    result = engine.ingest(opts)
    assert methods.default_block(result.manifest.n_tokens) != first.method.block_size
    assert result.manifest.method.block_size == first.method.block_size
    assert result.reuse.reused >= len(first.blocks) - 1, result.reuse
    forced = engine.ingest(replace(opts, force=True)).manifest  # --force plans afresh
    assert forced.method.block_size == methods.default_block(forced.n_tokens)


def test_a_bf16_cache_computed_in_fp32_holds_the_fp32_encoding_rounded(home, repo, tiny_model,
                                                                        monkeypatch):
    """On a CPU without bf16 matrix instructions Phase 1 runs the model in fp32 and rounds
    each block's KV to the cache's bf16 as it saves it (`models.phase1_dtype`); dense's
    incremental path reads the kept blocks back in fp32 to continue from them."""
    from starqa.models import devices

    monkeypatch.setattr(devices, "cpu_description", lambda: ("an AVX2 CPU", {"avx2", "fma"}))

    def ingest(dtype, **kw):
        return engine.ingest(engine.IngestOptions(
            paths=(str(repo),), model=str(tiny_model), dtype=dtype, method="dense",
            block_size=40, encode_in="process", **kw)).manifest

    rounded = [{k: t.to(torch.bfloat16) for k, t in kv.items() if k in ("k", "v")}
               for kv in _kv(ingest("fp32"))]
    stored = _kv(ingest("bf16"))
    assert stored[0]["k"].dtype == torch.bfloat16 and len(stored) == len(rounded) > 2
    for a, b in zip(stored, rounded):
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])
    _append(repo / "f6.md")  # the kept prefix read back (bf16 → fp32) and continued from
    result = engine.ingest(engine.IngestOptions(
        paths=(str(repo),), model=str(tiny_model), dtype="bf16", method="dense",
        block_size=40, encode_in="process"))
    assert result.reuse.reused > 0 and result.reuse.encoded > 0
    full = _kv(ingest("bf16", force=True))  # every block in one fp32 pass, then rounded
    for i, (a, b) in enumerate(zip(_kv(result.manifest), full)):
        for name in ("k", "v"):
            if i < result.reuse.reused:  # kept: the very blocks
                assert torch.equal(a[name], b[name])
            else:  # continued from the kept blocks as stored: within bf16's rounding of them
                worst = (a[name].float() - b[name].float()).abs().max()
                assert worst <= 2 ** -5 * b[name].float().abs().max(), (i, name, worst)


@pytest.mark.slow
def test_workers_compute_in_the_dtype_their_launcher_chose(home, repo, tiny_model, monkeypatch):
    """The launcher chooses Phase 1's compute dtype once for its workers (the job's
    `compute_dtype`): a group's bf16 blocks are the fp32 encoding rounded, as in process."""
    from starqa.models import devices

    monkeypatch.setattr(devices, "cpu_description", lambda: ("an AVX2 CPU", {"avx2", "fma"}))

    def ingest(dtype, **kw):
        return engine.ingest(engine.IngestOptions(
            paths=(str(repo),), model=str(tiny_model), dtype=dtype, method="star",
            block_size=40, **kw)).manifest

    rounded = [{k: t.to(torch.bfloat16) for k, t in kv.items() if k in ("k", "v")}
               for kv in _kv(ingest("fp32", encode_in="process"))]
    grouped = _kv(ingest("bf16", encode_in="group", workers=2))
    assert len(grouped) == len(rounded) > 2
    for a, b in zip(grouped, rounded):
        assert a["k"].dtype == torch.bfloat16
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])
    computed = _kv(ingest("bf16", encode_in="process", force=True))  # the rule's own path
    monkeypatch.setattr(devices, "cpu_description", lambda: ("a CPU", {"avx2", "avx512_bf16"}))
    in_bf16 = _kv(ingest("bf16", encode_in="process", force=True))  # computed in bf16
    assert any(not torch.equal(a["k"], b["k"]) for a, b in zip(in_bf16, computed))
    assert all(torch.equal(a["k"], b["k"]) for a, b in zip(computed, rounded))
