"""Pulsar Phase 1: IDF, chunk heuristics, summaries and layouts on hand-made token lists,
then the encoding on a tiny random Llama in fp32 against plain causal forwards."""

import math

import pytest
import torch

from starqa.phase1 import pulsar
from starqa import phase1
from starqa.core.errors import StarqaError
from starqa.methods import plan_blocks


def t(*values):
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------------------- IDF

def test_idf_counts_blocks_not_occurrences():
    ids = t(0, 1, 2, 1, 2, 3, 2, 3, 3)  # blocks {0,1,2}, {1,2,3}, {2,3}
    blocks = [(0, 3), (3, 6), (6, 9)]
    df = pulsar.df_table(ids, blocks, vocab_size=6)
    assert df.tolist() == [1, 2, 3, 2, 0, 0]
    idf = pulsar.idf_table(ids, blocks, vocab_size=6)
    assert idf.dtype == torch.float32 and idf.shape == (6,)
    expected = [math.log(3), math.log(1.5), 0.0, math.log(1.5), math.log(3), math.log(3)]
    torch.testing.assert_close(idf, torch.tensor(expected))  # absent tokens 4, 5: log(N/1)


# ---------------------------------------------------------------------------- heuristics

IDF = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5])
CHUNKS = t(0, 0, 0, 3,  1, 2, 1, 2,  0, 1, 2, 4,  4, 4)  # chunk=4: three full chunks + one of 2
DF = t(3, 1, 2, 0, 4)


@pytest.mark.parametrize("heuristic, expected", [
    ("max-idf", [3.0, 2.0, 2.0, 0.5]),
    ("tfidf", [0.75, 1.5, 0.875, 0.5]),
    ("entropy", [0.5, 0.5, 1.0, 0.5]),
    ("even", [0.0, 0.0, 0.0, 0.0]),
])
def test_chunk_scores(heuristic, expected):
    scores = pulsar.chunk_scores(CHUNKS, IDF, heuristic, chunk=4)
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_bm25_matches_hand_computation():
    scores = pulsar.chunk_scores(CHUNKS, IDF, "bm25", chunk=4, df=DF, n_blocks=4)
    k1, b, n, avg = 1.2, 0.75, 4, (4 + 4 + 4 + 2) / 4

    def idf(df):
        return math.log((n - df + 0.5) / (df + 0.5) + 1)

    # chunk 1 = [1, 2, 1, 2]: tokens 1 (df 1) and 2 (df 2), tf 2 each, length 4
    norm = k1 * (1 - b + b * 4 / avg)
    chunk1 = (idf(1) + idf(2)) * 2 * (k1 + 1) / (2 + norm)
    # chunk 3 = [4, 4]: one token (df 4), tf 2, length 2
    chunk3 = idf(4) * 2 * (k1 + 1) / (2 + k1 * (1 - b + b * 2 / avg))
    assert scores[1].item() == pytest.approx(chunk1, rel=1e-6)
    assert scores[3].item() == pytest.approx(chunk3, rel=1e-6)
    # chunk 0 holds token 3 (in no block: the highest idf) and ranks first; chunk 3 last
    assert scores.argsort(descending=True).tolist() == [0, 1, 2, 3]
    # an explicit avg_len changes the length normalization
    other = pulsar.chunk_scores(CHUNKS, IDF, "bm25", chunk=4, df=DF, n_blocks=4, avg_len=8.0)
    assert other[1] > scores[1]


# ---------------------------------------------------------------------------- summaries

def scored_block(chunk_idf: list[float], chunk: int):
    """A block whose chunk j is `chunk` copies of token j, and an idf giving it chunk_idf[j]."""
    ids = torch.arange(len(chunk_idf)).repeat_interleave(chunk)
    return ids, torch.tensor(chunk_idf)


def test_summary_takes_best_whole_chunks_in_positional_order():
    scores = [0.1] * 32
    for j, s in zip((20, 3, 11, 7, 25), (5.0, 4.0, 3.0, 2.0, 1.0)):
        scores[j] = s
    ids, idf = scored_block(scores, chunk=8)  # 256 tokens: budget 32 tokens = 4 chunks
    pos = pulsar.summary_positions(1000, ids, idf, "max-idf", budget_frac=0.125, chunk=8)
    expected = torch.cat([1000 + j * 8 + torch.arange(8) for j in (3, 7, 11, 20)])
    assert pos.tolist() == expected.tolist()  # chunk 25 (5th best) is over budget


