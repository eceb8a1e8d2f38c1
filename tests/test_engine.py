"""ingest + ask end to end through the real torchrun launch path (gloo, CPU), on a tiny
random Llama in fp32, and every error a user can hit. Where torchrun's launch is not the
point of a test (the answer, the error or the warm group is), its ingest encodes in this
process (`encode_in="process"`, the same blocks a group writes) or copies one made once
per session (`conftest.ingested`)."""

import json
import subprocess
import sys
import time

import pytest
import torch

from starqa import engine
from starqa.core import paths
from starqa.cache import store
from starqa.core.errors import ShardError, StarqaError, WorkerError
from starqa.models import load_model, load_tokenizer
from fakes import install_home, starqa
from tiny import context_ids, make_tiny_model, reference_tokens

QUESTION = "who approved the travel budget"


def ingest(docs, model, **kw):
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                              **kw))


def ask(model=None, **kw):
    return engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8,
                                        model=str(model) if model else None, **kw))


@pytest.mark.slow
def test_dense_ingest_two_worker_ask_equals_transformers_generate(home, docs, tiny_model):
    result = ingest(docs, tiny_model, method="dense", block_size=50, encode_in="process")
    manifest = result.manifest
    assert not result.cache_hit and len(manifest.blocks) >= 3
    answer = ask(workers=2)
    assert answer.workers == 2
    assert list(answer.token_ids) == reference_tokens(tiny_model, manifest, QUESTION, 8)
    assert len(answer.token_ids) > 0


@pytest.mark.slow
@pytest.mark.torchrun
def test_star_two_workers_through_torchrun(home, docs, tiny_model):
    result = ingest(docs, tiny_model, method="star", workers=2, block_size=40)
    m = result.manifest
    assert result.workers == 2 and m.method.as_dict() == {"name": "star", "block_size": 40,
                                                           "anchor_size": 40, "params": {}}
    assert {f.path for f in m.files} == {"code.py", "policy/leave.md", "policy/travel.md"}
    spans = sorted((f.token_start, f.token_end) for f in m.files)
    assert all(a < b for a, b in spans) and spans[-1][1] <= m.n_tokens
    # Blocks follow files (issue #14): block 0 is the anchor's 40 tokens; after it every
    # block holds at most 40 and every file after block 0 starts a block.
    assert (m.blocks[0].start, m.blocks[0].end) == (0, 40)
    assert all(b.end - b.start <= 40 for b in m.blocks) and m.blocks[-1].end == m.n_tokens
    assert {a for a, _ in spans if a > 40} <= {b.start for b in m.blocks}
    for block in m.blocks:
        assert len(block.sha256) == 64 and block.bytes > 0
    # The merge is exact whatever the partition: 1 and 2 workers give the same tokens.
    two, one = ask(workers=2), ask(workers=1)
    assert two.token_ids == one.token_ids and two.workers == 2 and one.workers == 1
    # Unchanged input, same model and settings: a cache hit, no workers started.
    again = ingest(docs, tiny_model, method="star", workers=2, block_size=40)
    assert again.cache_hit and again.manifest.key == m.key


@pytest.mark.slow
def test_star_single_block_answers_like_dense(home, docs, tiny_model):
    star = ingest(docs, tiny_model, method="star", block_size=10_000, name="star1",
                  encode_in="process")
    dense = ingest(docs, tiny_model, method="dense", block_size=10_000, name="dense1",
                   encode_in="process")
    assert star.manifest.key != dense.manifest.key
    assert ask(context="star1").token_ids == ask(context="dense1").token_ids


# --------------------------------------------------------------------------- errors


def test_missing_path(home, tiny_model, tmp_path):
    with pytest.raises(StarqaError, match="No such file or directory"):
        ingest(tmp_path / "nope", tiny_model)


def test_folder_with_nothing_readable(home, tiny_model, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "blob.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(StarqaError, match="Nothing to ingest") as err:
        ingest(tmp_path / "bin", tiny_model)
    assert "binary" in err.value.hint


def test_context_longer_than_window(home, tmp_path, docs):
    small = make_tiny_model(tmp_path / "small", window=64)
    with pytest.raises(StarqaError, match=r"tokens > 64 the model was trained on") as err:
        ingest(docs, small)
    assert "--beyond-window" in err.value.hint
    assert not list(paths.contexts_dir().glob("*")) if paths.contexts_dir().exists() else True


def test_ask_without_context(home):
    with pytest.raises(StarqaError, match="No ingested context"):
        ask()


@pytest.mark.slow
def test_ask_unknown_context_name(home, docs_context):
    with pytest.raises(StarqaError, match="No context named 'nope'"):
        ask(context="nope")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_missing_or_corrupt_shard_is_named(home, docs, tiny_model, ingested, damage):
    m = install_home(ingested(tiny_model, method="dense", block_size=60), home)
    shard = m.folder / m.blocks[1].file
    if damage == "delete":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0xFF
        shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=shard.name) as err:
        ask()
    assert "starqa ingest" in err.value.hint


