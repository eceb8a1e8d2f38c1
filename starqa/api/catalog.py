"""Contexts through the Python API: ingest a folder (Phase 1, `starqa.engine.ingest`) and
watch it, find, list and remove what the cache holds (`starqa.cache.store`) and account
for its space, as `starqa ingest`, `list`, `info`, `rm` and `cache` do, with `Context`: a
frozen handle on one ingested context.

`ingest`, `context`, `contexts` and `remove` are the user's way in (`starqa.api`);
`ingest_with`, `resolved` and `remove_found` are the same steps with all their options and
their whole results, for a door that reports them as the command line does
(`starqa.api.doors`)."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starqa import engine
from starqa.api.errors import ShardError, StarqaError
from starqa.api.settings import IngestSettings
from starqa.cache import shards, store
from starqa.cache.context import Context
from starqa.cache.manifest import IndexSet, Manifest
from starqa.cache.store import CacheUsage, Damaged
from starqa.core.paths import contexts_dir, models_dir
from starqa.core.progress import UI
from starqa.topk import indexes


def ingest(paths: str | os.PathLike | Sequence[str | os.PathLike], *, name: str | None = None,
           model: str | None = None, method: str | None = None,
           options: IngestSettings = IngestSettings(), ui: UI = UI()) -> Context:
    """Pack files and folders into one context and encode it (Phase 1), or find it cached:
    `Context.cache_hit` says which. `name` (default: from the paths), `model` (an embedded
    name, a GGUF file, `ollama:NAME`, a folder; default: $STARQA_MODEL, else the default
    model) and `method` (default: star) as `starqa ingest`'s options; the rest in
    `options`; its progress on `ui` (tokens encoded: `start_encoding`, `advance`)."""
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    sources = tuple(os.path.abspath(os.fspath(p)) for p in given)
    opts = options.ingest_options(sources, name, model)
    result = ingest_with(opts if method is None else dataclasses.replace(opts, method=method),
                         ui)
    if result.manifest is None:  # a machine other than node 0 of a run across machines
        raise StarqaError("This machine's part of the ingest is done; node 0 commits the "
                          "context.", hint="read it there: api.context(NAME)")
    return Context.of(result.manifest, _ref(result.manifest), result.cache_hit)


def ingest_with(opts: engine.IngestOptions, ui: UI = UI()) -> engine.IngestResult:
    """Phase 1 as `starqa ingest` runs it: every option (`IngestOptions`), its steps and its
    progress on `ui`, and the whole `IngestResult` (the manifest, what a re-ingest reused,
    the seconds) for a report. On a machine other than node 0 of a run across machines the
    result has no manifest: node 0 commits the context. `ingest` is this, with defaults."""
    return engine.ingest(opts, ui)


def watch(opts: engine.IngestOptions, reingest: Callable[[], None],
          on_error: Callable[[StarqaError], None]) -> None:
    """Watch the sources of `opts` (`ingest --watch`) until KeyboardInterrupt: `reingest`
    is called a moment after files stop changing, when a change touches what the ingest
    reads (its files, the ignore files, a new file its rules take; `starqa.corpus.watch`).
    A StarqaError it raises goes to `on_error`, and the watching goes on."""
    from starqa.corpus import watch as watching

    watching.watch(watching.Selection(opts.paths, opts.include, opts.exclude), reingest,
                   on_error)


@dataclass(frozen=True)
class Listing:
    """What `starqa list` shows: a summary of each usable context, the most recently used
    first, and of each damaged one (JSON-ready dicts: `store.context_summary`,
    `store.damaged_summary`; a damaged one's has `damaged`, its problem)."""

    contexts: tuple[dict, ...]
    damaged: tuple[dict, ...]

    @property
    def latest(self) -> dict | None:
        """The summary of the context a plain `ask` uses: the one used last, damaged or
        not (the ask then says so); None when there is none."""
        return max(self.contexts + self.damaged, key=lambda s: s["last_used"], default=None)


def listing() -> Listing:
    """Every context folder in the cache, read once, usable or damaged."""
    good, damaged = store.scan_contexts(contexts_dir())
    return Listing(tuple(map(store.context_summary, good)),
                   tuple(map(store.damaged_summary, damaged)))


def summary(manifest: Manifest) -> dict:
    """The facts `starqa list` shows for one context (JSON-ready: its size on disk and when
    it was used last among them)."""
    return store.context_summary(manifest)


def shard_present(manifest: Manifest, block: int) -> bool:
    """Whether block `block`'s shard file is there at its recorded size (`starqa info`:
    a quick look; nothing is read or checksummed)."""
    try:
        shards.verify_block(manifest, block, checksum=False)
    except ShardError:
        return False
    return True


def build_indexes(manifest: Manifest, kind: str, ui: UI = UI()) -> tuple[Manifest, IndexSet]:
    """(Re)build the context's indexes of `kind` for top-k attention (`starqa index`: one
    index per block, layer and KV head, beside the shards, checksummed in the manifest; a
    damaged set is replaced whole), the build shown on `ui`; returns the manifest that
    records them and the set built."""
    manifest = indexes.ensure(manifest, kind, rebuild=True, on_build=ui.waiting)
    return manifest, indexes.find_set(manifest, kind)


def contexts() -> list[Context]:
    """Every usable context, the most recently used first (damaged ones are left out:
    `starqa list` names them)."""
    good = store.list_contexts(contexts_dir())
    keys = {m.key for m in good}
    names = collections.Counter(m.name for m in good)
    # a name borne once means its context (a full key aside); one borne more, its newest
    # ingest with the same settings or none: as `store.match_context` decides
    refs = {name: _ref_of(name) for name, n in names.items() if n > 1 or name in keys}
    return [Context.of(m, m.name if refs.get(m.name, m.key) == m.key else m.key)
            for m in good]


def context(ref: Context | str | None = None) -> Context:
    """The context `ref` names: a name, a key or a key prefix (as `--context`); None: the
    one used last. Raises ContextNotFound when nothing matches; a StarqaError for an
    ambiguous or empty name, a ShardError for a damaged context."""
    manifest = find(ref)
    return Context.of(manifest, _ref(manifest))


def remove(*refs: Context | str) -> int:
    """Remove contexts (damaged ones too, by key) and return the bytes freed. Every name is
    resolved first, so a typo removes nothing; a warm group serving one is stopped."""
    if not refs:
        raise StarqaError("Name the contexts to remove.", hint="api.contexts() lists them")
    return sum(freed for _, freed in remove_found(resolved(refs)))


def resolved(refs: Sequence[Context | str]) -> list[Manifest | Damaged]:
    """The contexts `refs` name (a damaged one by its key), each once, in their order; all
    of them are found before anything is done, so one typo or ambiguous prefix is an error
    before any is removed."""
    root = contexts_dir()
    found = [store.match_context(root, _key(r)) for r in refs]
    return list({c.key: c for c in found}.values())


def all_contexts() -> list[Manifest | Damaged]:
    """Every context in the cache, the usable ones first, then the damaged ones (`rm
    --all`; `contexts` leaves the damaged ones out)."""
    good, damaged = store.scan_contexts(contexts_dir())
    return [*good, *damaged]


def remove_found(targets: Sequence[Manifest | Damaged]) -> list[tuple[Manifest | Damaged, int]]:
    """Remove `targets`, each with the bytes it freed; the warm groups serving them are
    stopped first (they would serve nothing)."""
    from starqa.workers import client

    for target in targets:
        client.stop_group(target.key)
    return [(target, store.remove_context(target)) for target in targets]


def cache_usage() -> CacheUsage:
    """What the cache holds (`starqa cache`): the converted models' and the contexts'
    bytes, and the folders left by interrupted work."""
    return store.cache_usage(models_dir(), contexts_dir())


def clean_cache(usage: CacheUsage) -> int:
    """Delete what `usage` found left over, never a folder a process on this machine is
    using (damaged contexts too), then the block files no context links any more; returns
    the bytes freed (`cache --clean`)."""
    return store.clean_leftovers(usage.leftovers, contexts_dir())


def find(ref: Context | str | None) -> Manifest:
    """The whole manifest of the context `ref` names (see `context`, which raises the same
    errors): its blocks, files, model and method, as `starqa info` shows them."""
    return store.find_context(contexts_dir(), _key(ref))


def _key(ref: Context | str | None) -> str | None:
    return ref.key if isinstance(ref, Context) else ref


def _ref(manifest: Manifest) -> str:
    return manifest.name if _ref_of(manifest.name) == manifest.key else manifest.key


def _ref_of(name: str) -> str | None:
    """The key `name` means, or None when it means none or several."""
    try:
        found = store.match_context(contexts_dir(), name)
    except StarqaError:
        return None
    return found.key
