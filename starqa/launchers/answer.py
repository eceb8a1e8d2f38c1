"""What every Phase 2 path shares: the context's model, checked against its manifest; the
question, tokenised and ready to answer (`Question`); the `Answer` each path returns, built
by one constructor (`Answer.timed`); and a context answered in this process as a world of
one (`LocalAnswerer`), which a cold ask that fits one process runs, and scripts that ask
many questions keep loaded.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starqa.cache import shards, store
from starqa.cache.manifest import Manifest
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.runtime.protocol import AskJob, ThenServe
from starqa.topk.indexes import TopK


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    context: Manifest
    query_tokens: int
    workers: int
    seconds: float
    first_token_seconds: float | None
    decode_seconds: float  # first token → last token
    prefill_seconds: float | None  # the workers' question prefill, up to the first token
    sources: list[dict] = field(default_factory=list)  # top files and lines attended to
    peak_bytes: list[int] = field(default_factory=list)  # per worker
    measures: list[dict] = field(default_factory=list)  # per worker, when measured (bench)
    query_host: bool = True  # False on machines that do not hold the last block
    warm: bool = False  # answered by a running worker group
    weights: str | None = None  # Phase 2 weight format, where known
    attention: str = "exact"  # or the top-k settings (`TopK.describe`): then no sources
    before_torch: bool = False  # the first token came before torch was imported (a cold
    # ask's head start, starqa.coldstart.firsttoken)

    @classmethod
    def timed(cls, text: str, started: float, first: float | None, end: float,
              topk: TopK | None, **fields) -> Answer:
        """The answer of any path: `seconds` from `started` (when the command, or the
        question, began) to `end`, `first_token_seconds` to `first` (None: no token came),
        `attention` from the top-k settings, `text` without surrounding space; `fields` are
        the rest of Answer's."""
        return cls(text=text.strip(), seconds=end - started,
                   first_token_seconds=(first - started) if first else None,
                   attention=topk.describe() if topk else "exact", **fields)


@dataclass(frozen=True)
class Question:
    """One question about a context, ready for any path to answer: the context, its model
    (checked) and the tokenizer that streams the answer's text, the question's query ids,
    how long the answer may be and the tokens that end it, Phase 2's weight format and
    attention, and when it was asked (`Answer.seconds` counts from then)."""

    manifest: Manifest
    model_path: Path
    tokenizer: Any
    query_ids: list[int]
    max_new_tokens: int
    stops: frozenset[int]
    weights: str
    topk: TopK | None
    started: float
    measure: bool = False  # the workers report their numbers (starqa bench)

    def job(self, device: str, then_serve: ThenServe | None = None) -> AskJob:
        """The workers' job for this question (`starqa.runtime.protocol`)."""
        return AskJob(model_path=str(self.model_path), dtype=self.manifest.dtype,
                      context_dir=str(self.manifest.folder), query_ids=tuple(self.query_ids),
                      max_new_tokens=self.max_new_tokens, stop_ids=tuple(sorted(self.stops)),
                      weights=self.weights, topk=self.topk.as_dict() if self.topk else None,
                      measure=self.measure, device=device, then_serve=then_serve)


class LocalAnswerer:
    """A cached context answered in this process, as a world of one: the model and every
    shard loaded once (`phase2.answering.Answerer`), then any number of questions. The LSE
    merge is exact, so this gives the same tokens as N workers. A cold ask whose model and
    shards fit in memory answers through it; scripts that ask many questions (accuracy,
    benchmarks) open one with `load` and `ask` it, paying for the model load once."""

    def __init__(self, manifest: Manifest, model_path: Path, weights: str,
                 topk: TopK | None = None, device: str = "auto"):
        from starqa.phase2.answering import Answerer
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
        return self.answer(Question(self.manifest, self.model_path, self._tokens.tokenizer, ids,
                                    max_new_tokens, self._stops, self.weights, self.topk,
                                    time.perf_counter()))

    def answer(self, question: Question, ui: UI = UI(), loaded: float | None = None) -> Answer:
        """Answer `question`, streaming its text to `ui`. `loaded`: when the model and
        shards were ready (the prefill counts from then; default: now)."""
        from starqa.workers.worker import own_peak_rss

        stream = prompt.TextStream(question.tokenizer)
        first: list[float] = []

        def on_token(token: int) -> None:
            first or first.append(time.perf_counter())
            if piece := stream.add(token):
                ui.token(piece)

        loaded = time.perf_counter() if loaded is None else loaded
        tokens, top = self.answerer.answer(question.query_ids, question.max_new_tokens,
                                           set(question.stops), on_token)
        end = time.perf_counter()
        store.touch(question.manifest)
        if piece := stream.finish():
            ui.token(piece)
        return Answer.timed(stream.text, question.started, first[0] if first else None, end,
                            question.topk, token_ids=tokens, context=question.manifest,
                            query_tokens=len(question.query_ids), workers=1,
                            decode_seconds=(end - first[0]) if first else 0.0,
                            prefill_seconds=(first[0] if first else end) - loaded,
                            sources=top or [], peak_bytes=[own_peak_rss()],
                            weights=question.weights)


