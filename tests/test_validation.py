"""The validating reader and ingest's option checks (issue #45, items 10 and 12), through
the command line where users meet them; each test failed before its fix.

A context here is a real one: the tiny model of `tiny.py` encodes it in this process
(`--encode-in process`, no torchrun), and `ask` answers from it, so a damage that slipped
through would answer (exit 0) instead of being named. Tests that damage it get a copy of
one ingested once per session (`conftest.ingested`), asked once before they damage it.
"""

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fakes import install_home
from starqa.runtime import launch
from starqa import models
from starqa.cli import app
from starqa.core.errors import StarqaError, WorkerError
from starqa.cache.manifest import MANIFEST

runner = CliRunner()
QUESTION = "who approved the travel budget"


def ingest(docs: Path, model: Path, *args: str):
    return runner.invoke(app, ["ingest", str(docs), "--model", str(model), "--dtype", "fp32",
                               "--block-size", "40", "--encode-in", "process", *args])


def ask():
    return runner.invoke(app, ["ask", QUESTION, "--max-new-tokens", "2"])


@pytest.fixture
def context(home, docs, tiny_model, ingested) -> Path:
    """A committed context of ~190 tokens in 5 blocks, which answers: `ingest(docs,
    tiny_model)` as below (a copy of the session's), then `ask()`."""
    folder = install_home(ingested(tiny_model, block_size=40), home).folder
    assert ask().exit_code == 0
    return folder


def edit_manifest(folder: Path, change) -> None:
    data = json.loads((folder / MANIFEST).read_text())
    change(data)
    (folder / MANIFEST).write_text(json.dumps(data))


def rewrite_shard(folder: Path, index: int, change) -> None:
    """Rewrite block `index`'s file (change(header dict, data bytearray)), its size and
    checksum updated in the manifest: damage only a validating reader finds."""
    path = folder / f"block_{index:05d}.safetensors"
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + size]), bytearray(raw[8 + size:])
    change(header, data)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    new = len(text).to_bytes(8, "little") + text + bytes(data)
    path.unlink()  # a new inode: the block store's link keeps the intact file
    path.write_bytes(new)

    def update(manifest):
        manifest["blocks"][index].update(bytes=len(new), sha256=hashlib.sha256(new).hexdigest())
    edit_manifest(folder, update)


def assert_named_damaged(result, folder: Path, *words: str) -> None:
    assert result.exit_code == 1, result.output
    hint = getattr(result.exception, "hint", "") or ""
    text = " ".join(f"{result.exception} {hint} {result.output}".split())
    assert "is damaged" in text and folder.name in text, text
    assert "worker died" not in text and "Traceback" not in result.output
    for word in words:
        assert word in text, (word, text)


# ---------------------------------------------------------------------------------------
# item 10: a manifest's numbers, shard headers, Inf/NaN


def _shift_block(m):
    m["blocks"][1]["end"] += 3
    m["blocks"][2]["start"] += 3


