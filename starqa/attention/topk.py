"""Top-k attention math (METHODS.md section 6): each query row attends only to the k keys
of a shard with the largest inner product, and the result is a partial attention with its
LSE, so `attention.merge` composes it with the query host's own tokens and across workers.

Pure tensor functions, no I/O and no distributed code. Layout: Phase 2's folded query
(`attention.fold_gqa`) without its batch dimension,

    q: [Hkv, R, D]        R = G * M rows: the G query heads of KV head h at M positions
    key, value: [Hkv, N, D]   one layer of one shard

GQA: the query heads of one KV head *share* retrieval. Every row (one query head at one
position) retrieves its own k keys from its KV head's keys (one index per KV head; a KV
head's R rows go to it as one batched search), and then each of the G rows of a position
attends over the union of the G rows' keys (`share`: up to G * k keys, each scored with
the row's own query). Heads of a group that look for different things each find theirs,
and what one head retrieved is seldom useless to the others: the union costs G dot
products per key already chosen, and no search. Only rows of the same position share, so
a row never depends on the forward's other positions (drafted tokens). k >= N gives every
row every key (exact).

A selection is, per row, k candidates:

    scores: [Hkv, R, k] fp32   the raw inner products q . key (unscaled), exact in fp32
    idx:    [Hkv, R, k] int64  the keys' rows in the shard; -1 where a search found fewer
                               than k keys (its score is then -inf)

and `attend_selected` turns one, with the selected value rows, into

    out: [1, Hkv, R, D] fp32       lse: [1, Hkv, R] fp32 (natural log, scores * scale)

the batch-of-one part layout of `attention.partial_chunks`. With k >= N the part equals
exact partial attention over the shard (`attention.attend`) up to fp32 rounding.

The tail (ivf, `TopK.tail` "lists"; beyond the paper). Top-k alone gives the keys a row
leaves out no weight, so its softmax spreads their mass over the keys it kept: at k = 1%
on SmolLM2 that bias, layer after layer, turned some of exact attention's answers into a
distractor's (docs/topk.md, "ivf's tail"). ivf already scores every list's centre (its mean key)
for every row; the tail lets each list's keys outside the row's union count as that many
copies of the centre, holding the list's mean value:

    w_c = u_c * exp(q . centre_c * scale)       u_c: list c's keys outside the union
    out = sum_c w_c * mean_value_c / sum_c w_c,  lse = log sum_c w_c

one more part for `attention.merge` (`tail_part`). Every key is counted once: in the union
exactly, or in its list's estimate. With every key in the union (k >= N) the tail is empty
and the result exact. (exp(q . mean) underestimates a list's mean exp(q . key): the
estimate leans toward the keys attended exactly.)
"""

from __future__ import annotations

import math

import torch

NUMPY_ROWS = 64  # select_exact ranks up to this many rows (Hkv * R) with numpy on CPU


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [Hkv, N, D], idx [Hkv, R, k] (rows of x; -1 reads row 0) → [Hkv, R, k, D]."""
    heads, n, dim = x.shape
    rows = idx.to(x.device).clamp(min=0) + (torch.arange(heads, device=x.device) * n)[:, None, None]
    # one index_select of whole rows: several times faster than advanced indexing on CPU
    return x.reshape(heads * n, dim).index_select(0, rows.view(-1)).view(*idx.shape, dim)


def select_exact(q: torch.Tensor, key: torch.Tensor, k: int, skip: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top-k keys of every row among rows [skip, N): q [Hkv, R, D] against key
    [Hkv, N, D].

    The ranking is one matmul in the keys' dtype and a topk; the selected keys' scores are
    then recomputed in fp32 from the rows themselves, so the attention over them is as
    exact as `attention.attend`'s (a bf16 ranking may swap two near-equal keys at the
    k-th place, never when k >= N - skip). Returns (scores [Hkv, R, min(k, N - skip)]
    fp32, idx)."""
    n = key.shape[1]
    if k >= n - skip:  # every key: no ranking needed
        idx = torch.arange(skip, n, device=key.device).expand(q.shape[0], q.shape[1], n - skip)
    else:
        coarse = torch.matmul(q.to(key.dtype), key.transpose(1, 2))  # [Hkv, R, N]
        coarse[..., :skip] = -math.inf  # never picked: k < N - skip keys are left
        if coarse.device.type == "cpu" and q.shape[0] * q.shape[1] <= NUMPY_ROWS:
            # a decode step: numpy's argpartition is ~3x torch.topk's speed (a prefill of
            # many rows keeps torch.topk: argpartition's index array is [Hkv, R, N] int64)
            import numpy as np

            best = np.argpartition(coarse.float().numpy(), n - k, axis=-1)[..., n - k:]
            idx = torch.from_numpy(np.ascontiguousarray(best))
        else:
            idx = coarse.topk(k, dim=-1, sorted=False).indices
    picked = gather_rows(key, idx)  # [Hkv, R, k, D]
    scores = torch.einsum("hrd,hrkd->hrk", q.float(), picked.float())
    return scores, idx


