"""One method's Phase 1 of one `starqa eval` sample, kept in memory: what every Phase 2
variant of the sample answers over (runner.Evaluator.answer), however it was encoded
(runner.Evaluator.encode, or edit.encode_both's re-ingests)."""

from __future__ import annotations

from dataclasses import dataclass

from starqa.methods import MethodConfig


@dataclass
class Encoded:
    config: MethodConfig
    blocks: int
    parts: list  # per block (k, v), each [L, Hkv, T, D]
    query_position: int
    seconds: float
