"""Copy mass: the attention a cached key gets from the answer's rows that emitted the key's
own token (Phase 2's source attribution, `starqa.phase2.sources.key_mass`).

Pure tensor functions, no I/O and no distributed code. Layout: the answer's S kept rows of
every layer and KV head as one batch B = L * Hkv, the G query heads of a KV head apart:

    queries: [B, G, S, D]   already multiplied by the softmax scale
    lses:    [B, G, S]      their *global* LSE (after the merge across workers)
    keys:    [B, D, U]      the U candidate keys (transposed, read in place by the GEMMs)

The mass of key u is sum over b, g and the rows s that emitted tokens_of[u] of
exp(q_bgs · k_bu - lse_bgs): its share of those rows' whole attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# (piece, the indices of the wanted keys it holds, their rows in it): see `gather_rows`
GatherPlan = Sequence[tuple[int, torch.Tensor, torch.Tensor]]


def matched_mass(queries: torch.Tensor, lses: torch.Tensor, keys: torch.Tensor,
                 emitted: torch.Tensor, tokens_of: torch.Tensor) -> torch.Tensor:
    """[U] fp32 on the CPU: each candidate key's copy mass (the module docstring's sum).
    emitted [S]: the token each row emitted; tokens_of [U]: each key's token, sorted so a
    token's keys are consecutive.

    The rows that emitted one token all match the same keys: each token is one batched
    matmul of its rows against its keys, every layer at once (gathering a query per pair
    made a tensor of pairs x heads x D: at 32K tokens of context attribution took as long
    as decoding; a matmul per token and layer spent 13% of decode on op overhead at 8K)."""
    batch, dim = queries.shape[0], queries.shape[-1]
    device = queries.device  # the shard's and the rows' (CUDA: the GPU)
    probs = torch.empty(keys.shape[2])
    runs = torch.unique_consecutive(tokens_of, return_counts=True)
    first = 0
    for token, count in zip(*(t.tolist() for t in runs)):
        emitters = (emitted == token).nonzero().flatten().to(device)
        q = queries[:, :, emitters].reshape(batch, -1, dim)
        lse = lses[:, :, emitters].reshape(batch, -1, 1)
        # [B, G * S_t, U_t]: the token's rows against its keys, every layer
        scores = torch.baddbmm(-lse, q, keys[:, :, first:first + count])
        probs[first:first + count] = scores.exp_().sum(dim=(0, 1)).cpu()
        first += count
    return probs


def gather_rows(plan: GatherPlan, source: Callable[[int], torch.Tensor], out: torch.Tensor,
                dim: int) -> None:
    """Write the rows `plan` locates into `out`: for each (piece, indices, rows), rows `rows`
    of `source(piece)` along `dim` go to `indices` of `out` along `dim`."""
    for index, mine, rows in plan:
        keys = source(index)
        keys = keys.index_select(dim, rows.to(keys.device))
        if len(plan) == 1:
            out.copy_(keys)
        else:
            out.index_copy_(dim, mine.to(out.device), keys.to(out.device, out.dtype))
