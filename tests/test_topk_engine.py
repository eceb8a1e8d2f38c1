"""Top-k attention end to end on the tiny model: exactness with every key on 1, 2 and 3
workers, indexes built at ingest or on first use, checksummed, rebuilt; every bad input."""

import json

import pytest

from starqa import engine
from starqa.topk import indexes
from starqa.core.errors import ShardError, StarqaError
from starqa.topk.indexes import TopK
from fakes import starqa

QUESTION = "who approved the travel budget"


def ingest(docs, model, **kw):
    return engine.ingest(engine.IngestOptions(paths=(str(docs),), model=str(model), dtype="fp32",
                                              **kw))


def ask(**kw):
    return engine.ask(engine.AskOptions(question=QUESTION, max_new_tokens=8, **kw))


@pytest.mark.slow
def test_every_key_gives_exact_greedy_tokens_on_1_2_3_workers(home, docs, tiny_model, monkeypatch):
    """k = 100% of the context >= every shard: top-k attention is exact attention, whatever
    the index and however the blocks are spread over workers; a small k is not."""
    monkeypatch.setenv("STARQA_OVERSUBSCRIBE", "1")  # 3 workers on 2 cores: the merge is the test
    manifest = ingest(docs, tiny_model, method="dense", block_size=50).manifest
    assert len(manifest.blocks) >= 3
    exact = ask()
    assert exact.token_ids and exact.attention == "exact"
    for kind, workers in [("flat", None), ("flat", 2), ("flat", 3), ("ivf", None), ("ivf", 3),
                          ("hnsw", 2)]:
        every = TopK(fraction=1.0, index=kind)
        answer = ask(topk=every, workers=workers)
        assert answer.token_ids == exact.token_ids, (kind, workers)
        assert answer.sources is None and answer.attention.startswith("top-k 100% (" + kind)
    # one key per row and layer: attention changes, the question's too under prefill topk
    one = ask(topk=TopK(count=1, prefill="topk"))
    assert one.token_ids != exact.token_ids
    # the question attends every key (prefill exact, the default): the first token, which
    # its forward picks, is exact's
    assert ask(topk=TopK(count=1)).token_ids[0] == exact.token_ids[0]


@pytest.mark.slow
def test_indexes_built_at_ingest_are_named_and_checksummed(home, docs, tiny_model):
    manifest = ingest(docs, tiny_model, method="star", block_size=60, workers=2,
                      index="ivf").manifest
    (found,) = manifest.indexes
    assert found.kind == "ivf" and found.build_seconds > 0
    layers, heads = 2, 2  # the tiny Llama
    assert {(f.block, f.layer, f.head) for f in found.files} == {
        (b, layer, h) for b in range(len(manifest.blocks)) for layer in range(layers)
        for h in range(heads)}
    from starqa.cache.shards import sha256_file

    for entry in found.files:
        assert sha256_file(manifest.folder / found.folder / entry.file) == entry.sha256
    stamp = (manifest.folder / "manifest.json").stat().st_mtime_ns
    assert ask(topk=TopK(fraction=0.5, index="ivf")).token_ids
    assert (manifest.folder / "manifest.json").stat().st_mtime_ns == stamp  # nothing built
    # A cache hit asking for another kind builds that one too, keeping the first.
    again = ingest(docs, tiny_model, method="star", block_size=60, workers=2, index="hnsw")
    assert again.cache_hit and [s.kind for s in again.manifest.indexes] == ["ivf", "hnsw"]


@pytest.mark.slow
def test_lazy_build_on_the_first_topk_question(home, docs, tiny_model):
    manifest = ingest(docs, tiny_model, method="dense", block_size=60).manifest
    assert manifest.indexes == ()
    first = ask(topk=TopK(fraction=0.5, index="hnsw"))
    from starqa.cache.manifest import read_manifest

    built = indexes.find_set(read_manifest(first.context.folder), "hnsw")
    assert built is not None and (manifest.folder / built.folder).is_dir()
    assert ask(topk=TopK(fraction=0.5, index="hnsw")).token_ids == first.token_ids


