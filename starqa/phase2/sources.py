"""Source attribution: the attention mass shard keys received, traced to files and lines.

Phase 2 gives, per worker, the attention each of its cached keys got from the answer's
rows that emitted that key's own token (`decode.ShardAttention.key_mass`: where the answer
copied from), as a fraction of those rows' attention. The manifest maps token positions to
files (token spans) and lines (the token where each line starts), so each worker turns its
vector into per-line mass; the query host adds them up and ranks.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence

import torch

from starqa.cache.manifest import SourceFile


def line_mass(files: Sequence[SourceFile], token_start: int,
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
