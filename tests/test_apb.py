"""APB: the mask, the compressor, and the Phase 1 layout on a tiny random Llama (fp32)."""

import pytest
import torch
import torch.nn.functional as F

from starqa.phase1 import apb
from starqa import methods, phase1
from starqa.core.errors import StarqaError
from starqa.methods import MethodConfig, method_config, plan_blocks


IDS = torch.arange(120) % 40 + 3


def test_mask_anchor_rows_never_see_passing_block_rows_see_all_before():
    # anchor 2, passing 3, block 3 -> keys [a0 a1 | p0 p1 p2 | b0 b1 b2]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(apb.layout_mask(2, 3, 3), expected)
    assert torch.equal(apb.layout_mask(0, 0, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_scores_are_group_mean_dot_products_max_pooled():
    torch.manual_seed(0)
    probe = torch.randn(1, 4, 3, 8)  # 4 query heads, 2 per KV head, 3 probe rows
    key = torch.randn(1, 2, 10, 8)
    got = apb.key_scores(probe, key, pool=1)
    for h in range(2):
        dots = torch.einsum("gwd,td->gwt", probe[0, 2 * h:2 * h + 2], key[0, h])
        torch.testing.assert_close(got[0, h], dots.mean(dim=(0, 1)))
    pooled = apb.key_scores(probe, key, pool=5)
    torch.testing.assert_close(pooled, F.max_pool1d(got, 5, stride=1, padding=2))
    assert pooled.shape == (1, 2, 10)


def test_compress_keeps_the_top_keys_per_head_in_positional_order():
    key = torch.zeros(1, 2, 12, 4)
    key[0, 0, 9, 0], key[0, 0, 2, 0] = 5.0, 4.0  # head 0 favours tokens 9 and 2
    key[0, 1, 0, 0], key[0, 1, 11, 0] = 5.0, 4.0  # head 1 favours tokens 0 and 11
    value = torch.arange(12.0).view(1, 1, 12, 1).expand(1, 2, 12, 4)
    probe = torch.zeros(1, 2, 1, 4)
    probe[..., 0] = 1.0
    k, v = apb.compress(probe, key, value, passing=2, pool=1)
    assert k.shape == v.shape == (1, 2, 2, 4)
    assert v[0, 0, :, 0].tolist() == [2.0, 9.0] and v[0, 1, :, 0].tolist() == [0.0, 11.0]
    # A passing length beyond the block keeps every key.
    assert apb.compress(probe, key, value, passing=50, pool=1)[0].shape[2] == 12


def _apb(model, blocks, anchor, passing, window=16, ids=IDS, question_ids=None):
    params = {"passing": passing, "window": window, "question_ids": question_ids}
    config = MethodConfig("apb", 30, anchor, params)
    return list(methods.get(config.name).encode_local(model, ids, config, blocks))


def test_without_passing_blocks_apb_is_star_with_its_anchor(model):
    blocks = plan_blocks(len(IDS), 30)
    got = _apb(model, blocks, anchor=7, passing=0)
    star = list(phase1.encode_star(model, IDS, blocks, range(len(blocks)), anchor_size=7))
    for (i, k, v), (j, sk, sv) in zip(got, star):
        assert i == j
        torch.testing.assert_close(k, sk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, sv, rtol=1e-5, atol=1e-5)


def test_passing_every_key_without_anchor_is_dense(model):
    """With no anchor and passing blocks that keep every key, block i attends to every earlier
    block's layer KV at its original positions: exactly causal attention. This checks the
    per-layer passing, the positions and the mask together."""
    blocks = plan_blocks(len(IDS), 30)
    got = _apb(model, blocks, anchor=0, passing=30)
    for (_, k, v), (_, dk, dv) in zip(got, phase1.encode_dense(model, IDS, blocks)):
        torch.testing.assert_close(k, dk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, dv, rtol=1e-4, atol=1e-4)


def test_passing_changes_later_blocks_only_and_keeps_block_kv_only(model):
    blocks = plan_blocks(len(IDS), 30)
    with_p = _apb(model, blocks, anchor=7, passing=4)
    without = _apb(model, blocks, anchor=7, passing=0)
    torch.testing.assert_close(with_p[0][1], without[0][1])  # block 0 is encoded alone
    for i in (1, 2, 3):
        # Layer 0's KV comes before any attention; deeper layers see what was passed.
        torch.testing.assert_close(with_p[i][1][0], without[i][1][0])
        assert not torch.allclose(with_p[i][1][1], without[i][1][1], atol=1e-4)
    for i, k, v in with_p:
        start, end = blocks[i]
        assert k.shape == v.shape == (2, 2, end - start, 16)  # only B_i's KV is kept


def test_question_in_the_anchor_is_the_probe(model):
    """With a known question the anchor is [question ‖ c[:l_a]] at positions 0..|A|-1 and
    the question's rows choose what is passed, so the result depends on the question."""
    blocks = plan_blocks(len(IDS), 30)
    q1, q2 = [5, 6, 7], [30, 31, 32]
    a, b = _apb(model, blocks, 7, 4, question_ids=q1), _apb(model, blocks, 7, 4, question_ids=q2)
    torch.testing.assert_close(a[0][1], b[0][1])  # block 0 sees no anchor
    assert not torch.allclose(a[2][1], b[2][1], atol=1e-4)
    # With nothing passed, the anchor alone decides: a causal forward over [q ‖ c[:7] ‖ B_1].
    [_, (_, k, _), *_] = _apb(model, blocks, 7, 0, question_ids=q1)
    seq = torch.cat([torch.tensor(q1), IDS[:7], IDS[30:60]])
    pos = torch.cat([torch.arange(10), torch.arange(30, 60)])
    cache = model(seq[None], position_ids=pos[None], use_cache=True).past_key_values
    torch.testing.assert_close(k[0], cache.layers[0].keys[0][:, 10:], rtol=1e-5, atol=1e-5)


def test_round_robin_assignment():
    assert [apb.assignment(5, 2, r) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert methods.get(method_config("apb", 100).name).assignment(5, 2, 1) == [1, 3]
    assert methods.get(method_config("star", 100).name).assignment(5, 2, 1) == [3, 4]


def test_method_defaults_and_option_errors():
    cfg = method_config("apb", 8_192)
    assert cfg == MethodConfig("apb", 2_048, 512, {"passing": 256, "window": 64, "question": None})
    given = method_config("apb", 8_000, anchor_size=100, params={"passing": 10})
    assert (given.anchor_size, given.params["passing"]) == (100, 10)
    with pytest.raises(StarqaError, match="--passing-size only applies to --method apb"):
        method_config("star", 100, params={"passing": 10})
    with pytest.raises(StarqaError, match="--anchor-size only applies to --method star or apb"):
        method_config("pulsar", 100, anchor_size=3)
    with pytest.raises(StarqaError, match="--probe-window"):
        method_config("apb", 100, params={"window": 0})