MANIFEST_EDITS = {
    "n_tokens past the blocks": lambda m: m.update(n_tokens=m["n_tokens"] + 50),
    "n_tokens short of the blocks": lambda m: m.update(n_tokens=m["n_tokens"] - 50),
    "query_position past the context": lambda m: m.update(query_position=5000),
    "query_position inside the context": lambda m: m.update(query_position=10),
    "blocks overlapping": lambda m: m["blocks"][2].update(start=m["blocks"][2]["start"] - 5),
    "a file past the context": lambda m: m["files"][0].update(token_end=m["n_tokens"] + 9),
    "a line past its file": lambda m: m["files"][1]["line_tokens"].append(10**6),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_a_manifest_whose_numbers_disagree_is_named_damaged(context, edit):
    """Each edit answered garbage with exit 0; now `ask` names the context damaged, with
    the commands that remove and rebuild it, and `list` shows it as damaged."""
    edit_manifest(context, MANIFEST_EDITS[edit])
    result = ask()
    assert_named_damaged(result, context)
    assert f"starqa rm {context.name} && starqa ingest " in " ".join(result.exception.hint.split())
    listed = json.loads(runner.invoke(app, ["list", "--json"]).output)
    assert [c["key"] for c in listed if c.get("damaged")] == [context.name]


def test_a_block_cut_elsewhere_than_its_shard_is_named_damaged(context):
    """Blocks still contiguous, but block 1 claims tokens its shard does not hold."""
    edit_manifest(context, _shift_block)
    assert_named_damaged(ask(), context, "block_00001", "not [layers, KV heads")


def _grow_keys(header, data):
    header["k"]["shape"][2] = 999  # more rows than its bytes hold


def _fewer_heads(header, data):
    header["v"]["shape"][1] = 1  # same bytes, another shape than its keys
    header["v"]["shape"][2] *= 2


def _half_precision(header, data):
    header["k"]["dtype"] = "F16"


def _ids_short(header, data):
    header["ids"]["shape"] = [5]


def _other_layout(header, data):
    header["k"]["shape"] = [1, 4] + header["k"]["shape"][2:]  # same bytes, another model's
    header["v"]["shape"] = list(header["k"]["shape"])


HEADER_EDITS = {"keys past their bytes": _grow_keys, "values unlike keys": _fewer_heads,
                "another dtype": _half_precision, "ids short": _ids_short,
                "another layout than the other blocks": _other_layout}


@pytest.mark.parametrize("edit", HEADER_EDITS)
def test_a_shard_with_an_impossible_header_is_named_damaged(context, docs, tiny_model, edit):
    """A header edited with the checksum updated reached torch ("a worker died ... try
    fewer --workers"); now the shard is named damaged with the re-ingest that rebuilds it,
    and that re-ingest (pasted) rebuilds it: `ask` answers again."""
    rewrite_shard(context, 1, HEADER_EDITS[edit])
    result = ask()
    assert_named_damaged(result, context, "block_00001.safetensors", "re-ingest")
    assert ingest(docs, tiny_model).exit_code == 0  # the hint's command, here
    assert ask().exit_code == 0


def test_a_shard_holding_nan_or_inf_is_refused(context, docs, tiny_model):
    """NaN and Inf keys or values, checksum updated, passed unnoticed."""
    def poison(header, data):
        at = header["v"]["data_offsets"][0] + 40
        data[at:at + 4] = struct.pack("<f", float("nan"))
        at = header["k"]["data_offsets"][0] + 8
        data[at:at + 4] = struct.pack("<f", float("-inf"))

    rewrite_shard(context, 2, poison)
    assert_named_damaged(ask(), context, "block_00002.safetensors", "keys and values hold Inf "
                                                                     "or NaN")
    assert ingest(docs, tiny_model).exit_code == 0
    assert ask().exit_code == 0


def test_nan_from_the_model_is_never_cached(home, docs, tiny_model, monkeypatch):
    """A block that comes out of the model with NaN (fp16 overflow, damaged weights) is an
    error naming the fix, and nothing is committed."""
    from starqa import methods

    star = methods.get("star")
    encode = star.encode

    def overflowing(*args, **kw):
        for index, k, v in encode(*args, **kw):
            if index == 3:
                k = k.clone()
                k[0, 0, 0, 0] = float("inf")
            yield index, k, v

    monkeypatch.setattr(star, "encode", overflowing)
    result = ingest(docs, tiny_model)
    assert result.exit_code == 1
    assert "Block 3 came out of the model with Inf or NaN" in str(result.exception)
    assert "--dtype fp32" in result.exception.hint
    assert not [f for f in (home / "contexts").iterdir() if not f.name.startswith(".")]


# ---------------------------------------------------------------------------------------
# item 12: block, anchor, passing and worker counts the math or the machine cannot take


@pytest.mark.parametrize("args, words", [
    (["--block-size", "1"], ["--block-size 1 is too small", "at least 32 tokens",
                             "--block-size 32 or more"]),
    (["--block-size", "31"], ["--block-size 31 is too small"]),
    (["--method", "apb", "--anchor-size", "0"], ["--anchor-size 0 leaves apb's blocks",
                                                 "--anchor-size 10 for blocks of 40"]),
    (["--method", "star", "--anchor-size", "0"], ["--anchor-size 0 leaves star's blocks"]),
    (["--method", "apb", "--passing-size", "0"], ["--passing-size 0 is not between 1 and "
                                                  "the block's 40 tokens"]),
    (["--method", "apb", "--passing-size", "41"], ["--passing-size 41", "from 1 to 40",
                                                    "(--passing-size 5)"]),
])
def test_sizes_the_methods_cannot_use_are_refused(home, docs, tiny_model, args, words):
    result = ingest(docs, tiny_model, *args)
    assert result.exit_code == 1, result.output
    text = str(result.exception) + " " + result.exception.hint
    for word in words:
        assert word in text, (word, text)
    assert not (home / "contexts").exists() or not [
        f for f in (home / "contexts").iterdir() if not f.name.startswith(".")]


def test_the_smallest_sizes_allowed_still_ingest(home, docs, tiny_model):
    assert ingest(docs, tiny_model, "--method", "apb", "--block-size", "32",
                  "--anchor-size", "1", "--passing-size", "1").exit_code == 0


@pytest.fixture
def group(monkeypatch) -> list[int]:
    """torchrun replaced: records how many workers each group would start, and writes
    nothing (the ingest then fails after the check this is about)."""
    started = []

    def run_workers(job, launch_spec, on_event):
        started.append(launch_spec.workers)
        raise WorkerError("stand-in group", hint="none")

    from starqa.launchers.ingest import steps

    monkeypatch.setattr(steps, "run_workers", run_workers)
    return started


def test_more_workers_than_cores_is_refused_unless_oversubscribed(home, docs, tiny_model,
                                                                  monkeypatch, group):
    monkeypatch.setattr(launch, "cpu_count", lambda: 2)
    result = ingest(docs, tiny_model, "--workers", "64", "--encode-in", "group")
    assert result.exit_code == 1 and group == []
    assert re.match(r"--workers 64 \((\d+) for \1 blocks\) > 2 CPU cores here",
                    str(result.exception)), result.exception
    assert "--workers 2 or fewer" in result.exception.hint
    assert "--oversubscribe" in result.exception.hint
    ingest(docs, tiny_model, "--workers", "64", "--encode-in", "group", "--oversubscribe")
    assert len(group) == 1 and group[0] > 2


def test_more_phase2_workers_than_cores_is_refused(context, monkeypatch):
    """`ask --workers 64` started one worker per block, whatever the cores."""
    monkeypatch.setattr(launch, "cpu_count", lambda: 2)
    result = runner.invoke(app, ["ask", QUESTION, "--workers", "64", "--max-new-tokens", "2"])
    assert result.exit_code == 1
    assert re.match(r"--workers 64 \(\d+ for the context's blocks\) > 2 CPU cores here",
                    str(result.exception)), result.exception
    assert "STARQA_OVERSUBSCRIBE=1" in result.exception.hint
    from starqa.cache.manifest import read_manifest
    from starqa.phase2.placement import phase2_workers

    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", "1")
    manifest = read_manifest(context)
    assert phase2_workers(manifest, Path(manifest.model.path), 64, 1, "cpu")[0] == \
        len(manifest.blocks)


def test_worker_copies_past_the_memory_are_refused(home, docs, tiny_model, monkeypatch, group):
    """Each worker loads the model: more copies than the memory available holds is an error
    with the numbers; the default (one per core) starts as many as fit."""
    weights = sum(f.stat().st_size for f in models.weight_files(tiny_model))  # the model's own
    # (other tests may leave prepared weights beside them in the session's folder)
    monkeypatch.setattr(launch, "cpu_count", lambda: 4)
    monkeypatch.setattr(models, "available_memory", lambda: 2 * weights + 1)
    result = ingest(docs, tiny_model, "--workers", "3", "--encode-in", "group")
    assert result.exit_code == 1 and group == []
    assert "--workers 3 need about" in str(result.exception)
    assert "GiB of memory is available" in str(result.exception)
    assert "--workers 2 or fewer" in result.exception.hint
    # pulsar's default, one per core: as many as fit (star's is one with every core)
    ingest(docs, tiny_model, "--method", "pulsar", "--encode-in", "group")
    assert group == [2]


def test_bench_hosts_past_the_cores_start_with_oversubscribe_set(home, tiny_model, monkeypatch,
                                                                 group):
    """`bench` simulates hosts as workers: past the cores its Phase 1 is refused as ingest's
    is, and STARQA_OVERSUBSCRIBE=1 starts them (as it does Phase 2's)."""
    from starqa import engine
    from starqa.core.errors import StarqaError

    monkeypatch.setattr(launch, "cpu_count", lambda: 1)
    opts = engine.TokenIngestOptions(model=str(tiny_model), method="pulsar", workers=2,
                                     measure=True, device="cpu")
    ids = list(range(5, 205))
    with pytest.raises(StarqaError, match="> 1 CPU cores"):
        engine.ingest_tokens(ids, home / "contexts", opts)
    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", "1")
    with pytest.raises(WorkerError):
        engine.ingest_tokens(ids, home / "contexts", opts)
    assert group == [2]


def test_one_worker_on_the_cpu_encodes_in_process(home, docs, tiny_model, monkeypatch, group):
    """Star's default on a CPU is one worker with every core: encoded in this process, no
    group started (its start would be seconds of waiting); pulsar's starts its group."""
    monkeypatch.setattr(launch, "cpu_count", lambda: 2)
    result = runner.invoke(app, ["ingest", str(docs), "--model", str(tiny_model),
                                 "--block-size", "40", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert group == [] and "on 1 worker," in " ".join(result.output.split())
    result = runner.invoke(app, ["ingest", str(docs), "--model", str(tiny_model),
                                 "--block-size", "40", "--device", "cpu", "--method", "pulsar"])
    assert result.exit_code == 1 and group == [2]


@pytest.mark.parametrize("device, gpus, method, expected", [
    ("cpu", 0, "star", 1), ("auto", 0, "star", 1), ("cpu", 0, "pulsar", 4),
    ("cpu", 0, "dense", 1), ("auto", 3, "star", 3), ("cuda", 3, "pulsar", 3)])
def test_default_phase1_workers(monkeypatch, device, gpus, method, expected):
    """Without --workers: all GPUs, else all cores, but one worker with every core for
    star on a CPU (it encodes the anchor once a worker)."""
    import torch

    from starqa.launchers.ingest.options import IngestOptions
    from starqa.launchers.ingest.workers import workers_for

    monkeypatch.setattr(launch, "cpu_count", lambda: 4)
    monkeypatch.setattr(models, "cuda_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    opts = IngestOptions(paths=(), device=device)
    assert workers_for(opts, method, 8) == expected
    assert workers_for(IngestOptions(paths=(), device=device, workers=2), method, 8) == \
        (1 if method == "dense" else 2)


# ---------------------------------------------------------------------------------------
# campaign: the cache on disk, the models folder, ingest's options (beyond issue #45)


def _no_space(*args, **kw):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")


def _assert_disk_full(result) -> None:
    """What `starqa`'s entry point turns into "ran out of disk space ... the cache is as it
    was before" (CliRunner hands back the exception itself)."""
    import errno

    from starqa.core.errors import disk_full

    assert isinstance(result.exception, OSError), result.exception
    assert result.exception.errno == errno.ENOSPC
    assert "ran out of disk space" in str(disk_full(result.exception, "starqa"))


def test_a_full_disk_while_writing_a_block_is_named(context, docs, tiny_model, monkeypatch):
    """safetensors reports a full disk as a SafetensorError: a traceback, where a worker's
    OSError says what happened. The previous version stays and answers."""
    import safetensors.torch

    (docs / "code.py").write_text("retry limit default is nine \n" * 6)
    save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    _assert_disk_full(ingest(docs, tiny_model))
    contexts = context.parent
    assert [f.name for f in contexts.iterdir() if not f.name.startswith(".")] == [context.name]
    assert not list(contexts.glob(".staging-*"))
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)  # the disk has room again
    assert ask().exit_code == 0 and ingest(docs, tiny_model).exit_code == 0


def test_a_full_disk_while_building_indexes_is_named(context, monkeypatch):
    """faiss reports a full disk as a RuntimeError in words: `starqa index` showed a
    traceback. Now it is the disk-full error, and nothing of the set is left."""
    import faiss

    def no_space(index, path):
        raise RuntimeError(f"Error in faiss::write_index: write error in {path}: 2086 != 2560 "
                           "(No space left on device)")

    write_index = faiss.write_index
    monkeypatch.setattr(faiss, "write_index", no_space)
    _assert_disk_full(runner.invoke(app, ["index", "--index", "hnsw"]))
    assert not [p for p in context.iterdir() if "index-" in p.name]
    assert "indexes" not in json.loads((context / MANIFEST).read_text()) or \
        json.loads((context / MANIFEST).read_text())["indexes"] == []
    assert ask().exit_code == 0
    monkeypatch.setattr(faiss, "write_index", write_index)  # the disk has room again
    assert runner.invoke(app, ["index", "--index", "hnsw"]).exit_code == 0


def test_a_failed_json_write_leaves_no_temporary(context, monkeypatch):
    """On a full disk `ask` still answers (remembering verified hashes is optional), but
    each run left a `..verified.json.<pid>.tmp` beside the shards, never cleaned."""
    import errno
    import os

    (context / ".verified.json").unlink()  # to be written again by this ask

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert ask().exit_code == 0
    assert not [p.name for p in context.iterdir() if p.name.endswith(".tmp")]


def test_a_model_replaced_in_its_folder_is_named(home, docs, tiny_model, tmp_path):
    """The folder a context was ingested with now holds another model: the hint said "ask
    with --model <that same folder>", which fails the same way. Now it says what changed
    and the two ways out that work."""
    import shutil

    from tiny import make_tiny_model

    model = tmp_path / "mine" / "tiny-llama"
    shutil.copytree(tiny_model, model)
    assert ingest(docs, model).exit_code == 0
    shutil.rmtree(model)
    make_tiny_model(model, seed=1)
    result = ask()
    assert result.exit_code == 1
    assert f"The model now at {model}" in str(result.exception)
    assert "weights changed since" in str(result.exception)
    assert "ask with --model" not in result.exception.hint
    assert f"put the model the context was made with back at {model}" in result.exception.hint


def test_a_reserve_not_below_the_window_is_refused(home, docs, tiny_model):
    """--reserve 512 of a 512-token window: no context could ever leave that room, yet with
    --beyond-window it was recorded (and every later ask needed --beyond-window)."""
    result = ingest(docs, tiny_model, "--reserve", "512", "--beyond-window")
    assert result.exit_code == 1
    assert "--reserve 512 is not less than the 512 tokens" in str(result.exception)
    assert "--reserve 128" in result.exception.hint


@pytest.mark.parametrize("size", ["0", "-5"])
def test_a_max_file_size_below_one_byte_is_refused(home, docs, tiny_model, size):
    """It was taken, every file skipped "too large", and the hint said nothing of why."""
    result = ingest(docs, tiny_model, "--max-file-size", size)
    assert result.exit_code == 1
    assert f"--max-file-size {size} skips every file" in str(result.exception)
    assert "--max-file-size 1000000" in result.exception.hint


def test_a_file_where_the_block_store_goes_is_named(context, docs, tiny_model):
    """A file named `.blocks` in the contexts folder: FileExistsError's traceback."""
    store = context.parent / ".blocks"
    import shutil

    shutil.rmtree(store)
    store.write_text("not a folder")
    (docs / "code.py").write_text("retry limit default is nine \n" * 6)
    result = ingest(docs, tiny_model)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{store} is not a folder" in str(result.exception)
    assert f"rm {store}" in result.exception.hint
    assert ask().exit_code == 0  # the previous version is intact


@pytest.mark.parametrize("damage", ["emptied", "a folder"])
def test_a_shard_emptied_or_replaced_by_a_folder_is_named(context, docs, tiny_model, damage):
    """Already right before: named with the re-ingest that rebuilds it (kept as a guard)."""
    shard = context / "block_00001.safetensors"
    shard.unlink()
    if damage == "a folder":
        shard.mkdir()
    else:
        shard.write_bytes(b"")
    result = ask()
    assert result.exit_code == 1 and "block_00001.safetensors" in str(result.exception)
    assert "re-ingest" in result.exception.hint
    assert ingest(docs, tiny_model).exit_code == 0 and ask().exit_code == 0


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                      ("0", False), ("false", False), ("off", False), ("", False)])
def test_oversubscribe_reads_on_and_off(value, on, monkeypatch):
    from starqa.runtime import launch

    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", value)
    assert launch.oversubscribed() is on


def test_an_oversubscribe_that_is_neither_is_an_error(monkeypatch):
    from starqa.runtime import launch

    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", "maybe")
    with pytest.raises(StarqaError, match="neither on nor off") as raised:
        launch.oversubscribed()
    assert "STARQA_OVERSUBSCRIBE=1" in raised.value.hint
