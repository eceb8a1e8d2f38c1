"""The compiled top-k kernel (starqa/native/_topk_*.c through `native.TopKTable`): each row's
attention over exactly its own best keys, against a float64 reference, within the error
of the same computation in fp32; row independence and buffer layouts bit for bit."""

import math
from pathlib import Path

import pytest
import torch

from starqa.native import ops as native
from starqa.attention import attend

from memory import rss  # tests/memory.py (conftest puts tests/ on the path)

pytestmark = pytest.mark.skipif(not native.available(), reason="starqa's kernels not built")


def topk_attend(q, keys, values, k, skip, scale, key_map=None, lists=None, tokens=None,
                key_at=None, own=None, tail=None, bias=0.0, unbiased=0):
    """A `native.TopKTable` of these buffers (its docstring says what each is), attended
    once."""
    return native.TopKTable(keys, values, key_map, lists, key_at, tail=tail).attend(
        q, k, skip, scale, tokens, own, bias, unbiased)


def reference(q, key, value, k, scale, skip=0, allowed=None, dtype=torch.float64, tokens=None):
    """Top-k attention of q [H, R, D] over key/value [H, N, D] in `dtype`: each row's k
    best keys among rows >= skip (and `allowed` [H, R, N], when given), and the sink, rows
    < skip; with `tokens` (R = G * tokens), each row attends over the union of its
    position's G rows' keys."""
    scores = torch.einsum("hrd,hnd->hrn", q.to(dtype), key.to(dtype))
    hidden = torch.zeros_like(scores, dtype=torch.bool)
    hidden[..., :skip] = True
    if allowed is not None:
        hidden |= ~allowed
    best = scores.masked_fill(hidden, -math.inf).topk(min(k, scores.shape[-1]), dim=-1)
    chosen = torch.zeros_like(hidden).scatter_(-1, best.indices, True) & ~hidden
    if tokens is not None:  # the union over the G rows of each position
        heads, rows, n = chosen.shape
        union = chosen.view(heads, rows // tokens, tokens, n).any(dim=1, keepdim=True)
        chosen = union.expand(heads, rows // tokens, tokens, n).reshape(heads, rows, n)
    chosen[..., :skip] = True
    logits = scores.masked_fill(~chosen, -math.inf) * scale
    lse = logits.logsumexp(-1)
    out = torch.einsum("hrn,hnd->hrd", (logits - lse[..., None]).exp(), value.to(dtype))
    return out, lse


def ivf_layout(key, lists, probes, seed=0):
    """Random lists over key [H, N, D]: (keys in list order, map [H, N], centroids
    [H, C, D], offsets [H, C + 1])."""
    g = torch.Generator().manual_seed(seed)
    heads, n, dim = key.shape
    order = torch.stack([torch.randperm(n, generator=g) for _ in range(heads)])
    cuts = torch.sort(torch.randint(0, n + 1, (heads, lists - 1), generator=g), dim=-1).values
    offsets = torch.cat([torch.zeros(heads, 1, dtype=torch.long), cuts,
                         torch.full((heads, 1), n)], dim=1)
    ordered = torch.stack([key[h][order[h]] for h in range(heads)])
    # centroids bf16 values: the kernel reads them in bf16
    return ordered, order, torch.randn(heads, lists, dim, generator=g).bfloat16().float(), offsets


def allowed_by_lists(q, order, centroids, offsets, probes):
    """[H, R, N]: the keys (shard rows) in each row's `probes` nearest lists."""
    heads, rows, _ = q.shape
    n = order.shape[1]
    near = torch.einsum("hrd,hcd->hrc", q.double(), centroids.double()).topk(probes, -1).indices
    allowed = torch.zeros(heads, rows, n, dtype=torch.bool)
    for h in range(heads):
        for r in range(rows):
            for c in near[h, r].tolist():
                allowed[h, r, order[h, offsets[h, c]:offsets[h, c + 1]]] = True
    return allowed


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,rows,n,dim,k", [(2, 5, 300, 24, 17), (3, 12, 40000, 64, 300)])
def test_each_row_attends_to_exactly_its_best_keys(kind, dtype, heads, rows, n, dim, k):
    """40,000 keys: several spans of positions, whose selections merge, and rows whose
    candidates overflow and are cut back to their best (see _topk.h)."""
    torch.manual_seed(0)
    q = torch.randn(heads, rows, dim)
    key, value = torch.randn(heads, n, dim).to(dtype), torch.randn(heads, n, dim).to(dtype)
    scale, skip = dim ** -0.5, 4
    keys, key_map, lists, allowed = [(0, key)], None, None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 9, 3)
        keys, lists = [(0, ordered)], (centroids, offsets, 3)
        allowed = allowed_by_lists(q, key_map, centroids, offsets, 3)
    out, lse = topk_attend(q, keys, [(0, value)], k, skip, scale, key_map, lists)
    want_out, want_lse = reference(q, key, value, k, scale, skip, allowed)
    fp32_out, fp32_lse = reference(q, key, value, k, scale, skip, allowed, torch.float32)
    own_out = (fp32_out.double() - want_out).abs().max().item()
    own_lse = (fp32_lse.double() - want_lse).abs().max().item()
    assert (out.double() - want_out).abs().max().item() <= 2 * own_out + 1e-6
    assert (lse.double() - want_lse).abs().max().item() <= 2 * own_lse + 1e-6


@pytest.mark.parametrize("rows", [3, 40])
def test_many_lists_are_chosen_in_pieces_and_each_row_keeps_its_best(rows):
    """Hundreds of lists and few rows (a decode): the centroids are scored a piece per task
    and each row picks its lists from all its scores, then scans them as a task of its own
    (40 rows: groups, one piece); every row still attends to exactly its best keys of its
    nearest lists."""
    torch.manual_seed(3)
    heads, n, dim, k = 2, 20000, 64, 50
    q = torch.randn(heads, rows, dim)
    key, value = torch.randn(heads, n, dim).bfloat16(), torch.randn(heads, n, dim).bfloat16()
    ordered, key_map, centroids, offsets = ivf_layout(key, 600, 40)
    out, lse = topk_attend(q, [(0, ordered)], [(0, value)], k, 2, 0.125, key_map,
                           (centroids, offsets, 40))
    allowed = allowed_by_lists(q, key_map, centroids, offsets, 40)
    want_out, want_lse = reference(q, key, value, k, 0.125, 2, allowed)
    fp32_out, fp32_lse = reference(q, key, value, k, 0.125, 2, allowed, torch.float32)
    assert (out.double() - want_out).abs().max() <= 2 * (fp32_out.double() - want_out).abs().max() + 1e-6
    assert (lse.double() - want_lse).abs().max() <= 2 * (fp32_lse.double() - want_lse).abs().max() + 1e-6


def test_every_key_is_exact_attention():
    """k >= N: the kernel's part is exact attention's, as close to float64 as
    attention.attend's own fp32 result is."""
    torch.manual_seed(1)
    q, key, value = torch.randn(3, 6, 64), torch.randn(3, 500, 64), torch.randn(3, 500, 64)
    out, lse = topk_attend(q, [(0, key)], [(0, value)], 10**6, 0, 0.125)
    want_out, want_lse = reference(q, key, value, 500, 0.125)
    exact_out, exact_lse = attend(q[None], key[None], value[None], 0.125)
    own_out = (exact_out[0].double() - want_out).abs().max().item()
    own_lse = (exact_lse[0].double() - want_lse).abs().max().item()
    assert (out.double() - want_out).abs().max().item() <= 2 * own_out + 1e-6
    assert (lse.double() - want_lse).abs().max().item() <= 2 * own_lse + 1e-6


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_query_heads_of_a_position_attend_to_the_union_of_their_keys(kind, dtype):
    """GQA: 3 query heads per KV head at 4 positions (rows g * 4 + m)."""
    torch.manual_seed(7)
    heads, groups, tokens, n, dim, k = 2, 3, 4, 3000, 64, 40
    q = torch.randn(heads, groups * tokens, dim)
    key, value = torch.randn(heads, n, dim).to(dtype), torch.randn(heads, n, dim).to(dtype)
    keys, key_map, lists, allowed = [(0, key)], None, None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 30, 5)
        keys, lists = [(0, ordered)], (centroids, offsets, 5)
        allowed = allowed_by_lists(q, key_map, centroids, offsets, 5)
    out, lse = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists, tokens)
    want_out, want_lse = reference(q, key, value, k, 0.125, 3, allowed, tokens=tokens)
    fp32_out, fp32_lse = reference(q, key, value, k, 0.125, 3, allowed, torch.float32, tokens)
    own_out = (fp32_out.double() - want_out).abs().max().item()
    own_lse = (fp32_lse.double() - want_lse).abs().max().item()
    assert (out.double() - want_out).abs().max().item() <= 2 * own_out + 1e-6
    assert (lse.double() - want_lse).abs().max().item() <= 2 * own_lse + 1e-6
    # and the union is more than a row's own k: the lse grows over the row's own
    alone, alone_lse = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists)
    assert (lse >= alone_lse - 1e-5).all() and (lse > alone_lse + 1e-3).any()


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_a_position_gets_the_same_bits_alone_or_among_others(kind):
    """Phase 2 checks drafted tokens as extra positions: each must equal a one-token step,
    its G query heads sharing as they do there."""
    torch.manual_seed(8)
    heads, groups, tokens, dim = 2, 3, 4, 64
    q = torch.randn(heads, groups, tokens, dim)
    key, value = torch.randn(heads, 5000, dim).bfloat16(), torch.randn(heads, 5000, dim).bfloat16()
    keys, key_map, lists = [(0, key)], None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 40, 6)
        keys, lists = [(0, ordered)], (centroids, offsets, 6)
    out, lse = topk_attend(q.reshape(heads, -1, dim), keys, [(0, value)], 50, 0, 0.125,
                           key_map, lists, tokens)
    out, lse = out.view(heads, groups, tokens, dim), lse.view(heads, groups, tokens)
    for m in range(tokens):
        one, one_lse = topk_attend(q[:, :, m].contiguous(), keys, [(0, value)], 50, 0,
                                   0.125, key_map, lists, 1)
        assert torch.equal(one, out[:, :, m]) and torch.equal(one_lse, lse[:, :, m])


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_a_row_gets_the_same_bits_alone_or_among_others(kind):
    """Phase 2 checks drafted tokens as extra rows: each must equal a one-row step."""
    torch.manual_seed(2)
    q = torch.randn(2, 12, 64)
    key, value = torch.randn(2, 5000, 64).bfloat16(), torch.randn(2, 5000, 64).bfloat16()
    keys, key_map, lists = [(0, key)], None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 40, 6)
        keys, lists = [(0, ordered)], (centroids, offsets, 6)
    out, lse = topk_attend(q, keys, [(0, value)], 50, 0, 0.125, key_map, lists)
    for r in (0, 5, 11):
        one, one_lse = topk_attend(q[:, r:r + 1], keys, [(0, value)], 50, 0, 0.125,
                                   key_map, lists)
        assert torch.equal(one[:, 0], out[:, r]) and torch.equal(one_lse[:, 0], lse[:, r])