def test_summary_budget_rounds_down_to_whole_chunks_and_keeps_one():
    ids, idf = scored_block([float(j) for j in range(10)], chunk=8)  # 80 tokens
    pos = pulsar.summary_positions(0, ids, idf, "max-idf", budget_frac=0.3, chunk=8)
    assert pos.tolist() == list(range(56, 80))  # budget floor(0.3*80) = 24 -> chunks 7, 8, 9
    pos = pulsar.summary_positions(0, ids, idf, "max-idf", budget_frac=0.2, chunk=8)
    assert pos.tolist() == list(range(64, 80))  # budget 16 -> 2 chunks (8, 9)
    pos = pulsar.summary_positions(0, ids, idf, "max-idf", budget_frac=0.01, chunk=8)
    assert pos.tolist() == list(range(72, 80))  # budget 0 -> still one chunk, the best


def test_summary_short_last_chunk_and_ties_go_to_earlier_chunk():
    ids = t(0, 0, 0, 0, 1, 1, 1, 1, 1, 1)  # chunk 4: [0000] [1111] [11]
    idf = torch.tensor([0.0, 1.0])
    pos = pulsar.summary_positions(10, ids, idf, "max-idf", budget_frac=0.5, chunk=4)
    assert pos.tolist() == [14, 15, 16, 17]  # chunks 1 and 2 tie; chunk 1 wins
    pos = pulsar.summary_positions(10, ids, idf, "tfidf", budget_frac=1.0, chunk=4)
    assert pos.tolist() == list(range(14, 20))  # budget 10 -> 2 chunks: 1 and the short 2


def test_summary_skips_block_zero_sink():
    ids, idf = scored_block([9.0, 9.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], chunk=8)
    pos = pulsar.summary_positions(0, ids, idf, "max-idf", budget_frac=0.125, chunk=8, skip=16)
    # the 16 sink tokens (the best chunks) are not candidates; chunking restarts after them,
    # budget = floor(0.125 * 64) = 8 tokens = one chunk: original chunk 3
    assert pos.tolist() == list(range(24, 32))
    pos = pulsar.summary_positions(0, ids, idf, "max-idf", budget_frac=0.125, chunk=8, skip=20)
    # chunks now start at 20: [20,28) holds tokens of chunks 2 and 3 (max idf 2) and wins
    assert pos.tolist() == list(range(20, 28))


@pytest.mark.parametrize("start, skip", [(0, 0), (500, 0), (0, 7)])
def test_even_picks_uniformly_spaced_tokens(start, skip):
    ids = torch.zeros(100 + skip, dtype=torch.int64)
    pos = pulsar.summary_positions(start, ids, torch.zeros(1), "even", budget_frac=0.125,
                                   skip=skip)
    assert len(pos) == 12  # floor(0.125 * 100)
    assert pos[0] == start + skip
    gaps = set(pos.diff().tolist())
    assert gaps <= {8, 9} and pos[-1] < start + skip + 100  # 100/12 = 8.33 apart


def test_all_summaries_skip_the_sink_and_stay_in_their_block():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (400,), generator=gen)
    blocks = plan_blocks(400, 100)
    summaries = pulsar.all_summaries(ids, blocks, 50, sink=20, heuristic="bm25", chunk=8)
    assert [len(s) for s in summaries] == [8, 8, 8, 8]  # floor(.125*80)=10 and 12 -> 1 chunk
    assert summaries[0].min() >= 20
    for (s, e), pos in zip(blocks, summaries):
        assert s <= pos.min() and pos.max() < e and bool((pos.diff() > 0).all())


# ---------------------------------------------------------------------------- layout

IDS = torch.arange(100) + 1000
BLOCKS = plan_blocks(100, 25)
SUMMARIES = [t(10, 11), t(30, 31, 40), t(60), t(80)]


@pytest.mark.parametrize("positions", pulsar.POSITIONS)
def test_assemble_block_zero_is_alone(positions):
    ids, pos, keep = pulsar.assemble(IDS, BLOCKS, 0, SUMMARIES, sink=4, positions=positions)
    assert ids.tolist() == list(range(1000, 1025))
    assert pos.tolist() == list(range(25)) and keep == 25


