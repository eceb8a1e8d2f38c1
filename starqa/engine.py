"""starqa's API: what the CLI, `starqa eval`, `starqa bench`, the benchmarks and the tests
call. Each phase has a launcher of its own; this module only names them:

- Phase 1, `ingest`: `starqa.launchers.ingest` (options, result, the cache key, the commit);
- Phase 2, `ask` and `serve`: `starqa.launchers.ask` (cold, warm and in-process answers; warm
  groups), placed by `starqa.phase2.placement`;
- progress reporting for both: `starqa.core.progress.UI`.
"""

from starqa.launchers.ask import (DEFAULT_KEEPALIVE, Answer, AskOptions, ServeOptions, ask,
    ask_tokens, manifest_model, serve)
from starqa.launchers.ingest import (IngestOptions, IngestResult, default_reserve, ingest,
    ingest_tokens, ingest_worker_count, query_position)
from starqa.core.progress import UI

__all__ = ["DEFAULT_KEEPALIVE", "UI", "Answer", "AskOptions", "IngestOptions", "IngestResult",
           "ServeOptions", "ask", "ask_tokens", "default_reserve", "ingest", "ingest_tokens",
           "ingest_worker_count", "manifest_model", "query_position", "serve"]