def test_a_rows_picks_do_not_depend_on_how_many_rows_score_a_chunk():
    """A decode's few rows score a chunk's keys where they lie, many rows score a widened
    copy of it: both must add the same products in the same order, or a row's picks would
    depend on the rows it came with. Each key here is one of a family's 8 members, the
    same key with its 8-column pieces in another order; every query has its 8 pieces equal,
    so a family's members score the same in exact arithmetic and rounding alone (the order
    of the sums) decides which of them make the k, which cuts through a family."""
    torch.manual_seed(11)
    dim, families, members, rows = 64, 250, 8, 12
    q = torch.randn(1, rows, 8).repeat(1, 1, dim // 8)
    base = torch.randn(families, dim // 8, 8)
    orders = [torch.randperm(dim // 8) for _ in range(members)]
    key = torch.stack([base[:, order] for order in orders], 1).reshape(1, -1, dim).bfloat16()
    value = torch.randn(1, families * members, dim).bfloat16()
    k = 12 * members + members // 2
    out, lse = topk_attend(q, [(0, key)], [(0, value)], k, 0, 0.125)
    for r in range(rows):
        one, one_lse = topk_attend(q[:, r:r + 1], [(0, key)], [(0, value)], k, 0, 0.125)
        assert torch.equal(one[:, 0], out[:, r]) and torch.equal(one_lse[:, 0], lse[:, r])


def test_keys_and_values_in_several_buffers_give_the_same_bits():
    """--kv-on-disk hands the kernel one buffer per block (heads apart by each block's
    length), keys and values cut in different places."""
    torch.manual_seed(3)
    q = torch.randn(2, 3, 64)
    key, value = torch.randn(2, 3000, 64).bfloat16(), torch.randn(2, 3000, 64).bfloat16()
    whole = topk_attend(q, [(0, key)], [(0, value)], 40, 7, 0.125)
    cut = topk_attend(
        q, [(0, key[:, :1000].contiguous()), (1000, key[:, 1000:2001].contiguous()),
            (2001, key[:, 2001:].contiguous())],
        [(0, value[:, :1500].contiguous()), (1500, value[:, 1500:].contiguous())], 40, 7, 0.125)
    assert torch.equal(whole[0], cut[0]) and torch.equal(whole[1], cut[1])


def test_a_row_without_keys_weighs_nothing():
    """ivf: the one list a row probes is empty (and there is no sink)."""
    q, key = torch.randn(1, 2, 16), torch.randn(1, 8, 16)
    centroids = torch.stack([q[0, 0] + q[0, 1], -(q[0, 0] + q[0, 1])])[None] * 100
    lists = (centroids, torch.tensor([[0, 0, 8]]), 1)  # list 0 (the nearest) holds no key
    out, lse = topk_attend(q, [(0, key)], [(0, key)], 3, 0, 0.25, torch.arange(8)[None],
                           lists)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_the_sink_alone_is_exact_attention_over_it():
    """Every row of the shard in the sink: nothing to pick, every row attends to them all."""
    torch.manual_seed(4)
    q, key, value = torch.randn(2, 3, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    out, lse = topk_attend(q, [(0, key)], [(0, value)], 3, 8, 0.25)
    want_out, want_lse = attend(q[None], key[None], value[None], 0.25)
    torch.testing.assert_close(out, want_out[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse[0], rtol=0, atol=1e-5)


def _with_own_keys(kind, dtype, seed):
    """A top-k call with the query host's own keys: folded rows q [2, 3 * 4, 64], a shard
    of 3,000 keys (ivf: laid out in 30 lists, 5 probed), and 9 + 4 own keys read from a
    longer buffer (Phase 2 grows them in place: heads apart by its capacity). Returns q,
    key, value, the buffer, own, and topk_attend's keys, key map and lists."""
    torch.manual_seed(seed)
    heads, groups, tokens, n, dim, before = 2, 3, 4, 3000, 64, 9
    q = torch.randn(heads, groups * tokens, dim)
    key, value = torch.randn(heads, n, dim).to(dtype), torch.randn(heads, n, dim).to(dtype)
    buffer = torch.randn(2, heads, 32, dim).to(dtype)
    own = tuple(x[:, :before + tokens] for x in buffer)
    keys, key_map, lists = [(0, key)], None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 30, 5)
        keys, lists = [(0, ordered)], (centroids, offsets, 5)
    return q, key, value, buffer, own, keys, key_map, lists


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_keys_are_attended_causally_under_the_same_softmax(kind, dtype):
    """The query host's own keys in the same call: equal (within fp32 error against
    float64) to the top-k part merged with exact causal attention over the own keys; and a
    position alone (a one-token step, its own keys cut after it) gets the same bits as among
    the forward's others (drafted tokens)."""
    from starqa.attention import merge, partial_rows

    heads, groups, tokens, dim, k, before = 2, 3, 4, 64, 40, 9
    q, key, value, buffer, own, keys, key_map, lists = _with_own_keys(kind, dtype, 11)
    out, lse = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists, tokens,
                           own=own)
    part = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists, tokens)
    mine = partial_rows(q, own[0], own[1], 0.125, tokens)
    want_out, want_lse = merge(torch.stack([part[0], mine[0]]), torch.stack([part[1], mine[1]]))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    out, lse = out.view(heads, groups, tokens, dim), lse.view(heads, groups, tokens)
    by_token = q.view(heads, groups, tokens, dim)
    for m in range(tokens):
        cut = tuple(x[:, :before + m + 1] for x in buffer)
        one, one_lse = topk_attend(by_token[:, :, m].contiguous(), keys, [(0, value)], k,
                                   3, 0.125, key_map, lists, 1, own=cut)
        assert torch.equal(one, out[:, :, m]) and torch.equal(one_lse, lse[:, :, m])


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_weighs_the_shard_keys_and_not_the_own_keys(kind, dtype):
    """A bias b (Phase 2's context bias) in the call: its unbiased shard part with lse + b
    merged with exact causal attention over the own keys, within fp32 rounding; with every
    key picked (k >= N), the fp64 softmax over [scale q.K + b | scale q.K_own, causal]."""
    from starqa.attention import merge, partial_rows

    from test_attention import biased_reference

    tokens, n, bias = 4, 3000, math.log(0.3)
    q, key, value, _, own, keys, key_map, lists = _with_own_keys(kind, dtype, 12)
    for k in (40, n):
        out, lse = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists, tokens,
                               own=own, bias=bias)
        part = topk_attend(q, keys, [(0, value)], k, 3, 0.125, key_map, lists, tokens)
        mine = partial_rows(q, own[0], own[1], 0.125, tokens)
        want, want_lse = merge(torch.stack([part[0], mine[0]]),
                               torch.stack([part[1] + bias, mine[1]]))
        assert (out - want).abs().max() <= 1e-5 * want.abs().max()
        assert (lse - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()
    if kind == "flat":  # k = N: every key, exact; the first `unbiased` rows without the
        # bias (cut inside the sink's 3 rows, among the picks, past every key)
        for unbiased in (0, 2, 700, n + 5):
            out, lse = topk_attend(q, keys, [(0, value)], n, 3, 0.125, key_map, lists, tokens,
                                   own=own, bias=bias, unbiased=unbiased)
            want, want_lse = biased_reference(q, [(key, value)], own, 0.125, tokens, bias,
                                              unbiased)
            assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()
            assert (lse.double() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()


def test_own_keys_of_another_layout_are_refused():
    q, key = torch.randn(2, 2, 16), torch.randn(2, 40, 16)
    own = torch.randn(2, 16, 5)  # D not last
    with pytest.raises(ValueError, match="own keys"):
        topk_attend(q, [(0, key)], [(0, key)], 3, 0, 0.25, own=(own.transpose(1, 2),) * 2)


def test_impossible_arguments_are_refused():
    q, key = torch.randn(1, 2, 16), torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="top-k kernel"):
        topk_attend(q, [(0, key)], [(0, key)], 0, 0, 0.25)
    with pytest.raises(ValueError, match="top-k kernel"):  # unbiased rows below none
        topk_attend(q, [(0, key)], [(0, key)], 2, 0, 0.25, bias=-1.0, unbiased=-1)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("bias,unbiased", [(0.0, 0), (math.log(0.3), 0), (math.log(0.3), 2),
                                           (math.log(0.3), 700)])
def test_without_the_kernel_the_same_keys_are_attended(kind, bias, unbiased, monkeypatch):
    """A machine where the kernel was not built (no C compiler) takes torch's and numpy's
    code: it must select each row's keys the same way (ivf: the row's own lists only) and
    share them the same way across a position's query heads, so answers do not depend on
    whether a compiler was found; a context bias weighs the same keys (the sink's, the
    picks', ivf's tail; not the first `unbiased` rows, cut inside the sink or among the
    picks; not the own keys). fp32 keys: no bf16 near-ties."""
    from starqa.topk import retrieval
    from starqa.attention import merge
    from starqa.topk.indexes import TopK

    torch.manual_seed(5)
    blocks = [(torch.randn(2, 2, t, 32), torch.randn(2, 2, t, 32)) for t in (1500, 900)]
    shard = retrieval.from_parts(blocks, TopK(count=60, index=kind, sink=4), 2400)
    q = torch.randn(1, 2, 12, 32)  # 3 query heads per KV head at 4 positions
    own = tuple(torch.randn(1, 2, 10, 32) for _ in range(2))  # 6 tokens before these 4

    def merged(parts):
        return merge(torch.cat(parts[0]), torch.cat(parts[1]))

    with_kernel = merged(shard.parts(1, q, 32 ** -0.5, 4, own, bias=bias, unbiased=unbiased))
    monkeypatch.setattr(native, "available", lambda: False)
    without = merged(shard.parts(1, q, 32 ** -0.5, 4, own, bias=bias, unbiased=unbiased))
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_a_table_kept_across_calls_gives_what_a_fresh_one_gives(kind):
    """`native.TopKTable` lays a layer's arguments out once (a shard keeps one per layer):
    calls with other queries, k and token counts through the same table equal fresh ones."""
    torch.manual_seed(9)
    heads, n, dim = 2, 2000, 64
    key, value = torch.randn(heads, n, dim).bfloat16(), torch.randn(heads, n, dim).bfloat16()
    keys, key_map, lists = [(0, key)], None, None
    if kind == "ivf":
        ordered, key_map, centroids, offsets = ivf_layout(key, 20, 4)
        keys, lists = [(0, ordered)], (centroids, offsets, 4)
    table = native.TopKTable(keys, [(0, value)], key_map, lists)
    for rows, tokens, k in ((3, 1, 30), (12, 4, 30), (3, None, 7)):
        q = torch.randn(heads, rows, dim)
        kept = table.attend(q, k, 2, 0.125, tokens)
        fresh = topk_attend(q, keys, [(0, value)], k, 2, 0.125, key_map, lists, tokens)
        assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1])


def _resident(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages resident in this process (/proc/self/smaps, by mapping)."""
    lo, hi, total, overlap = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, stop = (int(x, 16) for x in head.split("-"))
            overlap = start < hi and lo < stop
        elif overlap and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc")
def test_mapped_keys_dropped_as_scanned_give_the_same_bits(tmp_path):
    """flat's --kv-on-disk: the kernel drops the mapped keys' pages as its scan passes them,
    each row's scores kept for the union's attention (which reads no key): the same bits as
    with the pages kept, and the layer's keys are not left resident (a few pages at the
    ends of each scanned piece, not the layer's 32 MiB)."""
    from starqa.core import tensorfile
    from starqa.cache.shards import save_block

    torch.manual_seed(6)
    heads, n, dim = 2, 1 << 17, 64  # 32 MiB a layer of keys in bf16
    path = save_block(tmp_path, 0, torch.randn(1, heads, n, dim).bfloat16(),
                      torch.randn(1, heads, n, dim).bfloat16(), range(n), {"index": "0"})
    keys, values = (tensorfile.MappedTensor(path, x) for x in ("k", "v"))
    q = torch.randn(heads, 6, dim)  # 3 query heads per KV head at 2 positions
    own = tuple(torch.randn(heads, 5, dim).bfloat16() for _ in range(2))  # 3 before these 2

    def attend(drop: int) -> tuple:
        keys.release(0), values.release(0)
        table = native.TopKTable([(0, keys.tensor[0])], [(0, values.tensor[0])], drop=drop)
        out, lse = table.attend(q, 400, 16, 0.125, 2, own)
        return out, lse, _resident(keys.tensor[0])

    out, lse, resident = attend(native.DROP_KEYS)
    kept_out, kept_lse, kept_resident = attend(0)
    assert torch.equal(out, kept_out) and torch.equal(lse, kept_lse)
    assert kept_resident > 28 << 20  # every key scanned, the layer mapped in
    assert resident < 2 << 20


def test_kept_scores_of_a_long_forward_are_not_held_after_it(tmp_path):
    """Kept scores (flat with its mapped keys dropped) are rows x keys floats: a decode's
    stay for the next call, a question's forward's (here 72 rows over 131,072 keys, 72 MiB)
    are freed when the call ends, not held for the process's life."""
    from starqa.core import tensorfile
    from starqa.cache.shards import save_block

    torch.manual_seed(7)
    heads, n, dim = 2, 1 << 17, 64
    path = save_block(tmp_path, 0, torch.randn(1, heads, n, dim).bfloat16(),
                      torch.randn(1, heads, n, dim).bfloat16(), range(n), {"index": "0"})
    keys, values = (tensorfile.MappedTensor(path, x) for x in ("k", "v"))
    table = native.TopKTable([(0, keys.tensor[0])], [(0, values.tensor[0])],
                             drop=native.DROP_KEYS)
    q = torch.randn(heads, 72, dim)  # 3 query heads per KV head at 24 positions
    table.attend(q[:, :3], 400, 16, 0.125, 1)  # a decode's call: its scratch made
    keys.release(0), values.release(0)
    before = rss()
    out, _ = table.attend(q, 400, 16, 0.125, 24)
    keys.release(0), values.release(0)
    assert torch.isfinite(out).all()
    assert rss() - before < 24 << 20  # the 72 MiB of kept scores returned


def test_an_unknown_simd_cap_is_refused(monkeypatch):
    from starqa.native import kernels
    from starqa.core.errors import StarqaError

    monkeypatch.setenv("STARQA_SIMD", "avx3")
    kernels.library.cache_clear()
    try:
        with pytest.raises(StarqaError,
                           match="STARQA_SIMD='avx3' is not one of avx512, avx2, none"):
            kernels.library()
    finally:
        monkeypatch.delenv("STARQA_SIMD")
        kernels.library.cache_clear()


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_select_gives_each_rows_k_best_of_its_lists_without_attending(kind):
    """`TopKTable.select` (a GPU's ranking, done on the host where ivf's lists are): each
    row's k best keys among its own lists (flat: every key, in two buffers as on disk),
    never a sink row, with their raw inner products; -1 and -inf past the keys there are.
    A table without values only selects."""
    torch.manual_seed(11)
    heads, rows, n, dim, skip = 2, 4, 600, 32, 5
    key = torch.randn(heads, n, dim)  # fp32: no near-ties
    q = torch.randn(heads, rows, dim)
    if kind == "ivf":
        ordered, order, centroids, offsets = ivf_layout(key, 12, 3)
        table = native.TopKTable([(0, ordered)], None, order, (centroids, offsets, 3))
        allowed = allowed_by_lists(q, order, centroids, offsets, 3)
    else:
        table = native.TopKTable([(0, key[:, :250].contiguous()),
                                  (250, key[:, 250:].contiguous())], None)
        allowed = torch.ones(heads, rows, n, dtype=torch.bool)
    allowed[..., :skip] = False
    full = torch.einsum("hrd,hnd->hrn", q, key)
    ranked = full.masked_fill(~allowed, float("-inf"))
    for k in (7, n):
        scores, picked = table.select(q, k, skip)
        assert scores.shape == picked.shape == (heads, rows, k)
        for h in range(heads):
            for r in range(rows):
                take = min(k, int(allowed[h, r].sum()))
                mine, found = picked[h, r], picked[h, r][picked[h, r] >= 0]
                assert sorted(found.tolist()) == sorted(ranked[h, r].topk(take).indices.tolist())
                torch.testing.assert_close(scores[h, r][mine >= 0], full[h, r, found])
                assert torch.isneginf(scores[h, r][mine < 0]).all() and len(found) == take
    with pytest.raises(ValueError, match="only selects"):
        table.attend(q, 7, skip, dim ** -0.5)
