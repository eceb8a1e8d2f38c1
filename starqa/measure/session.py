"""A cached context answered in this process, as a world of one: model and every shard
loaded once, then any number of questions. The LSE merge is exact, so this gives the same
tokens as N workers; scripts that ask many questions (accuracy, benchmarks) use it to pay
for the model load once. It is the Answerer that cold asks and warm groups use."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from starqa.runtime import dist
from starqa.corpus import prompt
from starqa.cache.manifest import Manifest


@dataclass
class LocalAnswer:
    text: str
    token_ids: list[int]
    first_token_seconds: float
    seconds: float
    sources: list[dict]


class LocalSession:
    def __init__(self, manifest: Manifest, model_path: Path | None = None, device: str = "cpu",
                 weights: str | None = None):
        from starqa import engine, models
        from starqa.phase2.answering import Answerer

        path = model_path or engine.manifest_model(manifest, None)
        self.tokenizer = models.load_tokenizer(path)
        self.stop_ids = models.stop_ids(self.tokenizer, path)
        self.weights = models.phase2_weights(weights, manifest.model.spec, device)
        self.context = Answerer.from_cache(manifest, dist.local_world(device), path,
                                           self.weights)

    def answer(self, question: str, max_new_tokens: int = 64) -> LocalAnswer:
        ids = prompt.tokenize_query(self.tokenizer, question)
        started = time.perf_counter()
        first: list[float] = []
        tokens, top = self.context.answer(ids, max_new_tokens, self.stop_ids,
                                          lambda _: first or first.append(time.perf_counter()))
        text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        end = time.perf_counter()
        return LocalAnswer(text, tokens, (first[0] if first else end) - started, end - started,
                           top or [])