def test_assemble_block_two_sparse_and_contiguous():
    where = [0, 1, 2, 3, 10, 11, 30, 31, 40, *range(50, 75)]  # sink ‖ Σ_0 ‖ Σ_1 ‖ B_2
    ids, pos, keep = pulsar.assemble(IDS, BLOCKS, 2, SUMMARIES, sink=4)
    assert ids.tolist() == [1000 + w for w in where]
    assert pos.tolist() == where and keep == 25
    ids_c, pos_c, keep_c = pulsar.assemble(IDS, BLOCKS, 2, SUMMARIES, sink=4, positions="contiguous")
    assert ids_c.tolist() == ids.tolist()
    assert pos_c.tolist() == list(range(len(where))) and keep_c == 25


def test_query_start_follows_the_longest_assembled_block():
    assert pulsar.max_assembled_length(BLOCKS, SUMMARIES, sink=4) == 4 + 2 + 3 + 1 + 25
    assert pulsar.query_start(100, BLOCKS, SUMMARIES, sink=4) == 100
    assert pulsar.query_start(100, BLOCKS, SUMMARIES, sink=4, positions="contiguous") == 35
    # a long block 0 alone can be the longest
    assert pulsar.max_assembled_length([(0, 90), (90, 100)], [t(5), t(95)], sink=4) == 90


def test_bad_choices_name_the_options():
    with pytest.raises(StarqaError) as err:
        pulsar.chunk_scores(CHUNKS, IDF, "random")
    assert "max-idf" in err.value.hint and "even" in err.value.hint
    with pytest.raises(StarqaError) as err:
        pulsar.assemble(IDS, BLOCKS, 1, SUMMARIES, positions="dense")
    assert "sparse" in err.value.hint and "contiguous" in err.value.hint


# ---------------------------------------------------------------------------- encode

def context(model):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, model.config.vocab_size, (200,), generator=gen)


SETTINGS = {"sink": 8, "chunk": 4, "budget_frac": 0.25}


def test_pulsar_block_zero_equals_star_block_zero(model):
    ids = context(model)
    blocks = plan_blocks(len(ids), 50)
    [(_, k, v)] = pulsar.encode_pulsar(model, ids, blocks, [0],
                                       pulsar.PulsarSettings(**SETTINGS))
    [(_, k_star, v_star)] = phase1.encode_star(model, ids, blocks, [0], anchor_size=50)
    torch.testing.assert_close(k, k_star)
    torch.testing.assert_close(v, v_star)


@pytest.mark.parametrize("heuristic", ["max-idf", "bm25", "even"])
@pytest.mark.parametrize("positions", pulsar.POSITIONS)
def test_pulsar_block_equals_causal_forward_over_its_layout(model, heuristic, positions):
    ids = context(model)
    blocks = plan_blocks(len(ids), 50)  # 4 blocks
    sink, i = SETTINGS["sink"], 2
    [(index, k, v)] = pulsar.encode_pulsar(model, ids, blocks, [i], pulsar.PulsarSettings(
        heuristic=heuristic, positions=positions, **SETTINGS))
    summaries = pulsar.all_summaries(ids, blocks, model.config.vocab_size, sink=sink,
                                     heuristic=heuristic, chunk=4, budget_frac=0.25)
    start, end = blocks[i]
    where = torch.cat([torch.arange(sink), summaries[0], summaries[1], torch.arange(start, end)])
    # budgets: Σ_0 floor(.25*42) = 10 tokens (2 chunks of 4, or 10 even), Σ_1 12 (3 chunks)
    assert len(where) == sink + (10 if heuristic == "even" else 8) + 12 + 50
    pos = where if positions == "sparse" else torch.arange(len(where))
    cache = model(ids[where][None], position_ids=pos[None], use_cache=True).past_key_values
    keep = end - start
    assert index == i and k.shape == v.shape == (2, 2, keep, 16)  # [L, Hkv, T, D]
    for layer in range(len(cache.layers)):
        torch.testing.assert_close(k[layer], cache.layers[layer].keys[0][:, -keep:],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[layer], cache.layers[layer].values[0][:, -keep:],
                                   rtol=1e-5, atol=1e-5)
    # the summaries matter: the KV differs from Star's (anchor = block 0)
    [(_, k_star, _)] = phase1.encode_star(model, ids, blocks, [i], anchor_size=50)
    assert not torch.allclose(k, k_star, atol=1e-4)
