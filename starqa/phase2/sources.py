"""Source attribution: the attention mass shard keys received, traced to files and lines.

Phase 2 keeps, per worker, the query rows that picked the answer's tokens (`AnswerRows`,
filled by `starqa.phase2.shard_attention.ShardAttention` while it tracks) and gives after
the answer the attention each of its cached keys got from the rows that emitted that key's
own token (`key_mass`: where the answer copied from), as a fraction of those rows'
attention. The manifest maps token positions to files (token spans) and lines (the token
where each line starts), so each worker turns its vector into per-line mass; the query host
adds them up and ranks.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence

import torch

from starqa.attention.copymass import matched_mass
from starqa.cache.manifest import PackedFile
from starqa.phase2.shard_view import ShardView

# key_mass holds every layer's keys (fp32) of this much of its candidates at a time: below
# glibc's largest mmap threshold (32 MB), so each piece reuses the last one's heap memory
# instead of faulting in fresh pages (first attribution at 32K: 30 → 18 ms; 4 MB: 19).
MASS_BYTES = 8 << 20


class AnswerRows:
    """The query rows that picked the answer's tokens, one forward at a time: each forward's
    folded rows [L, Hkv, G, P, D] that picked a token and their global LSE [L, Hkv, G, P]
    (after the merge across workers), kept as views (no kernels) for `key_mass`."""

    def __init__(self, layers: int):
        self.layers = layers
        self.scale = 1.0  # the softmax scale the rows were attended with
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the running forward's rows [Hkv, G, M(, D)]: per layer (`keep_layer`), or of every
        # layer at once (`keep_forward`)
        self._last: list | tuple | None = None

    def clear(self) -> None:
        """A new answer: forget the last one's rows."""
        self._rows, self._last = [], None

    def keep_layer(self, layer: int, q: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        """Keep a layer's rows of the running forward, q [Hkv, G, M, D] and lse [Hkv, G, M],
        rows (g, m) with m fastest (`advance` stacks them)."""
        self.scale = scale
        if not isinstance(self._last, list):
            self._last = [None] * self.layers
        self._last[layer] = (q, lse)

    def keep_forward(self, q: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        """Keep every layer's rows of the running forward at once, q [L, Hkv, G, M, D] and
        lse [L, Hkv, G, M] (the compiled step writes them)."""
        self.scale = scale
        self._last = (q, lse)

    def advance(self, picked: slice, keep: bool = True) -> None:
        """The running forward is done: its rows `picked` each picked a token of the answer,
        in order; kept if `keep`."""
        if keep and self._last is not None:
            q, lse = self._last if isinstance(self._last, tuple) else (
                torch.stack([q for q, _ in self._last]), torch.stack([x for _, x in self._last]))
            self._rows.append((q[:, :, :, picked], lse[:, :, :, picked]))
        self._last = None

    def count(self) -> int:
        """The rows kept: one per token of the answer so far."""
        return sum(q.shape[3] for q, _ in self._rows)

    def stacked(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `steps` rows kept, fp32: queries [L, Hkv, G, S, D], lses [L, Hkv, G, S]."""
        queries = torch.cat([q.float() for q, _ in self._rows], dim=3)[:, :, :, :steps]
        lses = torch.cat([lse.float() for _, lse in self._rows], dim=3)[:, :, :, :steps]
        return queries, lses


def key_mass(view: ShardView, ids: torch.Tensor | None, rows: AnswerRows,
             tokens: Sequence[int]) -> torch.Tensor:
    """[N_h] float64: the attention each shard key received from the answer's rows that
    emitted its own token, as a fraction of all their attention. ids: the shard's token
    ids [N_h] (None: no attribution); `tokens`: the answer, one token per kept row.

    Row s picked tokens[s]; it counts only on keys holding that same token id, averaged
    over the answer's tokens, the layers and the query heads: where the answer copied
    its words from. Summed over every worker's keys it is the share of the answer's
    attention that went to copying from the documents (`top_sources` uses it to tell a
    sourced answer from one the model made up or knew). Why this rule: on `starqa eval`'s
    look-alike files (the needle in one of several files of the same kind) it put the
    needle's file first on every correctly answered sample, while the raw mass of every
    key (what this replaced) almost never did. Raw mass rewards what attention attends to
    out of habit whatever it emits (the end of the context, file headers, attention
    sinks); weighting it by value norms, subtracting a baseline (the mass from a neutral
    question, or the answer's mean) or keeping only the sharpest heads or the later layers
    all did worse than matching tokens (measured side by side on `eval`'s qa task). It
    costs one dot product per (row, matching key), after the answer, in one batched
    matmul per distinct token (`attention.copymass.matched_mass`): no pass over the keys
    while decoding. The head (`ShardView.head`) gets nothing; the keys the context bias
    weighed (`ShardView.bias`, not the first `unbiased`) weigh e^bias here too."""
    mass = torch.zeros(view.n_keys, dtype=torch.float64)
    steps = min(len(tokens), rows.count())
    if ids is None or not steps:
        return mass
    emitted = torch.as_tensor(list(tokens[:steps]), dtype=ids.dtype)
    ids = ids[view.head:]
    # the candidate keys (offset by the head): those whose token the answer emitted at all
    where = torch.isin(ids, emitted).nonzero().flatten()
    if not where.numel():
        return mass
    where = where[torch.argsort(ids[where], stable=True)]  # the candidates, token by token
    queries, lses = rows.stacked(steps)
    layers, kv_heads, groups, _, dim = queries.shape
    queries = queries.mul_(rows.scale).view(layers * kv_heads, groups, steps, dim)
    lses = lses.view(layers * kv_heads, groups, steps)
    # candidates in pieces whose keys (every layer, fp32) take at most MASS_BYTES
    piece = max(1, MASS_BYTES // (layers * kv_heads * dim * 4))
    gathered = torch.empty(layers, kv_heads, min(piece, len(where)), dim,
                           device=queries.device)
    for start in range(0, len(where), piece):
        chosen = where[start:start + piece]
        # [L * Hkv, U, D] fp32, gathered into one buffer and read in place by the matmuls
        # as [L * Hkv, D, U]
        keys = gathered[:, :, :len(chosen)]
        view.gather_keys(chosen, keys)
        keys = keys.reshape(layers * kv_heads, -1, dim).transpose(1, 2)
        probs = matched_mass(queries, lses, keys, emitted, ids[chosen])
        mass.index_add_(0, chosen + view.head, probs.double())
    if view.bias:  # the rows' LSEs hold the bias; their scores of each key here do not
        mass[view.unbiased:] *= math.exp(view.bias)
    return mass / (steps * layers * kv_heads * groups)


def line_mass(files: Sequence[PackedFile], token_start: int,
              mass: torch.Tensor) -> dict[str, dict[int, float]]:
    """Mass per (file, 1-based line) for keys at positions token_start .. token_start+len(mass).
    Tokens of a document's header count towards its first line."""
    end = token_start + mass.numel()
    out: dict[str, dict[int, float]] = {}
    for f in files:
        a, b = max(f.token_start, token_start), min(f.token_end, end)
        if a >= b:
            continue
        starts = torch.tensor(f.line_tokens or [f.token_start])
        line = (torch.searchsorted(starts, torch.arange(a, b), right=True) - 1).clamp_(min=0)
        per_line = torch.zeros(len(starts), dtype=torch.float64).index_add_(
            0, line, mass[a - token_start:b - token_start].double())
        nonzero = per_line.nonzero().flatten().tolist()
        out[f.path] = {i + 1: float(per_line[i]) for i in nonzero}
    return out


def add(parts: list[dict[str, dict[int | str, float]]]) -> dict[str, dict[int, float]]:
    """Sum per-line mass over workers' parts. Lines may arrive as strings (parts gathered as
    JSON, see dist.gather_object); the sum has int lines."""
    total: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for part in parts:
        for path, lines in part.items():
            for line, m in lines.items():
                total[path][int(line)] += m
    return {p: dict(lines) for p, lines in total.items()}


# An answer that copied less than this share of its attention from the documents did not
# come from them (SmolLM2 and Qwen2.5-Coder: answers copied from a file copy 1.2-2% of
# their attention, answers from the model's own knowledge 0.2-0.4%; docs/results.md).
MIN_COPIED = 0.006  # STARQA_MIN_COPIED overrides it (tests on tiny random models: 0)
# Below this share for the top file, attribution is spread over many files: noise.
MIN_TOP_SHARE = 0.25


def top_sources(per_line: dict[str, dict[int, float]], k: int = 5,
                keep: float = 0.25) -> list[dict]:
    """The files the answer copied from, most first (at most `k`): each with its share of
    the attributed mass and the line range around its peak line (neighbouring lines with
    >= `keep` x the peak). A file is listed when its share is at least a third of the top
    file's (and 10%); none is when the answer copied too little from the documents
    (MIN_COPIED) or no file stands out (MIN_TOP_SHARE): an empty list, which the UI says."""
    totals = {path: sum(lines.values()) for path, lines in per_line.items()}
    copied = sum(totals.values())
    ranked = sorted(totals, key=totals.get, reverse=True)[:k]
    least_copied = float(os.environ.get("STARQA_MIN_COPIED", MIN_COPIED))
    if not ranked or copied < least_copied or totals[ranked[0]] / copied < MIN_TOP_SHARE:
        return []
    least = max(0.1, totals[ranked[0]] / copied / 3) * copied
    result = []
    for path in (p for p in ranked if totals[p] >= least):
        lines = per_line[path]
        peak = max(lines, key=lines.get)
        first = last = peak
        while lines.get(first - 1, 0.0) >= keep * lines[peak]:
            first -= 1
        while lines.get(last + 1, 0.0) >= keep * lines[peak]:
            last += 1
        result.append({"path": path, "share": totals[path] / copied, "lines": [first, last]})
    return result
