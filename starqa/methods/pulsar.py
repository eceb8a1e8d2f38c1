"""Pulsar Attention's registry entry (the math: starqa.phase1.pulsar; docs/methods.md §3).

The summaries depend on the token ids alone, so the launcher computes them once (`prepare`)
and hands them to every worker in the job; it needs them itself for `query_position` when
positions are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

from starqa.core.errors import StarqaError
from starqa.methods.base import Blocks, Encoded, Method
from starqa.core.blocks import digest
from starqa.methods.config import MethodConfig, chosen

DEFAULTS = {"sink": 64, "heuristic": "max-idf", "budget_frac": 0.125, "chunk": 32,
            "positions": "sparse"}
# Heuristics whose chunk scores read the IDF (or df) table of the whole context
# (pulsar.chunk_scores); entropy and even look at the block's own tokens only.
CONTEXT_WIDE = ("max-idf", "tfidf", "bm25")


class Pulsar(Method):
    """Block 0 alone; block i > 0 as [sink ‖ Σ_0 ‖ … ‖ Σ_{i−1} ‖ B_i]; no communication."""

    name = "pulsar"
    help = "each block after a sink and the earlier blocks' summaries (Pulsar Attention)"
    settings = tuple(DEFAULTS)
    reuse = "block"  # block i's KV reads its assembled input only (block_inputs)

    def config(self, block_size: int, anchor_size: int | None, params: dict) -> MethodConfig:
        from starqa.phase1.pulsar import HEURISTICS, POSITIONS

        p = chosen(DEFAULTS, params)
        if p["heuristic"] not in HEURISTICS:
            raise StarqaError(f"Unknown --heuristic {p['heuristic']!r}.",
                              hint=f"choose one of: {', '.join(HEURISTICS)}")
        if p["positions"] not in POSITIONS:
            raise StarqaError(f"Unknown --positions {p['positions']!r}.",
                              hint=f"choose one of: {', '.join(POSITIONS)}")
        if not 0 < p["budget_frac"] <= 1:
            raise StarqaError(f"--summary-budget must be in (0, 1] (got {p['budget_frac']}).")
        if p["chunk"] < 1 or p["sink"] < 0:
            raise StarqaError("--chunk-size must be at least 1 and --sink-size at least 0.")
        return MethodConfig(self.name, block_size, 0, p)

    def prepare(self, ids: Sequence[int], config: MethodConfig, blocks: Blocks) -> dict:
        """{"summaries": Σ_j for every block, as lists of global positions}."""
        return {"summaries": [s.tolist() for s in _summaries(ids, config, blocks)]}

    def query_position(self, ids, config, blocks, prepared=None) -> int:
        """After the context (sparse), or after the longest assembled block (contiguous)."""
        if config.params["positions"] != "contiguous":
            return len(ids)
        from starqa.phase1.pulsar import query_start

        return query_start(len(ids), blocks, _tensors(prepared, ids, config, blocks),
                           sink=config.params["sink"], positions="contiguous")

    def shared_from(self, config: MethodConfig) -> int:
        """The sink's positions hold its keys alone; the assembled blocks share the rest."""
        return config.params.get("sink", 0)

    def query_bounds(self, config, n_tokens, blocks) -> tuple[int, int]:
        """Contiguous positions: the longest assembled block, which holds at least its own
        tokens and at most the context's (sink and summaries are other blocks' tokens)."""
        if config.params.get("positions") != "contiguous":
            return n_tokens, n_tokens
        return max((end - start for start, end in blocks), default=0), n_tokens

    def encode(self, model, ids, config, blocks, indices, info, prepared=None) -> Encoded:
        from starqa.phase1.pulsar import PulsarSettings, encode_pulsar

        summaries = _tensors(prepared, ids, config, blocks) if prepared else None
        return encode_pulsar(model, ids, blocks, indices, PulsarSettings(**config.params),
                             summaries)

    def block_inputs(self, ids, config, blocks, index, prepared=None) -> dict:
        """Block i's assembled input [sink ‖ Σ_0 ‖ … ‖ Σ_{i−1} ‖ B_i]: its token ids and their
        positions. An edit that leaves the earlier blocks' summaries as they were (the IDF
        moved, but not enough to pick other chunks) leaves it unchanged: it is reused."""
        import torch

        from starqa.phase1.pulsar import assemble

        p = config.params
        tokens, positions, keep = assemble(torch.as_tensor(ids, dtype=torch.long), blocks, index,
                                           _tensors(prepared, ids, config, blocks),
                                           sink=p["sink"], positions=p["positions"])
        return {"ids": digest(tokens.tolist()), "positions": digest(positions.tolist()),
                "keep": keep}

    def invalidated(self, config: MethodConfig, blocks: Blocks, edited: int) -> list[int]:
        """Not Star's rule: block i's input holds the summaries of every block before it, so
        a new Σ_edited reaches every later block; and with a context-wide heuristic
        (max-idf, tfidf, bm25) the edit changes the IDF table, so any block's summary may
        change: every block but block 0 (encoded alone) goes, and `edited` itself. Editing
        block 0 changes the sink too: every block. With contiguous positions the query
        position may move as well (summaries of a different length)."""
        if config.params["heuristic"] in CONTEXT_WIDE:
            return sorted({edited, *range(1, len(blocks))})
        return list(range(edited, len(blocks)))


def _summaries(ids, config: MethodConfig, blocks: Blocks) -> list:
    import torch

    from starqa.phase1.pulsar import all_summaries

    p = config.params
    tensor = torch.as_tensor(ids, dtype=torch.long)
    # Only ids present matter to the IDF, so the table may stop at the largest one.
    vocab = int(tensor.max()) + 1 if len(tensor) else 1
    return all_summaries(tensor, blocks, vocab, sink=p["sink"], heuristic=p["heuristic"],
                         budget_frac=p["budget_frac"], chunk=p["chunk"])


def _tensors(prepared: dict | None, ids, config: MethodConfig, blocks: Blocks) -> list:
    """Σ_j as int64 tensors: from `prepare`'s result, else computed here."""
    if not prepared:
        return _summaries(ids, config, blocks)
    import torch

    return [torch.tensor(s, dtype=torch.long) for s in prepared["summaries"]]
