"""starqa's API: what the CLI, `starqa eval`, `starqa bench`, the benchmarks and the tests
call. Each phase has a launcher of its own; this module only names them:

- Phase 1, `ingest`: `starqa.launchers.ingest` (options, result, the cache key, the commit);
- Phase 2, `ask`: `starqa.launchers.ask` (cold, warm and in-process answers), placed by
  `starqa.phase2.placement`; the question made ready for the workers and the model check:
  `starqa.launchers.query`; a context kept loaded in this process: `starqa.launchers.local`;
  the `Answer` every path returns: `starqa.phase2.answer`;
- warm groups, `serve`: `starqa.launchers.serve`;
- progress reporting for all: `starqa.core.progress.UI`.
"""

from starqa.core.progress import UI
from starqa.launchers.ask import AskOptions, TokenAskOptions, ask, ask_tokens
from starqa.launchers.ingest import (IngestOptions, IngestResult, TokenIngestOptions,
    default_reserve, ingest, ingest_tokens, ingest_worker_count, query_position)
from starqa.launchers.local import LocalAnswerer
from starqa.launchers.query import manifest_model
from starqa.launchers.serve import DEFAULT_KEEPALIVE, ServeOptions, serve
from starqa.phase2.answer import Answer

__all__ = ["DEFAULT_KEEPALIVE", "UI", "Answer", "AskOptions", "IngestOptions", "IngestResult",
           "LocalAnswerer", "ServeOptions", "TokenAskOptions", "TokenIngestOptions", "ask",
           "ask_tokens", "default_reserve", "ingest", "ingest_tokens", "ingest_worker_count",
           "manifest_model", "query_position", "serve"]