@pytest.mark.slow
def test_model_that_does_not_match_the_manifest(home, docs_context, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(StarqaError, match="does not match the model"):
        ask(model=other)


@pytest.mark.slow
def test_worker_death_shows_stderr_and_keeps_previous_cache(home, docs, tiny_model, monkeypatch):
    first = ingest(docs, tiny_model, method="star", workers=2, block_size=40,
                   encode_in="process").manifest
    before = sorted(p.name for p in first.folder.iterdir())
    monkeypatch.setenv("STARQA_FAULT", "ingest:1")
    with pytest.raises(WorkerError, match="injected fault in ingest on rank 1"):
        ingest(docs, tiny_model, method="star", workers=2, block_size=40, force=True)
    root = paths.contexts_dir()
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]  # no partial cache
    assert sorted(p.name for p in first.folder.iterdir()) == before
    monkeypatch.delenv("STARQA_FAULT")
    assert len(ask().token_ids) > 0  # the previous cache still answers


def test_cli_error_exit_code_and_message(home, tmp_path):
    proc = starqa("ingest", str(tmp_path / "missing"))
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_ingest_and_ask_json(home, docs, tiny_model):
    ing = starqa("ingest", str(docs), "--model", str(tiny_model), "--dtype", "fp32",
              "--workers", "2", "--block-size", "50")
    assert ing.returncode == 0, ing.stderr
    assert "Ingested docs" in ing.stderr
    hit = starqa("ingest", str(docs), "--model", str(tiny_model), "--dtype", "fp32",
              "--workers", "2", "--block-size", "50")
    assert "Cache hit" in hit.stderr
    out = starqa("ask", QUESTION, "--json", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["context"] == "docs" and data["tokens"]["answer"] <= 4
    # Phase 2 on one machine whose memory holds model and shards: one worker, every core
    assert data["method"] == "star" and data["workers"] == 1


@pytest.mark.slow
def test_two_machines_on_loopback(home, docs, tiny_model):
    """torchrun's multi-node options pass through: two launchers, one worker each, meeting at
    a rendezvous endpoint on 127.0.0.1, sharing one cache; node 0 commits, node 1 streams."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(command, rank, *extra):
        return subprocess.Popen(
            [sys.executable, "-m", "starqa", command, *extra, "--nnodes", "2", "--node-rank",
             str(rank), "--workers", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    ingest_args = (str(docs), "--model", str(tiny_model), "--dtype", "fp32", "--block-size", "60")
    nodes = [run("ingest", rank, *ingest_args) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "Ingested docs" in outs[0][1] and "node 0 commits" in outs[1][1]
    manifest = store.find_context(paths.contexts_dir(), "docs")
    assert manifest.ingest.workers == 2

    port += 1
    nodes = [run("ask", rank, QUESTION, "--max-new-tokens", "6") for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert outs[0][0] == ""  # node 0 holds the first blocks: the answer streams on node 1
    single = engine.ask(engine.AskOptions(QUESTION, max_new_tokens=6, workers=2))
    assert outs[1][0].strip() == single.text and single.text


def test_cli_usage_error_is_not_a_traceback(home):
    proc = starqa("ask")
    assert proc.returncode == 2
    assert "give the question to answer" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ring_two_workers_equals_dense(home, docs, tiny_model):
    """Ring Attention is exact: its shards match dense's and so do the greedy tokens."""
    from starqa.cache.shards import load_block

    ring = ingest(docs, tiny_model, method="ring", workers=2, block_size=50, name="ring")
    dense = ingest(docs, tiny_model, method="dense", block_size=50, name="dense",
                   encode_in="process")
    assert ring.workers == 2 and ring.manifest.method.name == "ring"
    for i in range(len(dense.manifest.blocks)):
        ring_block, dense_block = load_block(ring.manifest, i), load_block(dense.manifest, i)
        for r, d in zip(ring_block[:2], dense_block[:2]):
            torch.testing.assert_close(r, d, rtol=1e-4, atol=1e-4)
        assert torch.equal(ring_block[2], dense_block[2])  # the same token ids
    assert ask(context="ring", workers=2).token_ids == ask(context="dense", workers=2).token_ids


@pytest.mark.slow
@pytest.mark.torchrun
def test_pulsar_two_workers_through_torchrun(home, docs, tiny_model):
    result = ingest(docs, tiny_model, method="pulsar", workers=2, block_size=50,
                    method_params={"sink": 8, "chunk": 4, "budget_frac": 0.25,
                            "positions": "contiguous", "heuristic": "bm25"})
    m = result.manifest
    assert m.method.params == {"sink": 8, "heuristic": "bm25", "budget_frac": 0.25,
                                     "chunk": 4, "positions": "contiguous"}
    assert 50 < m.query_position < m.n_tokens  # after the longest assembled block
    two, one = ask(workers=2), ask(workers=1)
    assert two.token_ids == one.token_ids and len(two.token_ids) > 0
    with pytest.raises(StarqaError, match="--heuristic only applies to --method pulsar"):
        ingest(docs, tiny_model, method="star", method_params={"heuristic": "bm25"})
    with pytest.raises(StarqaError, match="Unknown --heuristic"):
        ingest(docs, tiny_model, method="pulsar", method_params={"heuristic": "nope"})


def test_ask_with_only_an_old_format_context(home):
    old = paths.contexts_dir() / "0123456789abcdef"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": 1, "name": "old"}))
    with pytest.raises(StarqaError, match=r"most recently used context \(0123456789abcdef\) "
                                          r"is damaged: .*incompatible starqa") as err:
        ask()
    assert "cache --clean" in err.value.hint


@pytest.mark.slow
def test_apb_workers_equal_blocks_encoded_in_order(home, docs, tiny_model):
    """Two workers pass compressed KV round by round (one all-gather per layer, an idle
    worker in a short last round); the shards equal encoding the blocks in order in one
    process, and ask answers from them."""
    from starqa.phase1 import hooks
    from starqa import methods
    from starqa.cache.shards import load_block

    result = ingest(docs, tiny_model, method="apb", workers=2, block_size=50,
                    method_params={"passing": 6, "window": 8})
    m = result.manifest
    assert result.workers == 2 and len(m.blocks) % 2 == 1  # a short last round
    assert m.method.as_dict() == {"name": "apb", "block_size": 50, "anchor_size": 12,
                                  "params": {"passing": 6, "window": 8, "question": None}}
    model = load_model(tiny_model, dtype=torch.float32, attn_implementation=hooks.register())
    ids = torch.tensor(context_ids(tiny_model, m))
    blocks = [(b.start, b.end) for b in m.blocks]
    for i, k, v in methods.get(m.method.name).encode_local(model, ids, m.method, blocks):
        stored_k, stored_v, stored_ids = load_block(m, i)
        assert stored_ids.tolist() == ids[blocks[i][0]:blocks[i][1]].tolist()
        torch.testing.assert_close(stored_k, k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stored_v, v, rtol=1e-4, atol=1e-4)
    assert len(ask(workers=2).token_ids) > 0
    # A question known at encoding time joins the anchor: another cache, ids recorded.
    known = ingest(docs, tiny_model, method="apb", workers=2, block_size=40,
                   method_params={"question": QUESTION}, name="known", encode_in="process")
    params = known.manifest.method.params
    assert known.manifest.key != m.key and params["question"] == QUESTION
    assert params["question_ids"] == load_tokenizer(tiny_model).encode(
        QUESTION, add_special_tokens=False)


# --------------------------------------------------------------------------- answer speed


@pytest.mark.slow
@pytest.mark.torchrun
def test_one_worker_in_process_equals_torchrun_and_transformers(home, docs, tiny_model,
                                                               monkeypatch):
    """A cold ask whose model and shards fit answers in this process (a world of one, no
    torchrun), with the tokens of 2 and 3 torchrun workers and of transformers' generate."""
    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", "1")  # 3 workers on 2 cores: the merge is the test
    manifest = ingest(docs, tiny_model, method="dense", block_size=50,
                      encode_in="process").manifest
    here = ask()
    assert here.workers == 1 and here.weights == "dense"  # a local folder: dense weights
    assert list(here.token_ids) == reference_tokens(tiny_model, manifest, QUESTION, 8)
    assert here.sources and sum(s.share for s in here.sources) <= 1 + 1e-6
    for workers in (2, 3):
        there = ask(workers=workers)
        assert there.token_ids == here.token_ids
        # attribution adds up across workers: the same files, lines and shares
        assert [(s.path, s.lines) for s in there.sources] == \
            [(s.path, s.lines) for s in here.sources]
        for a, b in zip(there.sources, here.sources):
            assert abs(a.share - b.share) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("keepalive", [60, -1])  # -1: a group that never exits on its own
def test_a_cold_ask_leaves_a_warm_group(home, docs_context, keepalive):
    """Warm by default: the first ask starts a group in the background (keep-alive), the
    next ask is answered by it with the same tokens, and `stop` ends it."""
    from starqa.workers import client

    cold = ask(keepalive=keepalive)
    assert not cold.warm
    deadline = time.monotonic() + 120
    while (group := client.find(cold.context.key)) is None:
        assert time.monotonic() < deadline, "no warm group appeared"
        time.sleep(0.2)
    try:
        assert group.keepalive == keepalive and group.workers == 1
        warm = ask()
        assert warm.warm and warm.token_ids == cold.token_ids
        # A second group for the same context refuses to start (one group per context).
        with pytest.raises(StarqaError, match="already running"):
            engine.serve(engine.ServeOptions(context=cold.context.key))
    finally:
        conn = client.Client(group)
        conn.stop()
        conn.close()
