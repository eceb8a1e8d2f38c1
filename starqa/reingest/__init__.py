"""Incremental re-ingest (docs/reingest.md): the order files are packed in, which blocks are
already stored, carrying them over, and re-rotating keys that moved."""
