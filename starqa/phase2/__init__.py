"""Phase 2, a question against the cached shards: the decode loop and the shard attention it
calls in every layer (`decode`), the worker's answering path (`answering`), prompt-lookup drafts,
source attribution, and where Phase 2 runs (`placement`)."""
