"""Source attribution: key mass → files and lines, ranked."""

import math

import pytest
import torch

from starqa.phase2 import sources
from starqa.attention import attend, key_mass
from starqa.cache.manifest import PackedFile

FILES = [  # tokens 10..20 = a.md (lines start at 12, 15, 18), 20..30 = b.md
    PackedFile(path="a.md", token_start=10, token_end=20, lines=3, bytes=30,
               line_tokens=(12, 15, 18)),
    PackedFile(path="b.md", token_start=20, token_end=30, lines=2, bytes=20, line_tokens=(21, 25)),
]


def test_line_mass_buckets_tokens_into_lines():
    mass = torch.zeros(40)
    mass[16] = 2.0   # a.md line 2
    mass[11] = 1.0   # a.md header → line 1
    mass[26] = 3.0   # b.md line 2
    mass[5] = 9.0    # template, in no file
    got = sources.line_mass(FILES, 0, mass)
    assert got == {"a.md": {1: 1.0, 2: 2.0}, "b.md": {2: 3.0}}


def test_line_mass_of_a_shard_that_starts_mid_file():
    mass = torch.ones(8)  # tokens 16..24
    got = sources.line_mass(FILES, 16, mass)
    assert got["a.md"] == {2: 2.0, 3: 2.0}
    assert got["b.md"] == {1: 4.0}  # tokens 20..23: header (20) and line 1 (21..23)


def test_top_sources_ranks_files_and_finds_the_peak_range():
    per_line = sources.add([{"a.md": {1: 0.1, 5: 1.0, 6: 0.5, 7: 0.05}},
                            {"a.md": {4: 0.3}, "b.md": {2: 0.7}}])
    top = sources.top_sources(per_line)
    assert [s["path"] for s in top] == ["a.md", "b.md"]
    assert top[0]["lines"] == [4, 6]  # 0.3 and 0.5 are >= 25% of the peak 1.0; 0.05 is not
    assert math.isclose(sum(s["share"] for s in top), 1.0)


def test_only_files_that_stand_out_are_listed(monkeypatch):
    """A file under a third of the top file's share is noise and left out; an answer that
    copied too little (the model's own knowledge) or copied from everywhere alike (no file
    stands out) lists none."""
    monkeypatch.delenv("STARQA_MIN_COPIED", raising=False)  # the real threshold
    top = sources.top_sources({"a.md": {3: 0.06}, "b.md": {1: 0.03}, "c.md": {9: 0.015}})
    assert [(s["path"], round(s["share"], 3)) for s in top] == [("a.md", 0.571), ("b.md", 0.286)]
    little = sources.MIN_COPIED * 0.9
    assert sources.top_sources({"a.md": {1: little}}) == []
    spread = {f"{i}.md": {1: sources.MIN_COPIED} for i in range(5)}  # 20% each
    assert sources.top_sources(spread) == []
    assert sources.top_sources({}) == []


