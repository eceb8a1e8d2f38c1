"""Top-k attention in Phase 2 (docs/topk.md): its settings and vector indexes on disk
(`indexes`, read and searched: `probing`), where ivf's lists lie in memory (`listlayout`),
and a worker's top-k shard: one interface (`shard`), a class per index kind (`flat`, `ivf`,
`hnsw`; the kernel's kinds through `scanned`), what they load alike (`loading`, `rows`),
and the factory that picks the kind (`retrieval`)."""
