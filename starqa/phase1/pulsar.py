"""Pulsar Attention Phase 1: each block is encoded after the sink and the summaries of the
blocks before it, instead of Star's anchor (docs/methods.md §3).

The summaries are chosen from the token ids alone (an IDF table over the blocks, then the
top-scoring chunks of each block), so every worker computes the same layout with no
communication. All selection math runs on the CPU in int64 / float32 so it is bitwise
identical everywhere; only the forward runs on the model's device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from starqa.core.errors import StarqaError
from starqa.phase1.blockwise import Recorder, forward

HEURISTICS = ("max-idf", "tfidf", "bm25", "entropy", "even")
POSITIONS = ("sparse", "contiguous")
BM25_K1, BM25_B = 1.2, 0.75

Blocks = Sequence[tuple[int, int]]


def _check(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise StarqaError(f"Unknown Pulsar {what} {value!r}.",
                          hint=f"choose one of: {', '.join(choices)}")


# ---------------------------------------------------------------------------- IDF


def df_table(ids: torch.Tensor, blocks: Blocks, vocab_size: int) -> torch.Tensor:
    """Document frequency: df[t] = number of blocks containing token t. ids: [n] int64.
    Returns [vocab_size] int64."""
    present = torch.cat([torch.unique(ids[s:e].cpu()) for s, e in blocks])
    return torch.bincount(present, minlength=vocab_size)


def idf_table(ids: torch.Tensor, blocks: Blocks, vocab_size: int) -> torch.Tensor:
    """idf[t] = log(N_blocks / max(df[t], 1)); tokens in no block get log(N). Returns
    [vocab_size] float32."""
    df = df_table(ids, blocks, vocab_size).clamp(min=1).to(torch.float64)
    return torch.log(len(blocks) / df).to(torch.float32)


# ---------------------------------------------------------------------------- chunk scores


def chunk_scores(block_ids: torch.Tensor, idf: torch.Tensor, heuristic: str, chunk: int = 32,
                 df: torch.Tensor | None = None, n_blocks: int | None = None,
                 avg_len: float | None = None) -> torch.Tensor:
    """Score the non-overlapping chunks of `chunk` tokens of block_ids [n] (the last may be
    shorter). Returns [ceil(n / chunk)] float32; higher is kept first.

    max-idf: max idf in the chunk. tfidf: mean idf over its tokens. entropy: distinct tokens /
    length. bm25: sum over distinct t of idf_bm25(t)·tf·(k1+1) / (tf + k1·(1−b+b·len/avg_len)),
    idf_bm25 = log((N−df+0.5)/(df+0.5)+1); needs `df` [vocab] and `n_blocks`; avg_len defaults
    to this block's mean chunk length. even: no scoring (zeros).
    """
    _check(heuristic, HEURISTICS, "heuristic")
    block_ids = block_ids.cpu()
    n = len(block_ids)
    n_chunks = -(-n // chunk)
    which = torch.arange(n) // chunk  # [n] chunk index of each token
    lengths = torch.bincount(which, minlength=n_chunks).to(torch.float32)  # [n_chunks]
    if heuristic == "even" or n == 0:
        return torch.zeros(n_chunks)
    if heuristic == "max-idf":
        return torch.zeros(n_chunks).scatter_reduce(0, which, idf[block_ids], "amax",
                                                    include_self=False)
    if heuristic == "tfidf":
        return torch.zeros(n_chunks).index_add(0, which, idf[block_ids]) / lengths
    # distinct (chunk, token) pairs with their term frequency within the chunk
    pairs, tf = torch.unique(which * len(idf) + block_ids, return_counts=True)
    pair_chunk, pair_token = pairs // len(idf), pairs % len(idf)
    if heuristic == "entropy":
        return torch.bincount(pair_chunk, minlength=n_chunks).to(torch.float32) / lengths
    if df is None or n_blocks is None:
        raise ValueError("bm25 needs df and n_blocks")
    d = df[pair_token].to(torch.float64)
    idf_bm25 = torch.log((n_blocks - d + 0.5) / (d + 0.5) + 1)
    avg = float(lengths.mean()) if avg_len is None else avg_len
    norm = BM25_K1 * (1 - BM25_B + BM25_B * lengths.to(torch.float64)[pair_chunk] / avg)
    tf = tf.to(torch.float64)
    terms = idf_bm25 * tf * (BM25_K1 + 1) / (tf + norm)
    return torch.zeros(n_chunks, dtype=torch.float64).index_add(0, pair_chunk,
                                                                terms).to(torch.float32)


# ---------------------------------------------------------------------------- summaries


def summary_positions(block_start: int, block_ids: torch.Tensor, idf: torch.Tensor, heuristic: str,
                      budget_frac: float = 0.125, chunk: int = 32, skip: int = 0,
                      **bm25) -> torch.Tensor:
    """Global positions of the summary Σ_j of one block, ascending. Returns [≤ budget] int64.

    The first `skip` tokens (block 0's sink) are left out; the rest, of length m, gets a budget
    of floor(budget_frac·m) tokens: the best floor(budget/chunk) whole chunks (at least one
    while m > 0; ties go to the earlier chunk), or for `even` `budget` (at least one) tokens
    at offsets floor(j·m/budget). `bm25` passes df / n_blocks / avg_len to chunk_scores.
    """
    _check(heuristic, HEURISTICS, "heuristic")
    body = block_ids.cpu()[skip:]
    first, m = block_start + skip, len(body)
    if m == 0:
        return torch.zeros(0, dtype=torch.int64)
    budget = math.floor(budget_frac * m)
    if heuristic == "even":
        count = max(1, budget)
        return first + torch.arange(count) * m // count
    scores = chunk_scores(body, idf, heuristic, chunk, **bm25)
    k = min(len(scores), max(1, budget // chunk))
    best = torch.sort(scores, descending=True, stable=True).indices[:k].sort().values
    offsets = (best[:, None] * chunk + torch.arange(chunk)).flatten()  # [k·chunk]
    return first + offsets[offsets < m]


def all_summaries(ids: torch.Tensor, blocks: Blocks, vocab_size: int, *, sink: int = 64,
                  heuristic: str = "max-idf", budget_frac: float = 0.125,
                  chunk: int = 32) -> list[torch.Tensor]:
    """Σ_j for every block (global positions, ascending), from the token ids alone: the same
    on every worker. Block 0's first `sink` tokens are skipped (they are the sink)."""
    _check(heuristic, HEURISTICS, "heuristic")
    df = df_table(ids, blocks, vocab_size)
    idf = idf_table(ids, blocks, vocab_size)
    bm25 = {"df": df, "n_blocks": len(blocks)} if heuristic == "bm25" else {}
    return [summary_positions(s, ids[s:e], idf, heuristic, budget_frac, chunk,
                              skip=sink if j == 0 else 0, **bm25)
            for j, (s, e) in enumerate(blocks)]


# ---------------------------------------------------------------------------- layout


def _layout(blocks: Blocks, i: int, summaries: Sequence[torch.Tensor], sink: int) -> torch.Tensor:
    """Global positions of block i's input: [sink ‖ Σ_0 ‖ … ‖ Σ_{i−1} ‖ B_i] (block 0 alone)."""
    start, end = blocks[i]
    if i == 0:
        return torch.arange(start, end)
    sink_len = min(sink, blocks[0][1] - blocks[0][0])
    return torch.cat([torch.arange(sink_len), *summaries[:i], torch.arange(start, end)])


def assemble(ids: torch.Tensor, blocks: Blocks, i: int, summaries: Sequence[torch.Tensor], *,
             sink: int = 64, positions: str = "sparse") -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block i's Phase 1 input. Returns (input_ids [T] int64, position_ids [T] int64, keep):
    the last `keep` = len(B_i) tokens are the block, whose KV is stored.

    sparse: every token at its global position (gaps between pieces). contiguous: 0..T−1,
    so the query must start at `query_start(...)` rather than at the context length.
    """
    _check(positions, POSITIONS, "positions")
    where = _layout(blocks, i, summaries, sink)
    pos = where if positions == "sparse" else torch.arange(len(where))
    return ids.cpu()[where], pos, blocks[i][1] - blocks[i][0]


def max_assembled_length(blocks: Blocks, summaries: Sequence[torch.Tensor], sink: int = 64) -> int:
    """Longest assembled input over all blocks (tokens)."""
    return max(len(_layout(blocks, i, summaries, sink)) for i in range(len(blocks)))


def query_start(n_tokens: int, blocks: Blocks, summaries: Sequence[torch.Tensor], *,
                sink: int = 64, positions: str = "sparse") -> int:
    """First position of the query in Phase 2: the context length (sparse), or just after the
    longest assembled block (contiguous)."""
    _check(positions, POSITIONS, "positions")
    return n_tokens if positions == "sparse" else max_assembled_length(blocks, summaries, sink)


# ---------------------------------------------------------------------------- encode


@dataclass(frozen=True)
class PulsarSettings:
    """Pulsar's settings (docs/methods.md §3), as `starqa.methods.pulsar.DEFAULTS` names
    them: the sink's tokens, the chunk heuristic (HEURISTICS), each summary's share of its
    block, the tokens per scored chunk, and the positions (POSITIONS)."""

    sink: int = 64
    heuristic: str = "max-idf"
    budget_frac: float = 0.125
    chunk: int = 32
    positions: str = "sparse"


@torch.inference_mode()
def encode_pulsar(model, ids: torch.Tensor, blocks: Blocks, indices: Sequence[int],
                  settings: PulsarSettings = PulsarSettings(),
                  summaries: Sequence[torch.Tensor] | None = None
                  ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Pulsar Phase 1 for blocks `indices`; yields (index, k, v) with k, v [L, Hkv, len(B_i), D].

    The summaries (`all_summaries`, from `ids` [n]) are given, or computed once, up front;
    each block is then one causal forward over its assembled input, keeping only B_i's KV.
    """
    _check(settings.heuristic, HEURISTICS, "heuristic")
    _check(settings.positions, POSITIONS, "positions")
    device = next(model.parameters()).device
    if summaries is None:
        summaries = all_summaries(ids, blocks, model.config.vocab_size, sink=settings.sink,
                                  heuristic=settings.heuristic,
                                  budget_frac=settings.budget_frac, chunk=settings.chunk)
    for i in indices:
        tokens, pos, keep = assemble(ids, blocks, i, summaries, sink=settings.sink,
                                     positions=settings.positions)
        hook = Recorder(keep=keep)
        forward(model, tokens.to(device), pos.to(device), hook)
        yield (i, *hook.stacked())
