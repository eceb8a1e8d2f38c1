"""ivf's lists laid out by a mean query (starqa.topk.listlayout): the same keys, the same picks and
the same attention as lists laid out as built; the mean query sits where a question does."""

import pytest
import torch

from starqa.topk import indexes, listlayout, retrieval
from starqa.native import ops as native
from starqa.models.decoder_io import load_decoder
from starqa.topk.indexes import TopK
from starqa.topk.ivf import IvfLayer


def _blocks(seed: int, dim: int = 32):
    torch.manual_seed(seed)
    return [(torch.randn(2, 2, t, dim), torch.randn(2, 2, t, dim)) for t in (1500, 900)]


def test_lists_laid_out_by_a_direction_hold_the_same_lists_in_its_order():
    """Each head's lists go by descending centre · toward[head]; each is the same list
    (its centre and its rows) as built, its keys under their rows."""
    torch.manual_seed(3)
    blocks = [torch.randn(2, t, 16) for t in (500, 300)]
    built = {(b, h): indexes.build("ivf", blocks[b][h].numpy()) for b in range(2) for h in range(2)}
    toward = torch.randn(2, 16)
    as_built = IvfLayer.of(blocks, lambda b, _layer, h: built[(b, h)], 0)
    laid = IvfLayer.of(blocks, lambda b, _layer, h: built[(b, h)], 0, toward=toward)
    whole = torch.cat(blocks, dim=1)
    for head in range(2):
        lists = {}
        for c in range(as_built.centroids.shape[1]):
            rows = as_built.rows[head, as_built.offsets[head, c]:as_built.offsets[head, c + 1]]
            lists[tuple(as_built.centroids[head, c])] = sorted(rows.tolist())
        centres = torch.from_numpy(laid.centroids[head])
        scores = centres @ toward[head]
        # ordered by the unrounded means; the layer keeps them rounded to bf16
        assert (scores[1:] <= scores[:-1] + 1e-2 * scores.abs().max()).all()
        assert not torch.equal(centres, torch.from_numpy(as_built.centroids[head]))
        for c in range(laid.centroids.shape[1]):
            rows = laid.rows[head, laid.offsets[head, c]:laid.offsets[head, c + 1]]
            assert lists.pop(tuple(laid.centroids[head, c])) == sorted(rows.tolist())
        assert not lists
        assert torch.equal(laid.keys[head], whole[head][torch.from_numpy(laid.rows[head])])
        assert (laid.rows[head][laid.at[head]] == range(whole.shape[1])).all()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("tail", ["none", "lists"])
def test_lists_laid_out_by_a_direction_give_the_same_attention(compiled, tail, monkeypatch):
    """The picks never depend on where the lists lie: a forward through lists laid out by
    a direction equals one through lists as built, bit for bit without the tail (with the
    compiled kernel and with numpy's selection); the tail sums its lists in their order,
    so with it the same up to that rounding."""
    if compiled and not native.available():
        pytest.skip("starqa's kernels not built")
    monkeypatch.setattr(native, "available", lambda: compiled)
    blocks = _blocks(5)
    toward = [torch.randn(2, 32) for _ in range(2)]
    settings = TopK(count=60, index="ivf", sink=4, tail=tail)
    as_built = retrieval.from_parts(blocks, settings, 2400)
    laid = retrieval.from_parts(blocks, settings, 2400, toward=toward)
    assert not (as_built.ivf[1].centroids == laid.ivf[1].centroids).all()
    q = torch.randn(1, 2, 12, 32)  # 3 query heads per KV head at 4 positions
    own = tuple(torch.randn(1, 2, 10, 32) for _ in range(2))
    for layer in range(2):
        for a, b in zip(as_built.parts(layer, q, 32 ** -0.5, 4, own),
                        laid.parts(layer, q, 32 ** -0.5, 4, own)):
            if tail == "none":
                assert all(torch.equal(x, y) for x, y in zip(a, b))
            else:
                assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def test_the_mean_query_is_rotated_to_where_it_is_asked(tiny_model):
    """A forward of the text by itself at position P has the hidden states of the text at
    0 (RoPE is relative), so its mean query is that at 0 rotated by P's angles; one mean a
    layer and KV head, over the first SAMPLE tokens only."""
    decoder = load_decoder(tiny_model, torch.float32)
    config = decoder.config
    ids = torch.arange(3, 3 + listlayout.SAMPLE + 8)
    at_zero = listlayout.mean_queries(decoder, ids, 0)
    at_p = listlayout.mean_queries(decoder, ids, 5000)
    assert len(at_zero) == len(decoder.layers)
    assert at_zero[0].shape == (config.kv_heads, config.head_dim)
    cos, sin = (x[0].float() for x in decoder.rope(torch.tensor([5000])))
    half = config.head_dim // 2
    for a, b in zip(at_zero, at_p):
        turned = a * cos + torch.cat([-a[:, half:], a[:, :half]], -1) * sin
        torch.testing.assert_close(b, turned, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(a, b, rtol=1e-2, atol=1e-3)  # P turned them
    shorter = listlayout.mean_queries(decoder, ids[:listlayout.SAMPLE], 0)
    assert all(torch.equal(a, b) for a, b in zip(at_zero, shorter))
    assert listlayout.mean_queries(decoder, ids[:0], 0) is None  # no text: lists as built