def share(q: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, tokens: int, keys_of
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA sharing (module docstring) of a selection: q [Hkv, R = G * tokens, D] (the G
    rows of a position are `tokens` apart, `attention.fold_gqa`), scores, idx [Hkv, R, k]
    → scores, idx [Hkv, R, G * k]: each row's candidates become the union of its
    position's G rows' keys, scored exactly (fp32) with its own query; a key picked twice,
    or none (-1), is -1 with score -inf. keys_of(idx [Hkv, tokens, U]) gives the keys at
    those shard rows, [Hkv, tokens, U, D] (-1: any row). G = 1: unchanged."""
    heads, rows, k = idx.shape
    groups = rows // tokens
    if groups == 1:
        return scores, idx
    union = idx.view(heads, groups, tokens, k).transpose(1, 2).reshape(heads, tokens, -1)
    union = union.sort(dim=-1).values
    repeat = torch.zeros_like(union, dtype=torch.bool)
    repeat[..., 1:] = union[..., 1:] == union[..., :-1]
    union = union.masked_fill_(repeat, -1)  # [Hkv, tokens, U]
    found = torch.einsum("hgmd,hmud->hgmu", q.reshape(heads, groups, tokens, -1).float(),
                         keys_of(union).float())
    found = found.masked_fill_((union < 0).unsqueeze(1), -math.inf)
    width = union.shape[-1]
    return (found.reshape(heads, rows, width),
            union.unsqueeze(1).expand(heads, groups, tokens, width).reshape(heads, rows, width))


def top_candidates(scores: torch.Tensor, idx: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of C candidates per row (e.g. the top k of each of a worker's blocks,
    concatenated: the shard's top k is among them). scores, idx [Hkv, R, C]."""
    if scores.shape[-1] <= k:
        return scores, idx
    best = scores.topk(k, dim=-1, sorted=False)
    return best.values, idx.gather(-1, best.indices)


def attend_rows(scores, values, scale: float):
    """`attend_selected` in numpy for rows of candidates: scores [B, k] float32 (raw inner
    products, -inf: no key), values [B, k, D] float32. Returns (out [B, D], lse [B])
    float32; a row with no key gets out = 0, lse = -inf. numpy, not torch: for a decode
    step these are a few thousand numbers, where a torch call's overhead is most of its
    cost on a CPU."""
    import numpy as np

    top = np.maximum(scores.max(axis=1, keepdims=True, initial=-np.inf),
                     np.finfo(np.float32).min)  # [B, 1], finite
    weights = np.exp((scores - top) * np.float32(scale))  # [B, k], exactly 0 where -inf
    total = weights.sum(axis=1, keepdims=True)
    out = np.matmul(weights[:, None, :], values)[:, 0] / np.maximum(total, np.finfo(np.float32).tiny)
    with np.errstate(divide="ignore"):  # log(0) = -inf: a row with no key
        lse = top[:, 0] * np.float32(scale) + np.log(total[:, 0])
    return out, lse.astype(np.float32, copy=False)


def attend_selected(scores: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over each row's selected keys, in fp32, with its LSE.

    scores, idx [Hkv, R, k] (a selection, see the module docstring); values [Hkv, R, k, D]:
    the value rows of idx (any dtype; rows where idx is -1 are ignored). A row with no key
    gets out = 0 and lse = -inf (zero weight in `merge`). Returns (out [1, Hkv, R, D] fp32,
    lse [1, Hkv, R] fp32)."""
    logits = (scores.float() * scale).masked_fill_(idx.to(scores.device) < 0, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # [Hkv, R]
    # a row with no key: lse -inf, and exp(-inf - finite min) = 0 weights, no NaN
    probs = torch.exp_(logits.sub_(lse.clamp(min=torch.finfo(lse.dtype).min).unsqueeze(-1)))
    out = torch.matmul(probs.unsqueeze(-2), values.to(probs.device).float())  # [Hkv, R, 1, D]
    return out.squeeze(-2).unsqueeze(0), lse.unsqueeze(0)


def lists_left(idx: torch.Tensor, list_of: torch.Tensor, sizes: torch.Tensor,
               always: int = 0) -> torch.Tensor:
    """Each row's keys outside its selection, list by list: idx [Hkv, R, U] a selection's
    shard rows (-1: none; no row twice), list_of [Hkv, N] each shard row's list (any
    integer dtype), sizes
    [Hkv, C] each list's keys; rows [0, always) (the sink) count as selected by every row.
    Returns [Hkv, R, C] fp32."""
    heads, rows, _ = idx.shape
    lists = sizes.shape[1]
    taken = list_of.gather(1, idx.clamp(min=0).reshape(heads, -1)).view_as(idx).long()
    counts = torch.zeros(heads, rows, lists).scatter_add_(2, taken, (idx >= 0).float())
    if always:
        counts += torch.zeros(heads, lists).scatter_add_(
            1, list_of[:, :always].long(), torch.ones(heads, always))[:, None]
    return sizes[:, None].float() - counts


def tail_part(centre_scores: torch.Tensor, left: torch.Tensor, mean_values: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail (module docstring) as a part: centre_scores [Hkv, R, C] raw q . centre,
    left [Hkv, R, C] each list's keys outside the row's selection (`lists_left`),
    mean_values [Hkv, C, D] each list's mean value. Returns (out [1, Hkv, R, D], lse [1,
    Hkv, R]) fp32; a row with no key left out: 0 and -inf (no weight in `merge`)."""
    logits = centre_scores.float() * scale + left.float().log()  # log 0 = -inf: none left
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp_(logits.sub_(lse.clamp(min=torch.finfo(lse.dtype).min).unsqueeze(-1)))
    out = torch.matmul(probs, mean_values.float())
    return out.unsqueeze(0), lse.unsqueeze(0)


def layer_budgets(k: int, layers: int, schedule: str) -> list[int]:
    """Keys per query row in each layer for a budget of `k` per layer on average.

    uniform: k everywhere. linear: k grows with depth, k_l = k * 2(l + 1) / (L + 1), the
    same total L * k (deeper layers attend more diffusely; the paper's recommendation);
    at least 1 key per layer."""
    if schedule == "uniform":
        return [k] * layers
    if schedule == "linear":
        return [max(1, round(k * 2 * (layer + 1) / (layers + 1))) for layer in range(layers)]
    raise ValueError(f"unknown schedule {schedule!r}")
