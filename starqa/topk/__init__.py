"""Top-k attention in Phase 2 (docs/topk.md): its settings and vector indexes on disk, where
ivf's lists lie in memory, and a worker's top-k shard."""