@pytest.mark.slow
def test_read_only_cache_without_indexes_is_a_clear_error(home, docs, tiny_model, monkeypatch):
    """(Tests run as root here, which writes through permission bits: the folder is made
    read-only for `os.access`, as it is for any other user.)"""
    manifest = ingest(docs, tiny_model, method="dense", block_size=60).manifest
    real = indexes.os.access
    monkeypatch.setattr(indexes.os, "access",
                        lambda p, mode: False if str(p) == str(manifest.folder) else real(p, mode))
    with pytest.raises(StarqaError, match="has no ivf indexes .* read-only") as err:
        ask(topk=TopK(fraction=0.5, index="ivf"))
    assert f"starqa index {manifest.key} --index ivf" in err.value.hint
    assert ask(topk=TopK(fraction=0.5, index="flat")).token_ids  # flat needs no index


@pytest.mark.slow
def test_corrupt_index_is_caught_by_its_checksum_and_rebuilt(home, docs, tiny_model):
    manifest = ingest(docs, tiny_model, method="dense", block_size=60, index="ivf").manifest
    (found,) = manifest.indexes
    good = ask(topk=TopK(fraction=0.5, index="ivf"))
    victim = manifest.folder / found.folder / found.files[3].file
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=victim.name) as err:
        ask(topk=TopK(fraction=0.5, index="ivf"))
    command = f"starqa index {manifest.key} --index ivf"
    assert command in err.value.hint
    proc = starqa(*command.split()[1:])
    assert proc.returncode == 0, proc.stderr
    assert not (manifest.folder / found.folder).exists()  # the damaged set is gone
    assert ask(topk=TopK(fraction=0.5, index="ivf")).token_ids == good.token_ids


@pytest.mark.slow
def test_kv_on_disk_answers_as_in_memory(home, docs, tiny_model):
    """Values (and flat's keys, ivf's lists) memory-mapped from the cache: the same
    keys, the same tokens. (Each worker keeps its own k: 2 workers attend to up to 2k keys.)"""
    ingest(docs, tiny_model, method="dense", block_size=50)
    for kind, workers, prefill in (("flat", None, "topk"), ("flat", 2, "topk"),
                                   ("ivf", None, "topk"), ("ivf", 2, "topk"),
                                   ("flat", None, "exact"), ("ivf", 2, "exact")):
        wanted = ask(topk=TopK(count=20, index=kind, prefill=prefill), workers=workers).token_ids
        assert ask(topk=TopK(count=20, index=kind, kv_on_disk=True, prefill=prefill),
                   workers=workers).token_ids == wanted


@pytest.mark.parametrize("args,says", [
    (["--attention", "topk", "--top-k", "0"], "keeps no key at all"),
    (["--attention", "topk", "--top-k", "150%"], "more than the whole context"),
    (["--attention", "topk", "--top-k", "lots"], "neither a number of keys nor a percentage"),
    (["--top-k", "1%"], "only apply to --attention topk"),
    (["--attention", "topk", "--index", "lsh"], "Unknown --index"),
    (["--attention", "topk", "--top-k-prefill", "fast"], "Unknown --top-k-prefill"),
    (["--top-k-prefill", "topk"], "only apply to --attention topk"),
    (["--attention", "topk", "--index", "ivf", "--top-k-tail", "most"], "Unknown --top-k-tail"),
    (["--attention", "topk", "--top-k-tail", "lists"], "--index flat has none"),
    (["--top-k-tail", "none"], "only apply to --attention topk"),
])
def test_cli_bad_topk_options(home, args, says):
    proc = starqa("ask", "q", *args)
    assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_ask_json_with_topk(home, docs, tiny_model):
    ingest(docs, tiny_model, method="dense", block_size=60)
    proc = starqa("ask", QUESTION, "--json", "--max-new-tokens", "3", "--attention", "topk",
                  "--top-k", "10", "--top-k-schedule", "linear", "--index", "ivf")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["attention"] == "top-k 10 (ivf, linear)" and data["sources"] is None


