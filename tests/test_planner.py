"""What `ingest` plans for a context past the model's window (star blocks at contiguous
positions, sized to the window), the line that says it, and what those blocks are: each an
ordinary forward of [anchor ‖ block] at positions 0..a+len−1, reused as it is after it moves."""

import math
import time
from dataclasses import replace

import pytest
import torch

from starqa import engine, methods
from starqa.core.errors import StarqaError
from starqa.launchers.ingest import planner
from starqa.launchers.ingest.options import IngestOptions
from starqa.methods import method_config, plan_blocks
from tiny import make_tiny_model

QWEN_KV = 28 * 2 * 128 * 2 * 2  # Qwen2.5-Coder-1.5B's bytes of bf16 KV per token: 28,672


def KV(kv: str) -> int:  # noqa: N802 (a table, as the planner reads it)
    return QWEN_KV if kv == "float" else 14_784
GIB = 1 << 30


def opts(**kw) -> IngestOptions:
    return IngestOptions(paths=("repo",), reserve=512, **kw)


@pytest.mark.parametrize("n, window, block, slots", [
    (100_579, 32_768, 4096, 6), (374_303, 32_768, 4096, 6), (1_000_000, 32_768, 4096, 6),
    (40_000, 32_768, 4096, 6), (16_384, 8192, 3840, 1), (9000, 8192, 2304, 2)])
def test_past_the_window_star_blocks_fit_it(n, window, block, slots):
    """click (100K), rich (374K), a million tokens, one just past the window: blocks of
    4,096 (methods.PAST_WINDOW_BLOCK: Phase 1's attention per token grows with the block),
    the anchor as long, positions contiguous in as many slots as the window holds beside
    the anchor and the reserve; in a smaller window, at most half of what it leaves beside
    the reserve (on a grid of 256), and at most the paper's quarter of the context."""
    choice = planner.plan(opts(), n, window, KV, 24 * GIB, 22 * GIB)
    assert choice.opts.method_params == {"positions": "contiguous", "slots": slots}
    assert (choice.opts.block_size, choice.opts.anchor_size) == (block, block)
    assert block + block + 512 <= window
    assert choice.line.startswith(f"Plan: {n:,} tokens + 512 reserved > the {window:,}-token "
                                  f"window: star blocks of {block:,} tokens")
    config = method_config("star", n, choice.opts.block_size, choice.opts.anchor_size,
                           choice.opts.method_params)
    query = methods.get("star").query_position(range(n), config, plan_blocks(n, block))
    assert query + 512 <= window  # the question and its answer stay within the window too


def test_the_line_says_what_the_kv_takes_and_where_it_lives():
    """Past the window the KV is int8 whatever the memory, on one machine or several (it
    keeps float's accuracy there at half the bytes), and the line says why; float stays
    float when asked for, and a KV of more than half the memory available is read from disk.
    Within a window that holds it, 374K tokens of bf16 KV (10.7 GB) fit half of 24 GiB:
    float; on a 16 GiB machine float would take more than half: int8, and the line says
    why; across machines, float (their memories may differ, their choices may not)."""
    past = planner.plan(opts(), 374_303, 32_768, KV, 24 * GIB, 22 * GIB)
    assert past.opts.kv == "int8"
    assert "KV 5.5 GB in int8 (past the window: it keeps float's accuracy at half the " \
           "bytes), held in memory." in past.line
    assert planner.plan(opts(nnodes=2), 374_303, 32_768, KV, 16 * GIB, 12 * GIB).opts.kv == \
        "int8"
    given = planner.plan(opts(kv="float"), 374_303, 32_768, KV, 24 * GIB, 16 * GIB)
    assert given.opts.kv == "float"  # as asked
    assert "KV 10.7 GB in float, more than half the memory available: ask reads it from " \
           "disk" in given.line
    wide = 1 << 20  # a window that holds the context
    roomy = planner.plan(opts(), 374_303, wide, KV, 24 * GIB, 22 * GIB)
    assert roomy.opts.kv == "float" and roomy.line is None  # it fits: nothing to say
    small = planner.plan(opts(), 374_303, wide, KV, 16 * GIB, 12 * GIB)
    assert small.opts.kv == "int8"
    assert "KV 5.5 GB in int8 (float would take 10.7 GB, more than half of the machine's " \
           "17.2 GB), held in memory." in small.line
    spread = planner.plan(opts(nnodes=2), 374_303, wide, KV, 16 * GIB, 12 * GIB)
    assert spread.opts.kv == "float"  # every machine chooses alike, whatever its memory
    fits = planner.plan(opts(), 30_000, 32_768, KV, GIB, GIB)  # in the window, said for int8
    assert fits.opts.kv == "int8" and fits.line.startswith("Plan: 30,000 tokens fit the")


