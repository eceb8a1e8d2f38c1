"""Every method on a tiny random Qwen2 (q/k/v biases, GQA 6/2, ChatML template), in fp32 and
in-process: Phase 1 blocks equal transformers' own KV over each method's layout, and Phase 2
on several workers (threads standing in for ranks) equals transformers' greedy generate
for the exact methods and a world of one for the others."""

import threading

import pytest
import torch

from starqa import corpus, methods, models

from starqa.phase2 import decode
from starqa.phase2.shard_attention import ShardAttention
from starqa.runtime import dist
from starqa.phase1 import hooks, pulsar
from starqa.corpus import prompt
from starqa.models.decoder_io import load_decoder
from starqa.methods import method_config, plan_blocks
from starqa.models import context_window, load_model, load_tokenizer
from tiny import make_tiny_model

METHODS = ("star", "dense", "ring", "pulsar")  # apb: its own tests below
PULSAR = {"sink": 8, "chunk": 4, "budget_frac": 0.25}
BLOCK = 40
QUESTION = "who approved the travel budget"


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    """A tiny Qwen2 of this module's own (not the session's `tiny_qwen`: the drafts test
    writes its int4 prepared weights beside it)."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2")


@pytest.fixture(scope="module")
def qwen_model(qwen_path):
    """The tiny Qwen2 loaded in fp32 with starqa's attention hooks, as Phase 1 runs it."""
    return load_model(qwen_path, dtype=torch.float32, attn_implementation=hooks.register())


@pytest.fixture(scope="module")
def decoder(qwen_path):
    """The same weights as Phase 2 runs them (starqa.models.decoder), fp32."""
    return load_decoder(qwen_path, torch.float32)


