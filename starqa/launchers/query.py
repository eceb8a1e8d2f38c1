"""What every cold Phase 2 path shares: the context's model, checked against its manifest,
and the question tokenised into its query, ready for the workers (`Query`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starqa.cache import shards
from starqa.cache.context import Context
from starqa.cache.manifest import Manifest
from starqa.core.errors import StarqaError
from starqa.core.progress import UI
from starqa.corpus import prompt
from starqa.phase2.answer import Answer, Timings, finish_of, sources_of
from starqa.runtime.protocol import AskJob, ThenServe
from starqa.topk.indexes import TopK


@dataclass(frozen=True)
class Query:
    """A question made ready for the workers: the context, its model (checked) and the
    tokenizer that streams the answer's text, the question's query ids (the query part of
    the prompt, `starqa.corpus.prompt`), how long the answer may be and the tokens that end
    it, Phase 2's weight format and attention, and when it was asked (the answer's timings
    count from then)."""

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
        """The workers' job for this query (`starqa.runtime.protocol`)."""
        return AskJob(model_path=str(self.model_path), dtype=self.manifest.dtype,
                      context_dir=str(self.manifest.folder), query_ids=tuple(self.query_ids),
                      max_new_tokens=self.max_new_tokens, stop_ids=tuple(sorted(self.stops)),
                      weights=self.weights, topk=self.topk.as_dict() if self.topk else None,
                      measure=self.measure, device=device, then_serve=then_serve)


def answered(query: Query, text: str, token_ids: Sequence[int], timings: Timings,
             found: Sequence[dict] | None, workers: int, **fields) -> Answer:
    """The `Answer` a cold path gives `query`: `text` (surrounding space dropped) of
    `token_ids`, Phase 2's sources `found` (`phase2.sources.top_sources`; none under top-k)
    and the `workers` that answered; `fields` are the rest of Answer's (`query_host`,
    `peak_bytes`, `measures`)."""
    return Answer(text=text.strip(), context=Context.of(query.manifest),
                  token_ids=tuple(token_ids), question_tokens=len(query.query_ids),
                  sources=sources_of(found, query.topk is None), timings=timings,
                  finish=finish_of(token_ids, query.max_new_tokens), warm=False,
                  workers=workers, weights=query.weights,
                  attention=query.topk.describe() if query.topk else "exact", **fields)


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