def test_within_the_window_nothing_changes():
    given = opts(block_size=4096)
    assert planner.plan(given, 32_768 - 512, 32_768, KV, 24 * GIB, GIB) == planner.Choice(
        replace(given, kv="float"), None)


def test_given_sizes_are_kept_or_refused_with_sizes_that_fit():
    choice = planner.plan(opts(block_size=8192), 200_000, 32_768)
    assert (choice.opts.block_size, choice.opts.anchor_size) == (8192, 8192)
    choice = planner.plan(opts(anchor_size=2048), 200_000, 32_768)
    assert (choice.opts.block_size, choice.opts.anchor_size) == (4096, 2048)
    choice = planner.plan(opts(anchor_size=30_000), 200_000, 32_768)
    assert (choice.opts.block_size, choice.opts.anchor_size) == (2256, 30_000)  # the room
    with pytest.raises(StarqaError, match="do not fit the 32,256") as error:
        planner.plan(opts(block_size=20_000, anchor_size=20_000), 200_000, 32_768)
    assert "--block-size 16,128 --anchor-size 16,128" in error.value.hint


def test_settings_that_keep_positions_past_the_window_are_refused():
    for given, asked in ((opts(method="dense"), "--method dense"),
                         (opts(method_params={"positions": "sparse"}), "--positions sparse")):
        with pytest.raises(StarqaError, match=f"{asked} places positions past it") as error:
            planner.plan(given, 100_000, 32_768)
        assert error.value.hint.startswith(f"leave {asked} out")
    with pytest.raises(StarqaError, match="holds no block"):  # a window too small for blocks
        planner.plan(replace(opts(), reserve=16), 200, 64)


def test_beyond_window_extrapolates_as_asked():
    choice = planner.plan(opts(beyond_window=True), 100_000, 32_768)
    assert choice.opts == opts(beyond_window=True, kv="float") and "extrapolates" in choice.line


