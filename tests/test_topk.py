"""Top-k attention: the pure math (starqa.attention.topk) against exact attention in fp64 and fp32,
each index kind's retrieval (starqa.topk.retrieval, starqa.topk.indexes), and the settings'
parsing."""

import math

import pytest
import torch

from starqa.topk import indexes, probing, retrieval
from starqa.native import ops as native
from starqa.core import tensorfile
from starqa.attention import topk
from starqa.attention import attend, merge
from starqa.core.errors import StarqaError
from starqa.topk.indexes import TopK
from starqa.topk.ivf import IvfLayer, IvfShard
from starqa.topk.rows import Held, ResidentRows

from memory import rss  # tests/memory.py (conftest puts tests/ on the path)
from oracles import exact_part


def folded(query, kv_heads):
    """[1, Hq, M, D] → [Hkv, G*M, D] (attention.fold_gqa without its batch dimension)."""
    _, hq, m, d = query.shape
    return query.reshape(kv_heads, hq // kv_heads * m, d)


@pytest.mark.parametrize("hkv,rows,n,dim", [(1, 1, 7, 8), (2, 6, 50, 16), (3, 9, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_key_selected_equals_exact_partial_attention(hkv, rows, n, dim, dtype):
    torch.manual_seed(0)
    q = torch.randn(hkv, rows, dim)
    key, value = torch.randn(hkv, n, dim).to(dtype), torch.randn(hkv, n, dim).to(dtype)
    scale = dim ** -0.5
    scores, idx = topk.select_exact(q.to(dtype), key, n + 5)
    assert scores.shape == (hkv, rows, n) and scores.dtype == torch.float32
    out, lse = topk.attend_selected(scores, idx, topk.gather_rows(value, idx), scale)
    ref_out, ref_lse = exact_part(q.to(dtype), key, value, scale, torch.float64)
    fp32_out, fp32_lse = exact_part(q.to(dtype), key, value, scale, torch.float32)
    # The top-k part is as close to the fp64 reference as attend's own fp32 result is.
    own = (fp32_out - ref_out).abs().max().item()
    assert (out.double() - ref_out).abs().max().item() <= 2 * own + 1e-6
    assert (lse.double() - ref_lse).abs().max().item() <= 2 * (fp32_lse - ref_lse).abs().max() + 1e-6


def test_small_k_is_attention_over_exactly_the_best_keys():
    torch.manual_seed(1)
    hkv, rows, n, dim, k = 2, 4, 64, 16, 5
    q, key, value = torch.randn(hkv, rows, dim), torch.randn(hkv, n, dim), torch.randn(hkv, n, dim)
    scores, idx = topk.select_exact(q, key, k)
    out, lse = topk.attend_selected(scores, idx, topk.gather_rows(value, idx), 0.25)
    full = torch.einsum("hrd,hnd->hrn", q, key) * 0.25
    best = full.topk(k, dim=-1).indices
    masked = torch.full_like(full, -math.inf).scatter(-1, best, full.gather(-1, best))
    assert torch.equal(idx.sort(dim=-1).values, best.sort(dim=-1).values)
    assert torch.allclose(lse[0], masked.logsumexp(-1), atol=1e-5)
    assert torch.allclose(out[0], masked.softmax(-1) @ value, atol=1e-5)
    # and the part it leaves out is real: the top-k lse is below the full one
    assert (lse[0] < full.logsumexp(-1)).all()


def test_missing_keys_weigh_nothing():
    scores = torch.tensor([[[3.0, -1.0, 7.0]]])
    idx = torch.tensor([[[4, -1, 2]]])
    values = torch.tensor([[[[1.0], [100.0], [2.0]]]])
    out, lse = topk.attend_selected(scores, idx, values, 1.0)
    assert math.isclose(lse.item(), math.log(math.exp(3) + math.exp(7)), rel_tol=1e-6)
    none = topk.attend_selected(scores, torch.full_like(idx, -1), values, 1.0)
    assert none[1].item() == -math.inf and none[0].abs().sum() == 0


@pytest.mark.parametrize("kind", indexes.KINDS)
def test_each_index_kind_with_every_key_is_exact_and_merges_across_workers(kind):
    """Two workers' top-k parts (k >= each shard) and the query's own causal part merge
    to exact attention over the whole cache."""
    torch.manual_seed(2)
    hkv, g, m, dim, layers = 2, 3, 4, 16, 2
    blocks = [(torch.randn(layers, hkv, t, dim), torch.randn(layers, hkv, t, dim))
              for t in (40, 90, 70)]
    own_k, own_v = torch.randn(1, hkv, m, dim), torch.randn(1, hkv, m, dim)
    query = torch.randn(1, hkv * g, m, dim)
    settings = TopK(count=1000, index=kind)
    workers = [retrieval.from_parts(blocks[:1], settings, 200),
               retrieval.from_parts(blocks[1:], settings, 200)]
    layer, scale = 1, dim ** -0.5
    q = query.reshape(1, hkv, g * m, dim)
    outs, lses = [], []
    for worker in workers:
        out, lse = worker.parts(layer, q, scale)
        outs += out
        lses += lse
    own_out, own_lse = attend(query, own_k, own_v, scale, causal=True)
    outs.append(own_out.reshape(1, hkv, g * m, dim))
    lses.append(own_lse.reshape(1, hkv, g * m))
    out, lse = merge(torch.cat(outs), torch.cat(lses))
    keys = torch.cat([b[0][layer] for b in blocks] + [own_k[0]], dim=1)[None]
    values = torch.cat([b[1][layer] for b in blocks] + [own_v[0]], dim=1)[None]
    ref, ref_lse = attend(query, keys, values, scale, causal=True)
    assert torch.allclose(out.reshape(ref.shape), ref, atol=1e-5)
    assert torch.allclose(lse.reshape(ref_lse.shape), ref_lse, atol=1e-5)


@pytest.mark.parametrize("kind", indexes.KINDS)
def test_the_question_attends_every_key_exactly_unless_told_otherwise(kind):
    """TopK.prefill "exact" (the default): the question's forward (question=True) attends
    every key of the worker's blocks, the sink's included, and its own keys causally,
    whatever k and the index: fp32 against an fp64 reference, within a few times fp32's
    own error. The answer's tokens (question=False), and the question under prefill
    "topk", attend their k keys, which is not the same."""
    torch.manual_seed(8)
    hkv, g, m, dim = 2, 3, 5, 16
    blocks = [(torch.randn(2, hkv, t, dim), torch.randn(2, hkv, t, dim)) for t in (60, 50)]
    own_k, own_v = torch.randn(1, hkv, m, dim), torch.randn(1, hkv, m, dim)
    query = torch.randn(1, hkv * g, m, dim)
    q, scale, layer = query.reshape(1, hkv, g * m, dim), dim ** -0.5, 1
    keys = torch.cat([b[0][layer] for b in blocks] + [own_k[0]], dim=1)[None]
    values = torch.cat([b[1][layer] for b in blocks] + [own_v[0]], dim=1)[None]
    ref, ref_lse = attend(query.double(), keys.double(), values.double(), scale, causal=True)
    ref32, _ = attend(query, keys, values, scale, causal=True)
    bound = 4 * (ref32.double() - ref).abs().max() + 1e-6

    def merged(settings, question):
        shard = retrieval.from_parts(blocks, settings, 110)
        outs, lses = shard.parts(layer, q, scale, m, (own_k, own_v), question)
        out, lse = merge(torch.cat([o.float() for o in outs]), torch.cat(lses))
        return out.reshape(ref.shape).double(), lse.reshape(ref_lse.shape).double()

    out, lse = merged(TopK(count=3, index=kind, sink=4), True)
    assert (out - ref).abs().max() <= bound and (lse - ref_lse).abs().max() <= bound
    for settings, question in ((TopK(count=3, index=kind, sink=4), False),
                               (TopK(count=3, index=kind, sink=4, prefill="topk"), True)):
        out, _ = merged(settings, question)
        assert (out - ref).abs().max() > 100 * bound


def test_the_question_reads_a_mapped_shard_a_block_layer_at_a_time():
    """With the blocks memory-mapped, the question's exact forward releases each block's
    layer as soon as it is attended, so it never holds more than one of them."""
    torch.manual_seed(9)
    hkv, dim = 2, 8
    parts = [(torch.randn(2, hkv, t, dim), torch.randn(2, hkv, t, dim)) for t in (30, 20)]
    shard = retrieval.from_parts(parts, TopK(count=2), 50)
    released = []
    shard.blocks = [(k, v, lambda layer, b=b: released.append((b, layer)))
                    for b, (k, v) in enumerate(parts)]
    q = torch.randn(1, hkv, 3, dim)
    shard.parts(1, q, dim ** -0.5, question=True)
    assert released == [(0, 1), (1, 1)]
    shard.parts(1, q, dim ** -0.5)  # an answer's token reads no whole block
    assert released == [(0, 1), (1, 1)]


@pytest.mark.parametrize("kind", indexes.KINDS)
def test_the_sink_is_attended_apart_and_never_retrieved(kind):
    """The first worker attends to the context's first `sink` rows exactly, in addition
    to the k keys it retrieves from the rest: flat gives attention over exactly the sink
    and the k best of the rest; no kind's retrieval returns a sink row (counted twice);
    a worker without the context's start has no sink."""
    torch.manual_seed(5)
    hkv, g, dim, sink, k = 2, 3, 16, 4, 5
    blocks = [(torch.randn(1, hkv, t, dim), torch.randn(1, hkv, t, dim)) for t in (60, 50)]
    blocks[0][0][:, :, :sink] *= 0.1  # small inner products: never among a row's best
    settings = TopK(count=k, index=kind, sink=sink)
    first = retrieval.from_parts(blocks, settings, 110)
    other = retrieval.from_parts(blocks[1:], settings, 110, first=False)
    assert first.n_sink == sink and other.n_sink == 0 and other.sinks is None
    q = torch.randn(hkv, g, dim)
    _, idx = first.select(0, q, k)
    assert ((idx < 0) | (idx >= sink)).all() and (idx >= sink).sum() > 0
    if kind != "flat":
        return
    outs, lses = first.parts(0, q[None], dim ** -0.5)
    # the sink's part and the retrieved part; one (one softmax) from the compiled kernel
    assert len(outs) == (1 if native.available() else 2)
    out, lse = merge(torch.cat(outs), torch.cat(lses))
    keys = torch.cat([b[0][0] for b in blocks], dim=1)  # [Hkv, N, D]
    values = torch.cat([b[1][0] for b in blocks], dim=1)
    best = (q @ keys[:, sink:].transpose(1, 2)).topk(k).indices + sink  # [Hkv, g, k]
    for head in range(hkv):
        for row in range(g):
            rows = torch.cat([torch.arange(sink), best[head, row]])
            ref, ref_lse = attend(q[head, row][None, None, None], keys[head, rows][None, None],
                                  values[head, rows][None, None], dim ** -0.5)
            assert torch.allclose(out[head, row], ref.flatten(), atol=1e-5)
            assert torch.allclose(lse[head, row], ref_lse.flatten(), atol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_without_the_compiled_kernel_a_bf16_shard_attends_as_with_it(kind, monkeypatch):
    """Where no C compiler built the kernels, torch's code takes a bf16 shard's rows over
    the fp32 sink (it raised a dtype error) and gives the kernel's attention up to its
    bf16-rounded scores."""
    torch.manual_seed(8)
    hkv, g, dim = 2, 3, 16
    blocks = [(torch.randn(1, hkv, t, dim).bfloat16(), torch.randn(1, hkv, t, dim).bfloat16())
              for t in (60, 50)]
    shard = retrieval.from_parts(blocks, TopK(count=5, index=kind, sink=4), 110)
    q = torch.randn(1, hkv, g, dim).bfloat16()
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(native, "available", lambda: False)
        outs, lses = shard.parts(0, q, dim ** -0.5)
        results.append(merge(torch.cat([o.float() for o in outs]), torch.cat(lses)))
    (out, lse), (ref, ref_lse) = results
    assert torch.allclose(out, ref, atol=0.05) and torch.allclose(lse, ref_lse, atol=0.05)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_index_search_finds_most_of_the_exact_top_k(kind):
    """Approximate retrieval on keys with structure (clusters, as real keys have): the
    keys found are mostly the exact top k, and they carry most of its attention mass."""
    torch.manual_seed(3)
    n, dim, k = 4000, 32, 40
    centers = torch.randn(50, dim) * 3
    keys = centers[torch.randint(0, 50, (n,))] + torch.randn(n, dim)
    queries = centers[torch.randint(0, 50, (8,))] + torch.randn(8, dim)
    index = indexes.build(kind, keys.numpy())
    _, found = probing.search(index, queries.numpy(), k)
    exact = (queries @ keys.T).topk(k).indices
    recall = sum(len(set(f.tolist()) & set(e.tolist())) for f, e in zip(found, exact)) / exact.numel()
    assert recall >= 0.9, recall
    found = torch.from_numpy(found).clamp(min=0)
    probs = ((queries @ keys.T) / math.sqrt(dim)).softmax(-1)
    assert (probs.gather(-1, found).sum(-1) / probs.gather(-1, exact).sum(-1)).min() >= 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ivf_layer_holds_every_key_once_under_its_list_and_row(dtype):
    """Phase 2 keeps a worker's blocks' IVF lists (every KV head) list by list: every key
    once, in the cache's dtype, under its row in the shard and in the list its block's
    index put it in; a list's centre is the mean of its keys (rounded to bf16)."""
    import faiss

    torch.manual_seed(4)
    hkv, dim = 2, 16
    blocks = [torch.randn(hkv, t, dim).to(dtype) for t in (500, 300, 400)]
    built = {(b, h): indexes.build("ivf", blocks[b][h].float().numpy())
             for b in range(3) for h in range(hkv)}
    layer = IvfLayer.of(blocks, lambda b, _layer, h: built[(b, h)], 0)
    n = sum(b.shape[1] for b in blocks)
    whole = torch.cat(blocks, dim=1)  # [Hkv, N, D]
    moved = 0  # lists whose mean is not their trained centroid
    for head in range(hkv):
        assert sorted(layer.rows[head].tolist()) == list(range(n))
        assert torch.equal(layer.keys[head], whole[head][torch.from_numpy(layer.rows[head])])
        assert layer.keys.dtype == dtype and layer.offsets[head, -1] == n
        # each list's keys are nearest (by inner product) to its centroid among the
        # centroids of their own block
        for c in range(0, layer.centroids.shape[1], 7):
            rows = layer.rows[head, layer.offsets[head, c]:layer.offsets[head, c + 1]]
            block = int(rows[0] >= 500) + int(rows[0] >= 800) if len(rows) else 0
            lists = built[(block, head)].nlist
            first = sum(built[(b, head)].nlist for b in range(block))
            exact = faiss.extract_index_ivf(built[(block, head)]).quantizer.reconstruct_n(
                0, lists)
            centre = torch.from_numpy(layer.centroids[head][c])
            if len(rows):
                scores = whole[head][torch.from_numpy(rows)].float() @ torch.from_numpy(exact.T)
                assert (scores.argmax(-1) == c - first).all()
                mean = whole[head][torch.from_numpy(rows)].float().mean(0)
                # the layer keeps it rounded to bf16 (the kernel reads bf16)
                torch.testing.assert_close(centre, mean, rtol=2 ** -8, atol=1e-6)
                moved += not torch.allclose(centre, torch.from_numpy(exact[c - first]),
                                            rtol=2 ** -8, atol=1e-6)
            else:  # nothing to average: the index's own centroid
                assert torch.equal(centre, torch.from_numpy(exact[c - first]).bfloat16().float())
    assert moved > 0


def test_a_row_probes_enough_lists_however_small_the_context():
    """IVF_ROW_SCAN * k keys is few lists on a short context (8K, k = 82, 208 lists: 9);
    a row probes at least IVF_MIN_PROBES (32K too: 34 of 840 by the scan rule), never more
    than every list, and on a longer context the scan rule rules (128K: 135 of 3,360)."""
    assert probing.ivf_probes(8192, 208, 82, probing.IVF_ROW_SCAN) == 9
    assert probing.row_probes(8192, 208, 82) == probing.IVF_MIN_PROBES == 48
    assert probing.row_probes(32768, 840, 328) == 48
    assert probing.row_probes(131072, 3360, 1311) == 135
    assert probing.row_probes(4096, 30, 41) == 30


def test_ivf_finds_the_exact_top_k_when_every_list_is_scanned():
    """With k at least the keys (every list scanned), ivf selects exactly flat's keys
    with flat's scores, sink or not."""
    torch.manual_seed(6)
    blocks = [(torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)) for t in (300, 200)]
    q = torch.randn(2, 3, 16)
    for sink in (0, 4):
        flat = retrieval.from_parts(blocks, TopK(count=496, index="flat", sink=sink), 500)
        ivf = retrieval.from_parts(blocks, TopK(count=496, index="ivf", sink=sink), 500)
        s_flat, i_flat = flat.select(0, q, 500 - sink)
        s_ivf, i_ivf = ivf.select(0, q, 500 - sink)
        order_f, order_i = i_flat.sort(-1), i_ivf.sort(-1)
        assert torch.equal(order_f.values, order_i.values)
        assert torch.allclose(s_flat.gather(-1, order_f.indices), s_ivf.gather(-1, order_i.indices),
                              atol=1e-5)


def test_linear_schedule_grows_with_depth_for_the_same_budget():
    assert topk.layer_budgets(10, 4, "uniform") == [10] * 4
    linear = topk.layer_budgets(100, 30, "linear")
    assert linear == sorted(linear) and linear[0] < 100 < linear[-1]
    assert abs(sum(linear) - 100 * 30) <= 30  # rounding, at most half a key per layer
    assert min(topk.layer_budgets(1, 30, "linear")) == 1


def test_top_k_settings_parse_and_every_bad_value_is_named():
    assert indexes.topk_settings() is None
    s = indexes.topk_settings("topk", "0.5%", "linear", "ivf", True)
    assert (s.fraction, s.count, s.schedule, s.index, s.kv_on_disk) == (0.005, None, "linear",
                                                                       "ivf", True)
    assert s.keys(10_000) == 50 and s.label == "0.5%"
    assert indexes.topk_settings("topk", "512").keys(10) == 512
    assert indexes.topk_settings("topk").label == "1%"  # the paper's default
    for bad, says in [("0", "keeps no key"), ("0%", "keeps no key"),
                      ("150%", "more than the whole context"), ("lots", "neither a number"),
                      ("-3", "neither a number"), ("1.5", "neither a number")]:
        with pytest.raises(StarqaError, match=says) as err:
            indexes.topk_settings("topk", bad)
        assert "--top-k 1%" in err.value.hint
    with pytest.raises(StarqaError, match="only apply to --attention topk"):
        indexes.topk_settings("exact", "1%")
    with pytest.raises(StarqaError, match="Unknown --index"):
        indexes.topk_settings("topk", "1%", index="lsh")
    with pytest.raises(StarqaError, match="Unknown --top-k-schedule"):
        indexes.topk_settings("topk", "1%", schedule="cubic")
    assert indexes.topk_settings("topk").prefill == "exact"  # the paper's prefilled cache
    assert indexes.topk_settings("topk", prefill="topk").prefill == "topk"
    with pytest.raises(StarqaError, match="Unknown --top-k-prefill 'fast'") as err:
        indexes.topk_settings("topk", "1%", prefill="fast")
    assert "exact or topk" in err.value.hint
    with pytest.raises(StarqaError, match="--top-k-prefill only apply to --attention topk"):
        indexes.topk_settings("exact", prefill="topk")
    with pytest.raises(StarqaError, match="Unknown --attention"):
        indexes.topk_settings("sparse")


def test_the_tail_is_ivfs_by_default_and_every_bad_value_is_named():
    assert indexes.topk_settings("topk", index="ivf").tails  # the default under ivf
    assert not indexes.topk_settings("topk", index="ivf", tail="none").tails
    assert not indexes.topk_settings("topk").tails  # flat: no lists, no tail
    ivf = indexes.topk_settings("topk", index="ivf", tail="none")
    assert ivf.cli_args()[-2:] == ["--top-k-tail", "none"] and "no tail" in ivf.describe()
    for settings in (indexes.topk_settings("topk"), ivf):  # a warm group's options: valid
        given = dict(zip(settings.cli_args()[::2], settings.cli_args()[1::2]))
        assert indexes.topk_settings(
            given["--attention"], given["--top-k"], given["--top-k-schedule"],
            given["--index"], prefill=given["--top-k-prefill"],
            tail=given.get("--top-k-tail")) == settings
    with pytest.raises(StarqaError, match="Unknown --top-k-tail 'all'") as err:
        indexes.topk_settings("topk", index="ivf", tail="all")
    assert "lists or none" in err.value.hint
    with pytest.raises(StarqaError, match="--index flat has none") as err:
        indexes.topk_settings("topk", index="flat", tail="lists")
    assert "--index ivf" in err.value.hint
    with pytest.raises(StarqaError, match="--top-k-tail only apply to --attention topk"):
        indexes.topk_settings("exact", tail="lists")


def copies_shard(sink: int, k: int):
    """An ivf shard by hand whose every list holds copies of one key and one value (so a
    list's centre and mean value are its keys' and values' own, bf16-exact): 80 lists of
    1-4 keys per KV head, the lists' positions a shuffle of the shard's rows. Returns the
    shard (the tail on) and the keys and values [Hkv, N, D] by shard row."""
    import numpy as np

    torch.manual_seed(11)
    hkv, dim, n_lists = 2, 16, 80
    sizes = torch.randint(1, 5, (hkv, n_lists))
    sizes[:, -1] += int(sizes.sum(1).max()) - sizes.sum(1)  # every head the same N keys
    n = int(sizes[0].sum())
    centres = torch.randn(hkv, n_lists, dim).bfloat16().float()
    means = torch.randn(hkv, n_lists, dim).bfloat16().float()
    rows = torch.stack([torch.randperm(n) for _ in range(hkv)])  # position -> shard row
    keys = torch.empty(hkv, n, dim)
    values = torch.empty(hkv, n, dim)
    for h in range(hkv):
        of = torch.repeat_interleave(torch.arange(n_lists), sizes[h])  # position -> list
        keys[h, rows[h]] = centres[h, of]
        values[h, rows[h]] = means[h, of]
    offsets = torch.cat([torch.zeros(hkv, 1, dtype=torch.int64), sizes.cumsum(1)], 1)
    lay = IvfLayer(centres.numpy(), offsets.numpy(), rows.numpy().astype(np.int64),
                   torch.stack([keys[h, rows[h]] for h in range(hkv)]), means.bfloat16())
    settings = TopK(count=k, index="ivf", sink=sink)
    sinks = [(keys[None, :, :sink], values[None, :, :sink])] if sink else None
    assert probing.row_probes(n, n_lists, k) < n_lists  # some lists are not scanned
    held = Held(settings, [k], n, ResidentRows([values]), sinks)
    return IvfShard(held, [lay]), keys, values


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("tokens", [1, 2])
def test_the_tail_is_exact_where_each_list_holds_copies_of_one_key(compiled, tokens,
                                                                   monkeypatch):
    """Where every key of a list is its centre and every value its mean, the tail's
    estimate of the keys a row left out is exact: k = 3 of ~200 keys (the sink's 4 rows,
    each position's G = 3 rows' union, the lists no row scanned) gives exact attention over
    every key, compiled and not, for one position or two at once; without the tail it
    does not."""
    if compiled and not native.available():
        pytest.skip("the compiled kernel was not built")
    if not compiled:
        monkeypatch.setattr(native, "available", lambda: False)
    shard, keys, values = copies_shard(sink=4, k=3)
    q = torch.randn(1, 2, 3 * tokens, 16) * 0.5
    scale = 16 ** -0.5
    ref, ref_lse = attend(q, keys[None], values[None], scale)
    out, lse = merge(*(torch.cat(x) for x in shard.parts(0, q, scale, tokens)))
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    shard.ivf[0].tail = None  # top-k alone
    shard._tables.clear()
    out, _ = merge(*(torch.cat(x) for x in shard.parts(0, q, scale, tokens)))
    assert not torch.allclose(out, ref, atol=1e-2)


def test_lists_left_counts_each_list_once_less_its_selected_and_sink_rows():
    list_of = torch.tensor([[0, 0, 1, 1, 1, 2]])  # shard row -> list
    sizes = torch.tensor([[2, 3, 1]])
    idx = torch.tensor([[[2, 5, -1], [3, 4, 2]]])  # two rows' selections (-1: none)
    left = topk.lists_left(idx, list_of, sizes, always=1)  # row 0 (list 0) is the sink's
    assert left.tolist() == [[[1, 2, 0], [1, 0, 1]]]


def test_block_tensors_read_by_hand_and_memory_mapped(tmp_path):
    from starqa.cache.shards import save_block

    k = torch.randn(2, 3, 10, 8).to(torch.bfloat16)
    v = torch.randn(2, 3, 10, 8).to(torch.bfloat16)
    path = save_block(tmp_path, 0, k, v, range(10), {"index": "0"})
    assert tensorfile.block_shape(path) == [2, 3, 10, 8]
    assert torch.equal(tensorfile.read_tensor(path, "k"), k)
    mapped = tensorfile.read_tensor(path, "v", mapped=True)
    assert torch.equal(mapped[1, 2, [7, 3]], v[1, 2, [7, 3]])


def test_a_mapped_layer_released_leaves_resident_memory(tmp_path):
    """--kv-on-disk reads a little of every layer for every token: `release` drops the
    layer's pages from the process (RSS falls back), and the tensor still reads right."""
    from starqa.cache.shards import save_block

    k = torch.randn(2, 1, 1 << 17, 64)  # 32 MiB a layer in fp32
    path = save_block(tmp_path, 0, k, k.clone(), range(1 << 17), {"index": "0"})
    mapped = tensorfile.MappedTensor(path, "k")
    del k
    before = rss()
    total = mapped.tensor[1].sum()  # reads every page of layer 1
    touched = rss()
    mapped.release(1)
    assert touched - before > 24 << 20 and touched - rss() > 24 << 20
    assert mapped.tensor[1].sum() == total  # read again from the file


def test_a_file_map_releases_only_the_pages_of_its_own_tensors(tmp_path):
    """`FileMap.release` drops the pages wholly inside a tensor it maps (RSS falls, the
    tensor still reads right from the file) and leaves a tensor of another memory alone."""
    from starqa.cache.shards import save_block

    k = torch.randn(2, 1, 1 << 17, 64)  # 32 MiB a layer in fp32
    path = save_block(tmp_path, 0, k, k[:, :, :8].clone(), range(1 << 17), {"index": "0"})
    tensors, _, mapped = tensorfile.map_file(path)
    total = tensors["k"][1].sum()
    other = torch.ones(1 << 23)  # 32 MiB of this process's own memory
    before = rss()
    mapped.release(other)
    assert abs(rss() - before) < 4 << 20 and other.sum() == 1 << 23
    mapped.release(tensors["k"][1])
    assert before - rss() > 24 << 20
    assert tensors["k"][1].sum() == total


def test_eval_runs_each_method_exact_then_with_each_top_k(home, tiny_model, tmp_path):
    from starqa.measure.evals import runner

    every, few = TopK(fraction=1.0), TopK(count=2, index="ivf")
    bare = TopK(count=2, index="ivf", tail="none")
    opts = runner.EvalOptions(model=str(tiny_model), methods="dense", tasks="niah_single_1",
                              lengths="300", samples=1, dtype="fp32", block_size=64,
                              json_path=str(tmp_path / "e.json"), topk=(every, few, bare))
    plan = runner.plan(opts)
    assert plan.labels == ["dense", "dense topk 100%", "dense topk 2 ivf",
                           "dense topk 2 ivf no-tail"] and plan.n_runs == 4
    results = runner.run(plan)
    r = results["samples"][0]["results"]
    assert r["dense topk 100%"]["token_ids"] == r["dense"]["token_ids"]  # every key: exact
    assert r["dense topk 2 ivf"]["attention"]["index"] == "ivf"
    (row,) = results["summary"]
    assert set(row["methods"]) == set(plan.labels)
    assert row["methods"]["dense topk 100%"]["retention"] in (None, 1.0)


@pytest.mark.parametrize("kind", indexes.KINDS)
def test_a_top_k_shard_leaves_torch_its_threads(kind):
    """Building and searching an index keep torch's thread count: faiss and torch share one
    OpenMP runtime here, and a faiss setting made on the decode's thread once left the whole
    decode (model included) on one core."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        blocks = [(torch.randn(1, 2, 120, 16), torch.randn(1, 2, 120, 16))]
        shard = retrieval.from_parts(blocks, TopK(count=8, index=kind), 120)
        shard.parts(0, torch.randn(1, 2, 3, 16), 0.25)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_ivf_select_ranks_in_the_kernel_as_numpy_does(monkeypatch):
    """On a GPU, `select` ranks ivf's lists on the host in the compiled kernel (numpy's
    `_select_ivf` took 2.2 s a token at 128K on an H100's host): the same rows and scores
    as numpy's, the sink never among them."""
    if not native.available():
        pytest.skip("starqa's kernels not built")
    torch.manual_seed(12)
    blocks = [(torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)) for t in (700, 500)]
    shard = retrieval.from_parts(blocks, TopK(count=20, index="ivf", sink=4), 1200)
    q = torch.randn(2, 6, 16)
    s_kernel, i_kernel = shard.select(0, q, 20)
    assert shard._tables[0].selects_only is False  # the kernel's table ranked them
    monkeypatch.setattr(native, "available", lambda: False)
    s_numpy, i_numpy = shard.select(0, q, 20)
    mine, theirs = i_kernel.sort(-1), i_numpy.sort(-1)
    assert torch.equal(mine.values, theirs.values) and (mine.values >= 4).all()
    torch.testing.assert_close(s_kernel.gather(-1, mine.indices),
                               s_numpy.gather(-1, theirs.indices))
