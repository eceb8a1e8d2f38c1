"""A cached context answered in this process, as a world of one (`LocalAnswerer`): what a
cold ask whose model and shards fit in memory runs, and what scripts that ask many
questions (accuracy, benchmarks) keep loaded."""

from __future__ import annotations

import time
from pathlib import Path

from starqa.cache import store
from starqa.cache.manifest import Manifest
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.launchers.query import Query, answered, manifest_model
from starqa.phase2.answer import Answer, Timings
from starqa.topk.indexes import TopK


class LocalAnswerer:
    """A cached context answered in this process, as a world of one: the model and every
    shard loaded once (`phase2.answerer.Answerer`), then any number of questions. The LSE
    merge is exact, so this gives the same tokens as N workers. A cold ask whose model and
    shards fit in memory answers through it; scripts that ask many questions (accuracy,
    benchmarks) open one with `load` and `ask` it, paying for the model load once."""

    def __init__(self, manifest: Manifest, model_path: Path, weights: str,
                 topk: TopK | None = None, device: str = "auto"):
        from starqa.phase2.answerer import Answerer
        from starqa.runtime import dist

        self.manifest, self.model_path, self.weights, self.topk = (manifest, model_path,
                                                                   weights, topk)
        self.answerer = Answerer.from_cache(manifest, dist.local_world(device), model_path,
                                            weights, topk)
        self._tokens: prompt.QueryTokens | None = None  # `ask`'s, made on first use
        self._stops: frozenset[int] = frozenset()

    @classmethod
    def load(cls, manifest: Manifest, model_path: Path | None = None, device: str = "cpu",
             weights: str | None = None) -> LocalAnswerer:
        """The context loaded in this process with its own model (`manifest_model`, unless
        `model_path` is given) and Phase 2's default weights for `device` (unless given)."""
        from starqa import models

        path = Path(model_path) if model_path else manifest_model(manifest, None)
        return cls(manifest, path, models.phase2_weights(weights, manifest.model.spec, device),
                   device=device)

    def ask(self, question: str, max_new_tokens: int = 64) -> Answer:
        """Answer `question` (text); its times count from when its tokens are ready."""
        from starqa import models

        if self._tokens is None:
            self._tokens = prompt.QueryTokens(self.manifest.query_template, self.model_path)
            self._stops = frozenset(models.stop_ids(self._tokens.tokenizer, self.model_path))
        ids = self._tokens.ids(question)
        return self.answer(Query(self.manifest, self.model_path, self._tokens.tokenizer, ids,
                                 max_new_tokens, self._stops, self.weights, self.topk,
                                 time.perf_counter()))

    def answer(self, query: Query, ui: UI = UI(), loaded: float | None = None) -> Answer:
        """Answer `query`, streaming its text to `ui`, until it ends or `ui.stop_wanted()`
        (a stop string appeared). `loaded`: when the model and shards were ready (the prefill
        counts from then; default: now)."""
        from starqa.workers.worker import own_peak_rss

        stream = prompt.TextStream(query.tokenizer)
        first: list[float] = []

        def on_token(token: int) -> None:
            first or first.append(time.perf_counter())
            if piece := stream.add(token):
                ui.token(piece)

        loaded = time.perf_counter() if loaded is None else loaded
        tokens, top = self.answerer.answer(query.query_ids, query.max_new_tokens,
                                           set(query.stops), on_token, ui.stop_wanted)
        end = time.perf_counter()
        store.touch(query.manifest)
        if piece := stream.finish():
            ui.token(piece)
        first_at = first[0] if first else None
        timings = Timings.since(query.started, first_at, end, (first_at or end) - loaded,
                                (end - first_at) if first_at else 0.0)
        return answered(query, stream.text, tokens, timings, top, 1,
                        peak_bytes=(own_peak_rss(),))