def test_a_contiguous_block_is_a_forward_of_anchor_and_block_from_position_zero(model):
    """Block 2 after a 10-token anchor equals a causal forward of exactly [c[:10] ‖ c_2] at
    positions 0..10+len−1, so its keys sit where block 1's would: no position past them."""
    ids = torch.arange(100) % 40 + 3
    blocks = plan_blocks(len(ids), 25)
    config = method_config("star", 100, 25, 10, {"positions": "contiguous"})
    [(_, k, v)] = [x for x in methods.get("star").encode_local(model, ids, config, blocks)
                   if x[0] == 2]
    start, end = blocks[2]
    out = model(torch.cat([ids[:10], ids[start:end]])[None], use_cache=True)
    for layer, cached in enumerate(out.past_key_values.layers):
        torch.testing.assert_close(k[layer], cached.keys[0][:, 10:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[layer], cached.values[0][:, 10:], rtol=1e-5, atol=1e-5)
    assert methods.get("star").query_position(ids, config, blocks) == 10 + 25


def test_default_ingest_past_the_window_plans_and_answers(home, docs, tmp_path, capsys):
    """The ~200-token docs on a 160-token window: planned, encoded, asked, within it."""
    small = make_tiny_model(tmp_path / "small", window=160)
    result = engine.ingest(IngestOptions(paths=(str(docs),), model=str(small), dtype="fp32",
                                         encode_in="process"))
    manifest = result.manifest
    assert manifest.n_tokens > 160
    assert manifest.method.params["positions"] == "contiguous"
    assert manifest.query_position + manifest.reserve <= 160 and not manifest.past_window
    answer = engine.ask(engine.AskOptions(question="who approved the travel budget",
                                          max_new_tokens=4, model=str(small), warm=False))
    assert answer.answer_tokens >= 1


@pytest.mark.slow
def test_a_context_ingested_past_the_window_is_asked_past_it(home, docs, tmp_path):
    """`ingest --beyond-window` records a context past the window; `ask` then extrapolates
    as it was built to, cold and warm, with no flag (the room check would refuse every
    question), and the same question with the flag gets the same tokens."""
    from starqa.workers import client

    small = make_tiny_model(tmp_path / "small", window=160)
    manifest = engine.ingest(IngestOptions(paths=(str(docs),), model=str(small), dtype="fp32",
                                           encode_in="process", beyond_window=True)).manifest
    assert manifest.past_window
    question = dict(question="who approved the travel budget", max_new_tokens=4,
                    model=str(small))
    cold = engine.ask(engine.AskOptions(**question, keepalive=60))
    assert not cold.warm and len(cold.token_ids) >= 1
    flagged = engine.ask(engine.AskOptions(**question, beyond_window=True, warm=False))
    assert flagged.token_ids == cold.token_ids
    deadline = time.monotonic() + 120
    while (group := client.find(manifest.key)) is None:
        assert time.monotonic() < deadline, "no warm group appeared"
        time.sleep(0.2)
    try:
        warm = engine.ask(engine.AskOptions(**question))
        assert warm.warm and warm.token_ids == cold.token_ids
    finally:
        conn = client.Client(group)
        conn.stop()
        conn.close()


def test_a_moved_contiguous_block_is_reused_as_it_is(home, repo, tmp_path):
    """An edit that lengthens f5 moves every later block; at contiguous positions their KV
    is the same wherever they lie, so each is linked in as it is (never re-rotated) and the
    context equals one encoded afresh, bit for bit."""
    from safetensors.torch import load_file

    small = make_tiny_model(tmp_path / "small", window=160)
    run = dict(paths=(str(repo),), model=str(small), dtype="fp32", encode_in="process",
               block_size=40)
    first = engine.ingest(IngestOptions(**run)).manifest
    assert first.method.params == {"positions": "contiguous", "slots": 2}
    assert first.n_tokens > 160
    (repo / "f5.md").write_text((repo / "f5.md").read_text() + " the answer")
    result = engine.ingest(IngestOptions(**run))
    assert result.reuse.reused > 0 and result.reuse.rotated == 0
    moved = [b for b in result.manifest.blocks if b.sha256 in {o.sha256 for o in first.blocks}
             and b.start not in {o.start for o in first.blocks}]
    assert moved  # kept where they now lie, not where they were encoded
    kv = [load_file(str(result.manifest.folder / b.file)) for b in result.manifest.blocks]
    fresh = engine.ingest(IngestOptions(**run, force=True)).manifest
    for got, b in zip(kv, fresh.blocks):
        want = load_file(str(fresh.folder / b.file))
        assert torch.equal(got["k"], want["k"]) and torch.equal(got["v"], want["v"])


def test_context_bias_is_the_overlap_of_keys_on_positions():
    """16K in blocks of 3,840 after a 3,840-token anchor: 12,444 keys share 3,840 positions."""
    assert methods.context_bias(16_284, 7_680, 3_840) == pytest.approx(math.log(3_840 / 12_444))
    assert methods.context_bias(16_284, 7_680) == pytest.approx(math.log(7_680 / 16_284))
    assert methods.context_bias(4_000, 4_000) == methods.context_bias(0, 0) == 0.0
    config = method_config("star", 16_284, 3_840, None, {"positions": "contiguous"})
    assert methods.get("star").shared_from(config) == 3_840


@pytest.mark.parametrize("kind,unbiased", [
    ("exact", 0), ("exact", 25), ("exact", 40), ("elsewhere", 25),
    ("topk", 0), ("topk", 10), ("topk", 25), ("topk", 40),
    ("topk-question", 10), ("topk-question", 25), ("topk-torch", 10), ("topk-torch", 40)])
def test_the_bias_scales_the_context_mass_exactly(kind, unbiased, monkeypatch):
    """Phase 2 with a context bias b equals softmax over [s·q·K_ctx + b ‖ s·q·K_own (causal)]
    computed in fp64: the shared positions' mass scaled by e^b, the keys before them (the
    first `unbiased`: in a block, or a whole block) and the own keys kept; exact attention
    on the CPU's kernel and as a GPU's path runs it (one buffer, its parts in torch), and
    top-k with k covering every key: the compiled kernel, torch's code where it is not
    built, and the question's exact forward, the cut inside the sink (10 of its 16 rows),
    past it and at the first block's end."""
    from starqa.attention import fold_gqa
    from starqa.native import ops as native
    from starqa.phase2.shard_attention import ShardAttention
    from starqa.runtime import dist
    from starqa.topk import retrieval
    from starqa.topk.indexes import TopK
    from test_attention import biased_reference

    torch.manual_seed(0)
    heads, kv_heads, dim, n, m, bias = 4, 2, 16, 96, 3, math.log(0.25)
    k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    q = torch.randn(1, heads, m, dim)
    own_k, own_v = torch.randn(1, kv_heads, m, dim), torch.randn(1, kv_heads, m, dim)
    shard = [[(k[:, :, :40], v[:, :, :40]), (k[:, :, 40:], v[:, :, 40:])]]
    if kind.startswith("topk"):
        if kind == "topk-torch":
            monkeypatch.setattr(native, "available", lambda: False)
        prefill = "exact" if kind == "topk-question" else "topk"
        blocks = [(k[:, :, :40], v[:, :, :40]), (k[:, :, 40:], v[:, :, 40:])]
        retriever = retrieval.from_parts(blocks, TopK(count=n, prefill=prefill), n,
                                         torch.float32)
        hook = ShardAttention(dist.local_world(), None, query_host=True, retriever=retriever,
                              context_bias=bias, unbiased=unbiased)
    else:
        hook = ShardAttention(dist.local_world(), [[(k, v)]] if kind == "elsewhere" else shard,
                              query_host=True, context_bias=bias, unbiased=unbiased)
        hook.view.cpu = kind == "exact"  # elsewhere: the path of a shard on a GPU
    hook.begin(8)
    got = hook.attention(0, q, own_k, own_v, dim**-0.5)

    rows = fold_gqa(q, kv_heads, torch.float32)[0]  # [Hkv, G*M, D], as the hook folds them
    want, _ = biased_reference(rows, [(k[0], v[0])], (own_k[0], own_v[0]), dim**-0.5, m, bias,
                               unbiased)
    want = want.view(1, heads, m, dim)
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error < 1e-5
    if unbiased:  # and not what the bias on every key gives
        everywhere, _ = biased_reference(rows, [(k[0], v[0])], (own_k[0], own_v[0]),
                                         dim**-0.5, m, bias)
        assert (everywhere.view(1, heads, m, dim) - want).abs().max() > 1e-3


def test_a_long_ingest_logs_its_progress_with_the_time_left():
    """Where stderr is a log, not a terminal: a line every 30 s and one at the end."""
    from starqa.core.progress import ProgressLog

    log = ProgressLog(46_746, started=100.0)
    assert log.advance(3_840, 110.0) is None  # 10 s: too soon
    assert log.advance(3_840, 164.0) == ("Encoded 7,680 of 46,746 tokens (16%) · 120 tok/s · "
                                         "about 5 min 26 s left")
    assert log.advance(1_000, 170.0) is None
    assert log.advance(38_066, 400.0) == "Encoded 46,746 of 46,746 tokens (100%) · 156 tok/s"