def test_key_mass_sums_to_the_shards_share_of_attention():
    """Each query row's probabilities over all keys sum to one; split the keys in two shards
    and the masses add up to rows x heads."""
    q, k, v = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    _, lse = attend(q, k, v, 8 ** -0.5)
    left = key_mass(q, k[:, :, :15], 8 ** -0.5, lse)
    right = key_mass(q, k[:, :, 15:], 8 ** -0.5, lse)
    assert left.shape == (15,) and right.shape == (25,)
    torch.testing.assert_close((left.sum() + right.sum()).item(), 6 * 3.0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("piece_bytes", [None, 2 * 2 * 8 * 4 * 7])
def test_phase2_attribution_is_the_mass_each_row_put_on_its_own_token(piece_bytes, blocks,
                                                                      monkeypatch):
    """What Phase 2 attributes after the answer against `key_mass` over every key: row s
    (the one that emitted tokens[s]) counts on exactly the keys holding tokens[s], summed
    over layers and heads; keys of tokens never emitted and the keys before the first
    document (the head) get nothing. The shard spans several kernel slots and is held in
    three pieces: each a block's buffer of every layer (`blocks`, as load_shard maps them:
    a piece's keys are gathered for all layers at once) or slices of per-layer buffers;
    with `piece_bytes`, the candidates go in pieces of 7 keys (a token's keys split across
    pieces)."""
    from starqa.runtime import dist
    from starqa.phase2.shard_attention import ShardAttention

    if piece_bytes:
        monkeypatch.setattr(sources, "MASS_BYTES", piece_bytes)

    torch.manual_seed(0)
    n, head, layers = 2 * 128 * 3 + 37, 11, 2
    ids = torch.randint(0, 12, (n,))
    cuts = [0, 300, 301, n]  # three pieces of unequal lengths
    if blocks:
        held = [(torch.randn(layers, 2, b - a, 8), torch.randn(layers, 2, b - a, 8))
                for a, b in zip(cuts, cuts[1:])]
        pieces = [[(k[layer][None], v[layer][None]) for k, v in held] for layer in range(layers)]
        shard = [tuple(torch.cat([p[i] for p in layer], dim=2) for i in (0, 1))
                 for layer in pieces]
    else:
        shard = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for _ in range(layers)]
        pieces = [[(k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
                  for k, v in shard]
    hook = ShardAttention(dist.local_world(), pieces, query_host=True, head=head, ids=ids)
    assert (hook.view.block_keys is not None) == blocks
    hook.begin(8)
    hook.track = True
    tokens = [3, 7, 3, 11]  # what each tracked row emitted (the last row's pick is cut off)
    expected = torch.zeros(n, dtype=torch.float64)
    keys, values = [list(kv) for kv in zip(*shard)]  # per layer: the shard, then the question's
    for step in range(5):  # a 4-token question, then single tokens
        m = 4 if step == 0 else 1
        for layer in range(layers):
            q, k, v = torch.randn(1, 6, m, 8), torch.randn(1, 2, m, 8), torch.randn(1, 2, m, 8)
            hook.attention(layer, q, k, v)
            keys[layer] = torch.cat([keys[layer], k], 2)
            values[layer] = torch.cat([values[layer], v], 2)
            _, lse = attend(q, keys[layer], values[layer], 8 ** -0.5, causal=True)
            if step < len(tokens):
                mass = key_mass(q[:, :, -1:], shard[layer][0], 8 ** -0.5, lse[..., -1:]).double()
                expected += mass * (ids == tokens[step])
        hook.advance(m)
    expected[:head] = 0
    expected /= len(tokens) * layers * 6  # a fraction of the answer rows' attention
    got = hook.key_mass(tokens)
    assert got.shape == (n,) and got[:head].abs().sum() == 0
    assert got[~torch.isin(ids, torch.tensor(tokens))].abs().sum() == 0
    assert (got[head:][torch.isin(ids[head:], torch.tensor(tokens))] > 0).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    # No token ids (a shard loaded without them): no attribution rather than a wrong one.
    hook.ids = None
    assert hook.key_mass(tokens).sum() == 0


def test_key_mass_weighs_the_keys_as_the_context_bias_did():
    """Past the window the shard's keys at shared positions weigh e^b in attention (all but
    the first `unbiased`, the anchor's): each key's mass is its fp64 softmax share with that
    bias, not its bare score's."""
    from starqa.runtime import dist
    from starqa.phase2.shard_attention import ShardAttention

    torch.manual_seed(1)
    n, unbiased, bias, scale = 300, 120, math.log(0.2), 8 ** -0.5
    ids = torch.randint(0, 5, (n,))
    k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    pieces = [[(k[:, :, :200], v[:, :, :200]), (k[:, :, 200:], v[:, :, 200:])]]
    hook = ShardAttention(dist.local_world(), pieces, query_host=True, ids=ids,
                          context_bias=bias, unbiased=unbiased)
    hook.begin(8)
    hook.track = True
    q, own_k, own_v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    hook.attention(0, q, own_k, own_v, scale)
    hook.advance(1)
    got = hook.key_mass([3])

    expected = torch.zeros(n, dtype=torch.float64)
    for h in range(6):  # query head h reads KV head h // 3
        keys = torch.cat([k[0, h // 3], own_k[0, h // 3]]).double()
        scores = keys @ q[0, h, 0].double() * scale
        scores[unbiased:n] += bias
        expected += (scores - scores.logsumexp(0)).exp()[:n] * (ids == 3)
    expected /= 6
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    assert got[unbiased:].sum() < 0.9 * expected[unbiased:].sum() / math.exp(bias)
