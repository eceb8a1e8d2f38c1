"""Phase 2, a question against the cached shards: the decode loop (`decode`), the attention it
calls in every layer (`shard_attention`, composing the shard view `shard_view`, the own-KV
buffers `own_kv`, the layer call `layer_attention` and the compiled step `compiled_step`), the
worker's one answering path (`answerer`), the question and answer records every door
shares (`answer`), prompt-lookup drafts (`lookup`), source attribution
(`sources`), and where Phase 2 runs (`placement`)."""