def with_indexes(manifest: Manifest, topk: TopK | None, ui: UI) -> Manifest:
    """The context with the indexes top-k attention needs, built now if it has none."""
    if topk is None:
        return manifest
    from starqa.topk import indexes

    return indexes.ensure(manifest, topk.index, on_build=ui.waiting)


def question_ids(manifest: Manifest, model_path: Path, question: str) -> tuple[Any, list[int]]:
    """(tokenizer, the question's query ids), without importing transformers where the
    manifest has its query template (`prompt.QueryTokens`)."""
    tokens = prompt.QueryTokens(manifest.query_template, model_path)
    ids = tokens.ids(question)
    return tokens.tokenizer, ids


def checked_model(manifest: Manifest, spec: str | None, ui: UI | None = None) -> Path:
    """The manifest's model, verified, with every shard present at its recorded size (the
    workers verify checksums as they load)."""
    model_path = manifest_model(manifest, spec, ui)
    shards.verify_present(manifest)
    return model_path


def manifest_model(manifest: Manifest, spec: str | None, ui: UI | None = None) -> Path:
    """The model the context was made with; a different one is an error, never a silent mix."""
    from starqa import models

    recorded = manifest.model
    path = Path(recorded.path)
    asked, made = models.embedded_model(spec or ""), models.embedded_model(recorded.spec)
    if asked and made and asked.name != made.name:  # known before any download or conversion
        raise StarqaError(
            f"Context {manifest.name!r} was ingested with {made.name}; --model asks for "
            f"{asked.name}. A context is answered by the model that encoded it.",
            hint=f"ask with --model {made.name}, or re-ingest with the other model: "
                 f"{manifest.rerun} --model {asked.name}")
    if spec is not None:
        path = models.resolve_model(spec, ui)
    elif not (path / "config.json").exists():
        if not models.rebuildable(recorded.spec) and \
                not Path(recorded.spec).expanduser().is_dir():
            raise StarqaError(
                f"Context {manifest.name!r} was ingested with the model at {recorded.path}, "
                "which is no longer there.",
                hint=f"put the model back there, ask with --model PATH (the same model "
                     f"elsewhere), or re-ingest with another model: {manifest.rerun} "
                     "--model MODEL")
        # the converted folder was deleted: fetched (embedded) or converted (GGUF) again
        path = models.resolve_model(recorded.spec, ui)
    actual = models.fingerprint(path)
    replaced = Path(path).resolve() == Path(recorded.path).resolve()
    if actual["digest"] != recorded.digest and replaced:
        # the folder it was made with holds another model now: --model that folder is no way out
        changed = [part for part in ("config", "weights", "tokenizer")
                   if actual.get(f"{part}_sha256") != getattr(recorded, f"{part}_sha256")]
        raise StarqaError(
            f"The model now at {recorded.path} ({actual['digest'][:12]}) does not match the model "
            f"context {manifest.name!r} was ingested with there ({recorded.digest[:12]}): its "
            f"{' and '.join(changed) or 'fingerprint'} changed since.",
            hint=f"put the model the context was made with back at {recorded.path}, or "
                 f"re-ingest with the model there now: {manifest.rerun}")
    if actual["digest"] != recorded.digest:
        raise StarqaError(
            f"Model {actual['name']} ({actual['digest'][:12]}) does not match the model context "
            f"{manifest.name!r} was ingested with: {recorded.name} ({recorded.digest[:12]}).",
            hint=f"ask with --model {shlex.quote(recorded.spec)}, or re-ingest: "
                 f"{manifest.rerun}")
    return path
