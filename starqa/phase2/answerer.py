"""The one Phase 2 path: a worker's decoder, shard and attention, answering questions.

Every way of answering goes through `Answerer.answer`: a cold `ask` in the launcher's own
process (a world of one), each rank of a torchrun group (`starqa.workers.worker`), a warm group's
query host (`starqa.workers.server`), `starqa eval` and `starqa bench`. So a speed-up lands
everywhere, and eval and bench measure what users run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from starqa.runtime import dist
from starqa.core import gcpause
from starqa.phase2 import decode
from starqa.phase2 import sources
from starqa.phase2.shard_attention import ShardAttention
from starqa.phase2.shard_view import Shard
from starqa.topk.indexes import TopK
from starqa.cache.manifest import Manifest, PackedFile
from starqa.cache.shards import load_shard
from starqa.core.blocks import ContextBias

if TYPE_CHECKING:  # annotations only: top-k is loaded where it is asked for
    from starqa.topk.shard import TopKShard


@dataclass(frozen=True)
class RankShare:
    """This rank's share of a context, what its `Answerer` answers over: the shard of its
    contiguous blocks (`ShardView`'s layout; None for none, or under top-k attention) or
    top-k attention over them (`retriever`, starqa.topk.shard.TopKShard), the question's
    position, what source attribution needs (without them, no sources): the files the
    context covers, the position of the shard's first key and the shard's token ids; and the
    context keys' score bias."""

    shard: Shard | None
    query_position: int
    files: Sequence[PackedFile] = ()
    token_start: int = 0
    blocks: Sequence[int] = ()
    ids: torch.Tensor | None = None
    retriever: TopKShard | None = None
    # added to the context keys' scores: the shared positions' mass scaled where the blocks
    # share positions (`Manifest.context_bias`, docs/methods.md §2); none elsewhere
    context_bias: ContextBias = ContextBias()

    def head(self) -> int:
        """The shard's keys before the first document (template, system prompt): no
        source."""
        first_doc = min((f.token_start for f in self.files), default=self.token_start)
        return max(0, first_doc - self.token_start)


class Answerer:
    """Decoder + this rank's share of the context (`RankShare`), answering questions."""

    def __init__(self, info: dist.DistInfo, decoder, share: RankShare):
        self.info = info
        self.decoder = decoder
        self.share = share
        self.blocks = list(share.blocks)
        self.query_position = share.query_position
        self.sources_seconds = 0.0
        self.hook = ShardAttention(info, share.shard, query_host=info.is_last,
                                   head=share.head(), ids=share.ids, retriever=share.retriever,
                                   context_bias=share.context_bias.value,
                                   unbiased=share.context_bias.unbiased(share.token_start))

    @classmethod
    def from_cache(cls, manifest: Manifest, info: dist.DistInfo, model_path: Path,
                   weights: str = "dense", topk: TopK | None = None) -> Answerer:
        """Load the model and this rank's share of the context's blocks (checksums verified);
        with `topk`, for top-k attention (starqa.topk.retrieval) instead of exact."""
        from starqa.models.decoder_io import load_decoder

        # contiguous per machine, then per rank: what each machine keeps (starqa.cache.hosts)
        blocks = list(dist.split_by_host(len(manifest.blocks), info))
        dtype = getattr(torch, manifest.dtype)
        decoder = load_decoder(model_path, dtype, weights, info.device,
                               length=manifest.query_position)  # the RoPE's (models.rope)
        shard, ids, retriever = None, None, None
        if topk is None:
            shard, ids = load_shard(manifest, blocks, device=info.device, dtype=dtype)
        else:
            from starqa.topk import retrieval

            from starqa.topk.listlayout import mean_queries

            retriever = retrieval.from_cache(
                manifest, blocks, topk, dtype, info.device,
                lambda ids: mean_queries(decoder, ids, manifest.query_position))
            if retriever is not None:
                retriever.make_tables()
        start = manifest.blocks[blocks[0]].start if blocks else 0
        gcpause.settle()  # started: what is alive now lives as long as the process
        return cls(info, decoder, RankShare(shard, manifest.query_position, tuple(manifest.files),
                                            start, tuple(blocks), ids, retriever,
                                            manifest.context_bias))

    def request(self, query_ids: Sequence[int], max_new_tokens: int, stop_ids,
                draft_tokens: int | None = None, prefilled=None) -> decode.Request:
        """A question's `decode.Request` over this share. draft_tokens: per forward
        (decode.Batch), default STARQA_DRAFT_TOKENS, else decode.DRAFT_TOKENS under exact
        attention and none under top-k: there each row selects its own keys, so a drafted
        row costs about what a token does (at 32K, flat: 27.4 ms a token without drafts,
        32.3 with; exact: 30.6 without, 25.8 with). prefilled: the question's forward, run
        before torch was imported (starqa.coldstart.firsttoken; decode.Batch says how it
        is taken)."""
        if draft_tokens is None:
            draft_tokens = decode.draft_tokens_setting(
                0 if self.hook.retriever is not None else decode.DRAFT_TOKENS)
        return decode.Request(tuple(query_ids), self.query_position, max_new_tokens,
                              frozenset(stop_ids), draft_tokens, self.hook.ids, prefilled)

    def batch(self) -> decode.Batch:
        """A batch of questions answered together over this share (`decode.Batch`): join
        them, step it, and take each ended answer's `sources` before the next joins."""
        return decode.Batch(self.decoder, self.info, self.hook)

    def answer(self, query_ids: Sequence[int], max_new_tokens: int, stop_ids,
               on_token: Callable[[int], None] | None = None,
               should_stop: Callable[[], bool] | None = None, draft_tokens: int | None = None,
               prefilled=None) -> tuple[list[int], list[dict] | None]:
        """Generate on every rank, a batch of one; returns (tokens, top sources on the query
        host, else None; None under top-k attention, which never sees every key's
        attention). draft_tokens, prefilled: as `request`."""
        answering = self.batch().alone(
            self.request(query_ids, max_new_tokens, stop_ids, draft_tokens, prefilled),
            decode.Callbacks(on_token, should_stop))
        return answering.generated, self.sources(answering)

    def sources(self, answering: decode.Answering) -> list[dict] | None:
        """(Every rank, in the same order) The top sources of an answer that ended, on the
        query host (None elsewhere, and under top-k attention): each rank's share of its
        attention by line, gathered. Before another question takes its slot."""
        import time

        if self.hook.retriever is not None:  # top-k attention (every rank): no attribution
            return None
        started = time.perf_counter()
        mine = {}
        self.hook.use(answering.slot)
        if self.hook.n_keys and self.share.files:
            mine = sources.line_mass(self.share.files, self.share.token_start,
                                     self.hook.key_mass(answering.generated))
        parts = dist.gather_object(self.info, mine, dst=self.info.world_size - 1)
        top = sources.top_sources(sources.add(parts)) if parts is not None else None
        self.sources_seconds = time.perf_counter() - started  # what attribution cost (bench)
        return top
