"""`Context`: one ingested context as every door shows it, a frozen handle built from its
manifest (`starqa.cache.manifest.Manifest`, the whole record on disk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starqa.cache.manifest import Manifest


@dataclass(frozen=True)
class Context:
    """One ingested context, as `starqa list` and `info` show it. `ref` names it in every
    door (`--context`, an HTTP request's `model`, MCP's `context`): its name where the name
    means this context, else its key (an older ingest of the same name)."""

    name: str
    key: str
    ref: str
    tokens: int  # of the packed documents
    window: int  # the model's trained window
    model: str
    method: str
    sources: tuple[str, ...]  # the paths given to ingest
    files: tuple[str, ...]  # the packed files, in the context's order
    skipped: tuple[tuple[str, str], ...]  # (path, why) of each file left out
    created: float  # Unix time
    folder: Path
    cache_hit: bool | None = None  # from `ingest`: the cache had it already; else None

    @classmethod
    def of(cls, manifest: Manifest, ref: str | None = None,
           cache_hit: bool | None = None) -> Context:
        return cls(name=manifest.name, key=manifest.key, ref=ref or manifest.key,
                   tokens=manifest.n_tokens, window=manifest.model.window,
                   model=manifest.model.name, method=manifest.method.name,
                   sources=tuple(manifest.sources), files=tuple(f.path for f in manifest.files),
                   skipped=tuple((s.path, s.reason) for s in manifest.skipped),
                   created=manifest.created, folder=manifest.folder, cache_hit=cache_hit)

    def as_dict(self) -> dict:
        """JSON-ready: its facts, the files and skipped files counted (not listed)."""
        return {"name": self.name, "key": self.key, "ref": self.ref, "tokens": self.tokens,
                "window": self.window, "model": self.model, "method": self.method,
                "sources": list(self.sources), "files": len(self.files),
                "skipped": len(self.skipped), "created": self.created,
                "dir": str(self.folder), "cache_hit": self.cache_hit}
