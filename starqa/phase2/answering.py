"""The one Phase 2 path: a worker's decoder, shard and attention, answering questions.

Every way of answering goes through `Answerer.answer`: a cold `ask` in the launcher's own
process (a world of one), each rank of a torchrun group (`starqa.workers.worker`), a warm group's
query host (`starqa.workers.server`), `starqa eval` and `starqa bench`. So a speed-up lands
everywhere, and eval and bench measure what users run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from starqa.runtime import dist
from starqa.core import gcpause
from starqa.phase2 import decode
from starqa.phase2 import sources
from starqa.topk.indexes import TopK
from starqa.cache.manifest import Manifest, SourceFile
from starqa.cache.shards import load_shard


class Answerer:
    """Decoder + this rank's shard of contiguous blocks (+ the files they cover and the
    shard's token ids, which source attribution needs; without them, no sources)."""

    def __init__(self, info: dist.DistInfo, decoder, shard, query_position: int,
                 files: Sequence[SourceFile] = (), token_start: int = 0,
                 blocks: Sequence[int] = (), ids: torch.Tensor | None = None,
                 retriever=None):
        self.info = info
        self.blocks = list(blocks)
        self.decoder = decoder
        self.query_position = query_position
        self.files = list(files)
        self.token_start = token_start
        # The keys before the first document are no source (see ShardAttention's `head`).
        first_doc = min((f.token_start for f in self.files), default=token_start)
        self.sources_seconds = 0.0
        # retriever: top-k attention over the blocks (starqa.topk.retrieval), shard then None.
        self.hook = decode.ShardAttention(info, shard, query_host=info.is_last,
                                          head=max(0, first_doc - token_start), ids=ids,
                                          retriever=retriever)

    @classmethod
    def from_cache(cls, manifest: Manifest, info: dist.DistInfo, model_path: Path,
                   weights: str = "dense", topk: TopK | None = None) -> Answerer:
        """Load the model and this rank's share of the context's blocks (checksums verified);
        with `topk`, for top-k attention (starqa.topk.retrieval) instead of exact."""
        from starqa.models.decoder import load_decoder

        # contiguous per machine, then per rank: what each machine keeps (starqa.cache.hosts)
        blocks = list(dist.split_by_host(len(manifest.blocks), info))
        dtype = getattr(torch, manifest.dtype)
        decoder = load_decoder(model_path, dtype, weights, info.device)
        shard, ids, retriever = None, None, None
        if topk is None:
            shard, ids = load_shard(manifest, blocks, device=info.device, dtype=dtype)
        else:
            from starqa.topk.retrieval import TopKShard

            from starqa.topk.listlayout import mean_queries

            retriever = TopKShard.from_cache(
                manifest, blocks, topk, dtype, info.device,
                lambda ids: mean_queries(decoder, ids, manifest.query_position))
            if retriever is not None:
                retriever.make_tables()
        start = manifest.blocks[blocks[0]].start if blocks else 0
        gcpause.settle()  # started: what is alive now lives as long as the process
        return cls(info, decoder, shard, manifest.query_position, manifest.files, start, blocks,
                   ids, retriever)

    def answer(self, query_ids: Sequence[int], max_new_tokens: int, stop_ids,
               on_token: Callable[[int], None] | None = None,
               should_stop: Callable[[], bool] | None = None, draft_tokens: int | None = None,
               prefilled=None) -> tuple[list[int], list[dict] | None]:
        """Generate on every rank; returns (tokens, top sources on the query host, else None;
        None under top-k attention, which never sees every key's attention). draft_tokens:
        per forward (decode.generate), default STARQA_DRAFT_TOKENS, else decode.DRAFT_TOKENS
        under exact attention and none under top-k: there each row selects its own keys, so
        a drafted row costs about what a token does (at 32K, flat: 27.4 ms a token without
        drafts, 32.3 with; exact: 30.6 without, 25.8 with). prefilled: the question's
        forward, run before torch was imported (starqa.coldstart.firsttoken; decode.generate says
        how it is taken)."""
        import time

        if draft_tokens is None:
            draft_tokens = decode.draft_tokens_setting(
                0 if self.hook.retriever is not None else decode.DRAFT_TOKENS)
        tokens = decode.generate(self.decoder, self.info, self.hook, query_ids,
                                 self.query_position, max_new_tokens, set(stop_ids),
                                 on_token, should_stop, context_ids=self.hook.ids,
                                 draft_tokens=draft_tokens, prefilled=prefilled)
        if self.hook.retriever is not None:  # top-k attention (every rank): no attribution
            return tokens, None
        started = time.perf_counter()
        mine = {}
        if self.hook.n_keys and self.files:
            mine = sources.line_mass(self.files, self.token_start, self.hook.key_mass(tokens))
        parts = dist.gather_object(self.info, mine, dst=self.info.world_size - 1)
        top = sources.top_sources(sources.add(parts)) if parts is not None else None
        self.sources_seconds = time.perf_counter() - started  # what attribution cost (bench)
        return tokens, top
