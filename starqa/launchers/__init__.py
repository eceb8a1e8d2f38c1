"""The Python side of `starqa ingest` (Phase 1's launcher) and `starqa ask`/`serve` (Phase 2's)."""