@pytest.fixture(scope="module")
def reference(qwen_path):
    """The same weights on transformers' own attention: the oracle."""
    return load_model(qwen_path, dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def qwen_tok(qwen_path):
    """The tiny Qwen2's tokenizer (byte-level BPE, ChatML template)."""
    return load_tokenizer(qwen_path)


@pytest.fixture(scope="module")
def context_ids(qwen_tok):
    files = [corpus.TextFile("policy/travel.md",
                               "the travel budget was approved by the office .\n" * 5, 0),
             corpus.TextFile("code.py", "retry limit default is seven\n" * 6, 0)]
    packed, spans = corpus.pack(files)
    ids = prompt.tokenize_context(qwen_tok, packed, spans).ids
    assert 120 < len(ids) < 200  # several blocks of BLOCK tokens
    return torch.tensor(ids)


def config_for(name, n):
    return method_config(name, n, block_size=BLOCK, params=PULSAR if name == "pulsar" else None)


def encode_local(model, ids, cfg, blocks):
    """Phase 1 of every block in this process: the method's registry entry."""
    return methods.get(cfg.name).encode_local(model, ids, cfg, blocks)


def reference_kv(reference, ids, positions, keep):
    """Per-layer (k, v) [Hkv, keep, D] of the last `keep` tokens of one ordinary causal
    forward over `ids` at `positions`."""
    cache = reference(ids[None], position_ids=positions[None], use_cache=True).past_key_values
    return [(layer.keys[0, :, -keep:], layer.values[0, :, -keep:]) for layer in cache.layers]


def layout(name, ids, blocks, i, cfg, vocab_size):
    """Tokens and positions of block i's Phase 1 input under method `name`."""
    start, end = blocks[i]
    if name in ("dense", "ring"):  # exact: the whole causal prefix
        return ids[:end], torch.arange(end)
    if name == "star":
        anchor = min(cfg.anchor_size, start)
        return (torch.cat([ids[:anchor], ids[start:end]]),
                torch.cat([torch.arange(anchor), torch.arange(start, end)]))
    p = cfg.params
    summaries = pulsar.all_summaries(ids, blocks, vocab_size, sink=p["sink"],
                                     heuristic=p["heuristic"], budget_frac=p["budget_frac"],
                                     chunk=p["chunk"])
    tokens, positions, _ = pulsar.assemble(ids, blocks, i, summaries, sink=p["sink"],
                                           positions=p["positions"])
    return tokens, positions


# ---------------------------------------------------------------------------- the model


def test_tiny_qwen2_is_qwen2_shaped(qwen_model, qwen_tok, qwen_path):
    config = qwen_model.config
    assert config.model_type == "qwen2" and context_window(config) == 512
    assert (config.num_attention_heads, config.num_key_value_heads) == (6, 2)
    attn = qwen_model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None
    stops = models.stop_ids(qwen_tok, qwen_path)
    assert qwen_tok.convert_tokens_to_ids("<|im_end|>") in stops
    assert qwen_tok.convert_tokens_to_ids("<|endoftext|>") in stops


def test_qwen_template_split(qwen_tok):
    """Qwen's template adds its own system prompt only when none is given: starqa's goes in,
    and context + query is exactly the rendered conversation."""
    files = [corpus.TextFile("a.md", "the star block\nthe query\n", 0)]
    packed, _ = corpus.pack(files)
    context, offset = prompt.context_text(qwen_tok, packed)
    full = qwen_tok.apply_chat_template(
        [{"role": "system", "content": prompt.SYSTEM},
         {"role": "user", "content": prompt.INTRO + packed + prompt.QUESTION + QUESTION}],
        tokenize=False, add_generation_prompt=True)
    query = prompt.query_text(qwen_tok, QUESTION)
    assert context + query == full and context[offset:] == packed
    assert context.startswith("<|im_start|>system\n" + prompt.SYSTEM + "<|im_end|>\n")
    assert "You are Qwen" not in full
    assert query.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = prompt.tokenize_query(qwen_tok, QUESTION)
    end, start = qwen_tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    assert [t for t in ids if t in (end, start)] == [end, start]  # one token each
    assert qwen_tok.decode(ids) == query


# ---------------------------------------------------------------------------- Phase 1


@pytest.mark.parametrize("name", METHODS)
def test_phase1_blocks_equal_transformers_kv(name, qwen_model, reference, context_ids):
    ids = context_ids
    cfg = config_for(name, len(ids))
    blocks = plan_blocks(len(ids), cfg.block_size)
    assert len(blocks) >= 4
    out = list(encode_local(qwen_model, ids, cfg, blocks))
    assert [i for i, _, _ in out] == list(range(len(blocks)))
    for i, k, v in out:
        start, end = blocks[i]
        assert k.shape == v.shape == (2, 2, end - start, 16)  # [L, Hkv, T, D]
        tokens, positions = layout(name, ids, blocks, i, cfg, qwen_model.config.vocab_size)
        with torch.inference_mode():
            ref = reference_kv(reference, tokens, positions, end - start)
        for layer, (rk, rv) in enumerate(ref):
            torch.testing.assert_close(k[layer], rk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v[layer], rv, rtol=1e-4, atol=1e-4)


def test_approximate_methods_differ_from_dense(qwen_model, context_ids):
    """Star and pulsar do not see the whole prefix: block 0 is exact, later blocks are not."""
    ids = context_ids
    blocks = plan_blocks(len(ids), BLOCK)
    dense = [k for _, k, _ in encode_local(qwen_model, ids, config_for("dense", len(ids)), blocks)]
    for name in ("star", "pulsar", "apb"):
        keys = [k for _, k, _ in encode_local(qwen_model, ids, config_for(name, len(ids)), blocks)]
        torch.testing.assert_close(keys[0], dense[0])
        assert not torch.allclose(keys[-1], dense[-1], atol=1e-3)


def test_apb_limits_are_star_and_dense(qwen_model, reference, context_ids):
    """apb with nothing passed is star with apb's anchor; with no anchor and every key passed
    it is dense (per-layer passing at original positions, through q/k/v biases)."""
    ids = context_ids
    blocks = plan_blocks(len(ids), BLOCK)
    star = method_config("apb", len(ids), block_size=BLOCK, anchor_size=7, params={"passing": 0})
    for i, k, _ in encode_local(qwen_model, ids, star, blocks):
        start, end = blocks[i]
        a = min(7, start)
        tokens = torch.cat([ids[:a], ids[start:end]])
        positions = torch.cat([torch.arange(a), torch.arange(start, end)])
        with torch.inference_mode():
            ref = reference_kv(reference, tokens, positions, end - start)
        torch.testing.assert_close(k[-1], ref[-1][0], rtol=1e-4, atol=1e-4)
    full = method_config("apb", len(ids), block_size=BLOCK, anchor_size=0,
                         params={"passing": BLOCK})
    for (_, k, v), (_, dk, dv) in zip(encode_local(qwen_model, ids, full, blocks),
                                      encode_local(qwen_model, ids, config_for("dense", len(ids)),
                                                   blocks)):
        torch.testing.assert_close(k, dk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, dv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("workers", [2, 3])
def test_apb_on_workers_equals_blocks_in_order(workers, qwen_model, context_ids, monkeypatch):
    """Round-robin ranks (threads) exchanging compressed KV per layer store what encoding the
    blocks in order in one process does, including an idle rank in a short last round."""
    from starqa.phase1 import apb

    ids = context_ids
    cfg = method_config("apb", len(ids), block_size=BLOCK, params={"passing": 5, "window": 8})
    blocks = plan_blocks(len(ids), BLOCK)
    assert len(blocks) % workers  # some rank idles in the last round
    local = {i: (k, v) for i, k, v in encode_local(qwen_model, ids, cfg, blocks)}
    world = ThreadWorld(workers)
    monkeypatch.setattr(dist, "all_gather", world.all_gather)

    def rank(info):
        mine = methods.get(cfg.name).assignment(len(blocks), workers, info.rank)
        assert mine == apb.assignment(len(blocks), workers, info.rank)
        encoded = methods.get(cfg.name).encode(qwen_model, ids, cfg, blocks, mine, info)
        return {i: (k, v) for i, k, v in encoded}

    got = {i: kv for part in run_ranks(world, rank) for i, kv in part.items()}
    assert sorted(got) == sorted(local)
    for i, (k, v) in got.items():
        torch.testing.assert_close(k, local[i][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, local[i][1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- Phase 2


class ThreadWorld:
    """Collectives for ranks that are threads of this process: all_gather and broadcast as
    starqa.runtime.dist has them, exchanged through shared slots and a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world

    def all_gather(self, info, tensor):
        self.slots[info.rank] = tensor.clone()
        self.barrier.wait()
        out = torch.stack(self.slots)
        self.barrier.wait()  # everyone has read before anyone writes again
        return out

    def broadcast(self, info, tensor, src):
        if info.rank == src:
            self.slots[src] = tensor.clone()
        self.barrier.wait()
        value = self.slots[src].clone()
        self.barrier.wait()
        return tensor.copy_(value)


def run_ranks(world: ThreadWorld, run):
    """`run(info)` on every rank of `world`, each a thread; returns every rank's result."""
    results: list = [None] * world.world
    errors: list[BaseException] = []

    def rank(r):
        try:
            info = dist.DistInfo(r, r, world.world, torch.device("cpu"), None)
            with torch.inference_mode():  # grad mode is per thread
                results[r] = run(info)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def on_workers(blocks_kv, workers, monkeypatch, run):
    """`run(info, hook)` on `workers` ranks (threads), each holding its contiguous blocks'
    shard as worker.Phase2Context does; returns every rank's result."""
    world = ThreadWorld(workers)
    monkeypatch.setattr(dist, "all_gather", world.all_gather)
    monkeypatch.setattr(dist, "broadcast", world.broadcast)

    def rank(info):
        mine = list(dist.split_contiguous(len(blocks_kv), workers, info.rank))
        shard = None
        if mine:  # a piece per block, read where it lies (as load_shard keeps them on CPU)
            shard = [[(blocks_kv[i][0][layer][None], blocks_kv[i][1][layer][None])
                      for i in mine] for layer in range(blocks_kv[0][0].shape[0])]
        return run(info, ShardAttention(info, shard, info.is_last))

    return run_ranks(world, rank)


def answer_on_workers(decoder, blocks_kv, query_ids, start, workers, stops, monkeypatch,
                      max_new_tokens=8):
    """Phase 2 greedy generation on `workers` ranks; every rank must agree."""
    request = decode.Request(query_ids, start, max_new_tokens, frozenset(stops))
    results = on_workers(blocks_kv, workers, monkeypatch, lambda info, hook: decode.generate(
        decoder, info, hook, request))
    assert all(r == results[-1] for r in results)  # every rank generated the same tokens
    return results[-1]


def greedy_reference(reference, ids, stops, max_new_tokens=8):
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False)
    tokens = out[0, len(ids):].tolist()
    return tokens[:next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]


def dense_kv(model, ids):
    cfg = config_for("dense", len(ids))
    return [(k, v) for _, k, v in encode_local(model, ids, cfg,
                                               plan_blocks(len(ids), cfg.block_size))]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_dense_phase2_prefill_equals_one_forward(workers, qwen_model, decoder, reference, qwen_tok,
                                                 context_ids, monkeypatch):
    """The question's forward over the sharded cache: every query row's final hidden state
    equals transformers' forward over the whole prompt."""
    ids = context_ids
    query = torch.tensor(prompt.tokenize_query(qwen_tok, QUESTION))
    positions = torch.arange(len(ids), len(ids) + len(query))
    with torch.inference_mode():
        hidden = on_workers(dense_kv(qwen_model, ids), workers, monkeypatch,
                            lambda info, hook: decoder.forward(query, positions, hook.attention))
    with torch.inference_mode():
        expected = reference.model(torch.cat([ids, query])[None]).last_hidden_state[0]
    for rank_hidden in hidden:  # the merge is all-gathered: every rank holds the same output
        torch.testing.assert_close(rank_hidden, expected[len(ids):], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("workers", [2, 3])
def test_dense_phase2_on_workers_equals_generate(workers, qwen_model, decoder, reference, qwen_tok,
                                                 qwen_path, context_ids, monkeypatch):
    ids = context_ids
    kv = dense_kv(qwen_model, ids)
    query = prompt.tokenize_query(qwen_tok, QUESTION)
    stops = models.stop_ids(qwen_tok, qwen_path)
    expected = greedy_reference(reference, ids.tolist() + query, stops)
    assert len(expected) >= 3  # the comparison covers several decode steps
    got = answer_on_workers(decoder, kv, query, len(ids), workers, stops, monkeypatch)
    assert got == expected


@pytest.mark.parametrize("name", ["star", "ring", "pulsar", "apb"])
def test_phase2_on_workers_equals_one_worker(name, qwen_model, decoder, reference, qwen_tok,
                                             qwen_path, context_ids, monkeypatch):
    """The LSE merge is exact whatever the blocks hold: 3 ranks answer like a world of one;
    ring (exact) answers like transformers."""
    ids = context_ids
    cfg = config_for(name, len(ids))
    blocks = plan_blocks(len(ids), cfg.block_size)
    kv = [(k, v) for _, k, v in encode_local(qwen_model, ids, cfg, blocks)]
    query = prompt.tokenize_query(qwen_tok, QUESTION)
    stops = models.stop_ids(qwen_tok, qwen_path)
    one = answer_on_workers(decoder, kv, query, len(ids), 1, stops, monkeypatch)
    three = answer_on_workers(decoder, kv, query, len(ids), 3, stops, monkeypatch)
    assert three == one and len(one) >= 3
    if name == "ring":
        assert one == greedy_reference(reference, ids.tolist() + query, stops)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_drafts_give_the_same_tokens_and_sources(workers, qwen_model, qwen_path, qwen_tok,
                                                 context_ids, monkeypatch):
    """Prompt-lookup drafts (decode.generate) on int4 weights: right drafts are kept (24
    tokens in 7 forwards of 1 + 3 rows), wrong ones are dropped, and either way every rank
    gets the tokens and the per-key source mass of one token per forward, bit for bit."""
    decoder = load_decoder(qwen_path, torch.bfloat16, "int4")
    assert decoder.layers[0].qkv.format == "int4"  # rows computed alike (Linear, rowwise)
    ids = context_ids
    kv = [(k.bfloat16(), v.bfloat16()) for k, v in dense_kv(qwen_model, ids)]
    query = prompt.tokenize_query(qwen_tok, QUESTION)

    def run(drafts, lookup=None):
        def one(info, hook):
            forwards = []
            advance = hook.advance  # once per forward, whether its layers ran one by one or not
            hook.advance = lambda *a: (forwards.append(1), advance(*a))[1]
            tokens = decode.generate(decoder, info, hook, decode.Request(
                query, len(ids), 24, draft_tokens=drafts, context_ids=lookup))
            return tokens, len(forwards), hook.key_mass(tokens)
        return on_workers(kv, workers, monkeypatch, one)

    plain = run(0)
    expected = plain[-1][0]
    assert len(expected) == 24 and plain[-1][1] == 24  # a forward per token
    right = torch.tensor(query + expected)  # a context in which the answer follows the question
    wrong = torch.tensor(query + [(t + 1) % decoder.config.vocab for t in expected])
    for lookup, forwards in ((right, 7), (wrong, None)):
        got = run(3, lookup)
        for (tokens, count, mass), (_, _, plain_mass) in zip(got, plain):
            assert tokens == expected
            assert torch.equal(mass, plain_mass)
            assert count == forwards if forwards else count <= 24


@pytest.mark.parametrize("workers", [1, 2])
def test_batched_answers_equal_answers_alone(workers, qwen_model, qwen_path, qwen_tok,
                                             context_ids, monkeypatch):
    """Questions decoded together (decode.Batch) on int4 weights: joining at different
    steps, with and without drafts, each leaving when its own answer ends, every question
    gets bit for bit the tokens and per-key source mass it gets alone, on every rank; one
    stopped by its asker (should_stop) ends there and no other answer changes."""
    decoder = load_decoder(qwen_path, torch.bfloat16, "int4")
    ids = context_ids
    kv = [(k.bfloat16(), v.bfloat16()) for k, v in dense_kv(qwen_model, ids)]
    queries = [prompt.tokenize_query(qwen_tok, q) for q in
               (QUESTION, "what is the daily meal allowance", "and the budget?")]
    lookup = torch.tensor(ids.tolist() + queries[1])
    requests = [decode.Request(queries[0], len(ids), 10, draft_tokens=0),
                decode.Request(queries[1], len(ids), 14, draft_tokens=3, context_ids=lookup),
                decode.Request(queries[2], len(ids), 6, draft_tokens=0),
                decode.Request(queries[0], len(ids), 12, draft_tokens=0)]  # stopped after 3

    def alone(info, hook):
        return [(tokens, hook.key_mass(tokens)) for tokens in
                (decode.generate(decoder, info, hook, r) for r in requests[:3])]

    def together(info, hook):
        batch, seen, widths = decode.Batch(decoder, info, hook), [], []
        segments = hook.batch  # a batched forward's questions
        hook.batch = lambda parts: (widths.append(len(parts)), segments(parts))[1]
        stopper = decode.Callbacks(on_token=seen.append, should_stop=lambda: len(seen) >= 3)
        joined = [batch.join(requests[0]), batch.join(requests[1]),
                  batch.join(requests[3], stopper if hook.query_host else decode.Callbacks())]
        results = {}
        for step in range(40):
            if step == 2:
                joined.append(batch.join(requests[2]))
            for answering in batch.step():
                hook.use(answering.slot)  # its sources before its slot is taken again
                results[answering.slot, len(results)] = answering
                answering.mass = hook.key_mass(answering.generated)
            if not batch.active:
                break
        assert max(widths) >= 3  # three questions or more in one forward
        return [(a.generated, a.mass) for a in joined]

    expected = on_workers(kv, workers, monkeypatch, alone)
    got = on_workers(kv, workers, monkeypatch, together)
    for mine, reference in zip(got, expected):
        first, second, stopped, third = mine
        for (tokens, mass), (want, want_mass) in zip((first, second, third), reference):
            assert tokens == want and len(tokens) > 0
            assert torch.equal(mass, want_mass)
        assert stopped[0] == reference[0][0][:3]  # its asker stopped it after three tokens


def test_a_long_question_is_prefilled_in_parts_with_the_same_answer(qwen_model, qwen_path,
                                                                    qwen_tok, context_ids,
                                                                    monkeypatch):
    """A question longer than decode.PREFILL_CHUNK goes through in parts, its progress told
    after each, and gets bit for bit the tokens and source mass of one prefill forward."""
    decoder = load_decoder(qwen_path, torch.bfloat16, "int4")
    ids = context_ids
    kv = [(k.bfloat16(), v.bfloat16()) for k, v in dense_kv(qwen_model, ids)]
    query = prompt.tokenize_query(qwen_tok, QUESTION + " and the meal allowance, in detail")
    request = decode.Request(query, len(ids), 8, draft_tokens=0)

    def run(info, hook):
        told = []
        tokens = decode.generate(decoder, info, hook, request,
                                 decode.Callbacks(on_progress=lambda *p: told.append(p)))
        return tokens, hook.key_mass(tokens), told

    whole = on_workers(kv, 1, monkeypatch, run)[0]
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(decoder, "layer_rows", 4)  # rows in parts take the many-row path
    parts = on_workers(kv, 1, monkeypatch, run)[0]
    n = len(query)
    assert whole[2] == [(n, n)] and n > 16
    # parts of 8 while 4 rows or more are left after one, then the rest
    assert parts[2] == [(done, n) for done in sorted({*range(8, n - 3, 8), n})]
    assert parts[0] == whole[0] and torch.equal(parts[1], whole[1])

    def beside(info, hook):  # a long question joins while another answers
        batch = decode.Batch(decoder, info, hook)
        other = decode.Request(prompt.tokenize_query(qwen_tok, "and the budget?"), len(ids), 8,
                               draft_tokens=0)
        first = batch.join(other)
        while not first.started:
            batch.step()
        second = batch.join(request)
        kinds = []
        while batch.active:
            kinds.append("part" if not second.started else "both")  # before this forward
            batch.step()
        return first.generated, second.generated, kinds

    alone_other = on_workers(kv, 1, monkeypatch, lambda info, hook: decode.generate(
        decoder, info, hook, decode.Request(prompt.tokenize_query(qwen_tok, "and the budget?"),
                                            len(ids), 8, draft_tokens=0)))[0]
    other, mine, kinds = on_workers(kv, 1, monkeypatch, beside)[0]
    assert other == alone_other and mine == whole[0]
    # each part a forward of its own, the other's next token between two parts
    assert kinds.count("part") == 2 * len(parts[2]) - 1
