"""The on-disk cache: a context's manifest, its shard files, the content-addressed block store,
the contexts folder's housekeeping, and which host keeps which blocks."""
