"""Phase 1's launcher, `starqa ingest` and `starqa bench`'s token contexts, read in data-flow
order: `options` (what an ingest is asked and returns) → `flow` (files → token ids → checks
→ cache key → a hit, or Phase 1) → `steps` (plan, encode, commit) with `workers` (how many
workers a machine starts)."""

from starqa.launchers.ingest.flow import default_reserve, ingest, ingest_tokens
from starqa.launchers.ingest.options import IngestOptions, IngestResult, TokenIngestOptions
from starqa.launchers.ingest.steps import query_position
from starqa.launchers.ingest.workers import check_workers, ingest_worker_count

__all__ = ["IngestOptions", "IngestResult", "TokenIngestOptions", "check_workers",
           "default_reserve", "ingest", "ingest_tokens", "ingest_worker_count", "query_position"]
