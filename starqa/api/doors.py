"""What only starqa's doors need (the command line, the HTTP and MCP servers), beside the
user API of `starqa.api`: each step with every option and its whole result, for a door that
reports them as the command line does (`ingest_with`: `IngestOptions` → `IngestResult`;
`ask_with`: `AskOptions` → `Answer`; `watch`, `listing`, `find`, `resolved` and
`remove_found`, `cache_usage` and `clean_cache`, `build_indexes`); the machine's warm
groups (`running_groups`, `stopping`, `stop_groups`, `serve`, `hand_over`); a long-running
door's questions answered together per context (`Service`); a context's files as ingested
(`files`: `read`, `search`); the progress protocol a door draws (`UI`); and what the machine
brings (`kernels`, `fetch_model`)."""

from starqa.api import files
from starqa.api.asking import ask_with
from starqa.api.catalog import (Listing, all_contexts, build_indexes, cache_usage, clean_cache,
    find, ingest_with, listing, remove_found, resolved, shard_present, summary, watch)
from starqa.api.groups import (GroupSettings, elsewhere, hand_over, running_groups, serve,
    stop_groups, stopping, wait_started)
from starqa.api.machine import KernelStatus, fetch_model, kernels
from starqa.api.service import Service
from starqa.cache.manifest import Manifest
from starqa.cache.store import CacheUsage, Damaged
from starqa.corpus import valid_text
from starqa.engine import (DEFAULT_KEEPALIVE, UI, AskOptions, IngestOptions, IngestResult,
    ServeOptions)
from starqa.topk.indexes import KINDS as INDEX_KINDS
from starqa.workers.messages import GroupStatus
from starqa.workers.runfile import RunInfo

__all__ = ["AskOptions", "CacheUsage", "DEFAULT_KEEPALIVE", "Damaged", "GroupSettings",
           "GroupStatus", "INDEX_KINDS", "IngestOptions", "IngestResult", "KernelStatus", "UI",
           "Listing", "Manifest", "RunInfo", "ServeOptions", "Service", "all_contexts",
           "ask_with", "build_indexes", "cache_usage", "clean_cache", "elsewhere", "fetch_model",
           "files", "find", "hand_over", "ingest_with", "kernels", "listing", "remove_found", "resolved",
           "running_groups", "serve", "shard_present", "stop_groups", "stopping", "summary",
           "valid_text", "wait_started", "watch"]
