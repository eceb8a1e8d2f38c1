"""Phase 1 layouts on a tiny random Llama, in fp32, in-process (no workers)."""

import pytest
import torch

from starqa import methods, phase1
from starqa.phase1.ring import _RingHook
from starqa.methods import MethodConfig, method_config, plan_blocks
from starqa.methods.star import block_positions


def full_forward_kv(model, ids):
    """Per-layer KV of one ordinary causal forward (transformers' own cache)."""
    out = model(ids[None], use_cache=True)
    cache = out.past_key_values
    return [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(len(cache.layers))]


IDS = torch.arange(100) % 40 + 3


def test_dense_blocks_equal_one_causal_forward(model):
    ref = full_forward_kv(model, IDS)
    blocks = plan_blocks(len(IDS), 30)
    for index, k, v in phase1.encode_dense(model, IDS, blocks):
        start, end = blocks[index]
        for layer, (rk, rv) in enumerate(ref):
            torch.testing.assert_close(k[layer], rk[:, start:end], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[layer], rv[:, start:end], rtol=1e-5, atol=1e-5)


def test_ring_in_one_process_runs_ring_and_equals_dense(model, monkeypatch):
    """encode_local for ring is ring's own path in a world of one (its hook, not dense's
    blockwise loop), and stores dense's blocks."""
    from starqa import methods
    from starqa.phase1 import ring

    blocks = plan_blocks(len(IDS), 30)
    dense = list(phase1.encode_dense(model, IDS, blocks))
    hooks_made = []
    monkeypatch.setattr(ring, "_RingHook", lambda *a: hooks_made.append(1) or _RingHook(*a))
    monkeypatch.setattr(phase1.dense, "encode_dense", None)  # ring must not fall back to dense
    config = method_config("ring", len(IDS), block_size=30)
    got = list(methods.get("ring").encode_local(model, IDS, config, blocks))
    assert hooks_made == [1]  # one forward over the whole chunk
    assert [i for i, _, _ in got] == [i for i, _, _ in dense] == [0, 1, 2, 3]
    for (_, k, v), (_, dk, dv) in zip(got, dense):
        assert k.shape == dk.shape
        torch.testing.assert_close(k, dk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, dv, rtol=1e-5, atol=1e-5)


def test_star_with_one_block_equals_dense(model):
    blocks = plan_blocks(len(IDS), len(IDS))
    [(_, k_star, v_star)] = phase1.encode_star(model, IDS, blocks, [0], anchor_size=len(IDS))
    [(_, k_dense, v_dense)] = phase1.encode_dense(model, IDS, blocks)
    torch.testing.assert_close(k_star, k_dense)
    torch.testing.assert_close(v_star, v_dense)


def test_star_second_block_sees_anchor_not_the_blocks_between(model):
    """Block 2 is encoded as [c[:a] ‖ c_2]: equal to a causal forward over exactly that
    sequence at positions (0..a-1, s..e-1), and different from dense (it skips block 1)."""
    blocks = plan_blocks(len(IDS), 25)  # 4 blocks
    anchor = 10
    [(_, k, v)] = phase1.encode_star(model, IDS, blocks, [2], anchor_size=anchor)
    start, end = blocks[2]
    seq = torch.cat([IDS[:anchor], IDS[start:end]])
    pos = torch.cat([torch.arange(anchor), torch.arange(start, end)])
    out = model(seq[None], position_ids=pos[None], use_cache=True)
    cache = out.past_key_values
    for layer in range(len(cache.layers)):
        torch.testing.assert_close(k[layer], cache.layers[layer].keys[0][:, anchor:],
                                   rtol=1e-5, atol=1e-5)
    dense = dict((i, kk) for i, kk, _ in phase1.encode_dense(model, IDS, blocks))
    assert not torch.allclose(k, dense[2], atol=1e-4)
    assert k.shape == (2, 2, end - start, 16)  # [L, Hkv, T, D]


def test_block_positions_take_the_slots_in_turn():
    """At contiguous positions with a = b, the first `slots` blocks after block 0 keep their
    own positions and every later one takes the next slot's, round and round; in one slot
    every block sits right after its anchor."""
    blocks = plan_blocks(7 * 100, 100)
    slots = MethodConfig("star", 100, 100, {"positions": "contiguous", "slots": 3})
    assert block_positions(slots, blocks) == [0, 100, 200, 300, 100, 200, 300]
    one = MethodConfig("star", 100, 100, {"positions": "contiguous"})
    assert block_positions(one, blocks) == [0] + [100] * 6
    star = methods.get("star")
    assert star.query_position(list(range(700)), slots, blocks) == 400
    assert star.query_position(list(range(700)), one, blocks) == 200


@pytest.mark.parametrize("slots", [None, 1, 2])  # sparse; contiguous, in one slot or two
@pytest.mark.parametrize("anchor", [20, 40])  # within block 0; longer than it
@pytest.mark.parametrize("indices", [[0, 1, 2, 3], [2, 3], [3, 1]])
def test_star_blocks_equal_a_forward_over_their_anchor_and_themselves(model, slots,
                                                                      anchor, indices):
    """The anchor's KV, computed once a call (or taken from block 0's), attended as past
    KV: every block's KV equals that of one causal forward over [c[:a] ‖ c_i] itself, the
    block at its own positions or from where `block_positions` places it."""
    blocks = plan_blocks(len(IDS), 25)
    config = MethodConfig("star", 25, anchor, {"positions": "contiguous", "slots": slots})
    firsts = block_positions(config, blocks) if slots else [s for s, _ in blocks]
    got = list(phase1.encode_star(model, IDS, blocks, indices, anchor_size=anchor,
                                  at=firsts if slots else None))
    assert [i for i, _, _ in got] == indices
    for i, k, v in got:
        start, end = blocks[i]
        a, at = min(anchor, start), firsts[i]
        seq = torch.cat([IDS[:a], IDS[start:end]])
        pos = torch.cat([torch.arange(a), torch.arange(at, at + end - start)])
        cache = model(seq[None], position_ids=pos[None], use_cache=True).past_key_values
        for layer in range(len(cache.layers)):
            torch.testing.assert_close(k[layer], cache.layers[layer].keys[0][:, a:],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[layer], cache.layers[layer].values[0][:, a:],
                                       rtol=1e-5, atol=1e-5)


def test_star_block_one_with_full_anchor_equals_dense(model):
    """With anchor = block size, block 1's input [c_0 ‖ c_1] is the true causal prefix."""
    blocks = plan_blocks(60, 30)
    ids = IDS[:60]
    [(_, k, _)] = phase1.encode_star(model, ids, blocks, [1], anchor_size=30)
    dense = list(phase1.encode_dense(model, ids, blocks))
    torch.testing.assert_close(k, dense[1][1], rtol=1e-5, atol=1e-5)


def test_method_defaults_follow_the_paper():
    cfg = method_config("star", 10_000)
    # block = n/4 rounded up to eight steps per octave (2,500 -> 2,560), anchor = block
    assert cfg == MethodConfig("star", 2_560, 2_560)
    assert method_config("star", 10_200).block_size == 2_560  # a small edit keeps the size
    assert all(len(plan_blocks(n, method_config("star", n).block_size)) == 4
               for n in (16, 999, 10_000, 77_777))
    assert method_config("star", 1_000_000).block_size == 32_768
    assert method_config("dense", 100).anchor_size == 0
    assert plan_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
