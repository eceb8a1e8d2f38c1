"""Source attribution: key mass → files and lines, ranked."""

import math

import torch

from starqa import sources
from starqa.attention import attend, key_mass
from starqa.manifest import SourceFile

FILES = [  # tokens 10..20 = a.md (lines start at 12, 15, 18), 20..30 = b.md
    SourceFile(path="a.md", token_start=10, token_end=20, lines=3, bytes=30,
               line_tokens=(12, 15, 18)),
    SourceFile(path="b.md", token_start=20, token_end=30, lines=2, bytes=20, line_tokens=(21, 25)),
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
                            {"a.md": {4: 0.3}, "b.md": {2: 0.2}}])
    top = sources.top_sources(per_line)
    assert [s["path"] for s in top] == ["a.md", "b.md"]
    assert top[0]["lines"] == [4, 6]  # 0.3 and 0.5 are >= 25% of the peak 1.0; 0.05 is not
    assert math.isclose(sum(s["share"] for s in top), 1.0)


def test_key_mass_sums_to_the_shards_share_of_attention():
    """Each query row's probabilities over all keys sum to one; split the keys in two shards
    and the masses add up to rows x heads."""
    q, k, v = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    _, lse = attend(q, k, v, 8 ** -0.5)
    left = key_mass(q, k[:, :, :15], 8 ** -0.5, lse)
    right = key_mass(q, k[:, :, 15:], 8 ** -0.5, lse)
    assert left.shape == (15,) and right.shape == (25,)
    torch.testing.assert_close((left.sum() + right.sum()).item(), 6 * 3.0, rtol=1e-5, atol=1e-5)


def test_phase2_attribution_equals_the_exact_key_mass():
    """What Phase 2 tracks while decoding (each chunk's mass from the kernel's per-chunk LSE,
    then exact per-key mass for the top chunks) against `key_mass` over every key, summed
    over layers and steps: chunk sums match everywhere, the refined chunks key by key, and
    the keys before the first document (the head) get nothing."""
    from starqa import dist, phase2

    torch.manual_seed(0)
    n, head, layers = 2 * phase2.ATTRIBUTION_CHUNK * 3 + 37, 11, 2
    shard = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for _ in range(layers)]
    hook = phase2.ShardAttention(dist.local_world(), shard, query_host=True, head=head)
    hook.begin(8)
    hook.track = True
    expected = torch.zeros(n, dtype=torch.float64)
    for step in range(3):  # a 4-token question, then two single tokens
        m = 4 if step == 0 else 1
        for layer in range(layers):
            q, k, v = torch.randn(1, 6, m, 8), torch.randn(1, 2, m, 8), torch.randn(1, 2, m, 8)
            hook.attention(layer, q, k, v)
            own_k = hook._own[layer][0][:, :, :hook.length + m]
            own_v = hook._own[layer][1][:, :, :hook.length + m]
            keys, values = torch.cat([shard[layer][0], own_k], 2), torch.cat([shard[layer][1], own_v], 2)
            _, lse = attend(q, keys, values, 8 ** -0.5, causal=True)
            expected += key_mass(q[:, :, -1:], shard[layer][0], 8 ** -0.5, lse[..., -1:]).double()
        hook.advance(m)
    got = hook.key_mass()
    assert got.shape == (n,) and got[:head].abs().sum() == 0
    chunk = phase2.ATTRIBUTION_CHUNK
    bounds = list(range(head, n, chunk)) + [n]
    sums = torch.tensor([got[a:b].sum() for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(sums, torch.tensor([expected[a:b].sum()
                                                   for a, b in zip(bounds, bounds[1:])]),
                               rtol=1e-4, atol=1e-6)
    for c in sums.topk(phase2.REFINED_CHUNKS).indices.tolist():
        torch.testing.assert_close(got[bounds[c]:bounds[c + 1]],
                                   expected[bounds[c]:bounds[c + 1]], rtol=1e-4, atol=1e-6)