@pytest.mark.slow
def test_a_warm_group_answers_only_with_its_own_attention(home, docs, tiny_model):
    """A cold top-k ask leaves a top-k warm group; the same settings are answered warm,
    exact attention is not (it answers cold, with its own tokens)."""
    import time

    from starqa.workers import client

    ingest(docs, tiny_model, method="star", block_size=50)
    few = TopK(count=5, index="ivf")
    cold = ask(topk=few, keepalive=60)
    deadline = time.monotonic() + 120
    while (group := client.find(cold.context.key)) is None:
        assert time.monotonic() < deadline, "no warm group appeared"
        time.sleep(0.2)
    try:
        assert group.topk == few.as_dict()
        warm = ask(topk=few)
        assert warm.warm and warm.token_ids == cold.token_ids and warm.sources is None
        exact = ask()
        assert not exact.warm and exact.attention == "exact"
    finally:
        conn = client.Client(group)
        conn.stop()
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_a_row_under_topk_is_the_same_alone_or_with_drafts(home, docs, tiny_model, kind):
    """A forward's rows (a token and the tokens drafted after it, decode.generate) each get
    exactly what a forward of that row alone gets, the question's own keys included (seen
    causally): drafts never change a top-k answer either. (The own part went through a
    kernel that rounds differently for one row and for several.)"""
    import torch

    from starqa.runtime import dist
    from starqa.core import paths
    from starqa.cache import store
    from starqa.phase2.answerer import Answerer

    ingest(docs, tiny_model, block_size=50)
    manifest = indexes.ensure(store.find_context(paths.contexts_dir(), None), kind)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), manifest.model.path,
                                   topk=TopK(count=4, index=kind))
    hook, config = answerer.hook, answerer.decoder.config
    # every layer's kernel table made as the worker loaded, none on its first answer
    tables = hook.retriever._tables
    assert sorted(tables) == list(range(config.layers))
    assert all(table is not None and not table.selects_only for table in tables.values())
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = config.heads, config.kv_heads, config.head_dim
    query = torch.randn(1, heads, 6, dim, generator=generator)
    key = torch.randn(1, kv_heads, 6, dim, generator=generator)
    value = torch.randn(1, kv_heads, 6, dim, generator=generator)
    hook.begin(16)
    hook.attention(0, query[:, :, :2], key[:, :, :2], value[:, :, :2])  # the question so far
    hook.advance(2)
    together = hook.attention(0, query[:, :, 2:], key[:, :, 2:], value[:, :, 2:])
    for row in range(4):  # the same 4 tokens, one forward each
        alone = hook.attention(0, query[:, :, 2 + row:3 + row], key[:, :, 2 + row:3 + row],
                               value[:, :, 2 + row:3 + row])
        hook.advance(1)
        assert torch.equal(alone[:, :, 0], together[:, :, row]), row


@pytest.mark.slow
def test_topk_answers_without_drafts_unless_asked(home, docs, tiny_model, monkeypatch):
    """Under top-k each drafted row selects its own keys, so drafts cost more than they
    save: none by default; STARQA_DRAFT_TOKENS still sets them."""
    from starqa.runtime import dist
    from starqa.core import paths
    from starqa.cache import store
    from starqa.phase2.answerer import Answerer

    ingest(docs, tiny_model, block_size=50)
    manifest = store.find_context(paths.contexts_dir(), None)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), manifest.model.path,
                                   topk=TopK(count=4))
    monkeypatch.delenv("STARQA_DRAFT_TOKENS", raising=False)
    assert answerer.request([5, 6], 4, set()).draft_tokens == 0
    monkeypatch.setenv("STARQA_DRAFT_TOKENS", "2")
    assert answerer.request([5, 6], 4, set()).draft_tokens == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_topk_answers_asked_together_equal_answers_alone(home, docs, tiny_model, kind):
    """Questions decoded together under top-k attention (each row selects its own keys,
    each question attends its own KV): each gets the tokens it gets alone."""
    from starqa.runtime import dist
    from starqa.core import paths
    from starqa.cache import store
    from starqa.phase2 import decode
    from starqa.phase2.answerer import Answerer

    ingest(docs, tiny_model, block_size=50)
    manifest = indexes.ensure(store.find_context(paths.contexts_dir(), None), kind)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), manifest.model.path,
                                   topk=TopK(count=4, index=kind))
    questions = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    alone = [answerer.answer(q, 8, set())[0] for q in questions]
    batch = answerer.batch()
    joined = [batch.join(answerer.request(q, 8, set())) for q in questions[:3]]
    batch.step()
    joined.append(batch.join(answerer.request(questions[3], 8, set())))
    while batch.active:
        batch.step()
    batch.close()
    assert [a.generated for a in joined] == alone and all(alone)
