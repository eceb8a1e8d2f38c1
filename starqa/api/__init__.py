"""starqa's Python API (docs/api.md): what `starqa ingest`, `ask`, `chat`, `list` and `rm` do,
as functions that return frozen data and raise the CLI's errors. The command line
(`starqa.cli`) and the HTTP and MCP servers (`starqa.servers`) sit on it; it sits on
`starqa.engine` and the cache.

    from starqa import api

    ctx = api.ingest("./docs")                   # a Context (cache_hit: found, not encoded)
    answer = api.ask("who approved the budget?", ctx)
    answer.text, answer.sources, answer.timings

    with api.stream("and when?", ctx) as pieces:   # the text as it is generated
        for piece in pieces:
            print(piece, end="")
    pieces.result()                              # then the Answer

    chat = api.Chat(ctx)                         # turns with history, on a warm group
    chat.ask("who approved it?"); chat.ask("when?")

    api.contexts(); api.rm("docs")

Beside these, the same steps with every option and their whole results, for a door that
reports them as the command line does: `ingest_with` (`IngestOptions` → `IngestResult`),
`ask_with` (`AskOptions` → `AskResult`), `watch`, `listing`, `find`, `resolved` and
`remove`, `cache_usage` and `clean_cache`, `build_indexes`; the machine's warm groups
(`running_groups`, `stopping`, `stop_groups`, `serve`, `hand_over`); and what the machine
brings (`kernels`, `fetch_model`).

Errors are `StarqaError`s (a message and a hint), as the CLI prints them; two are told
apart: `ContextNotFound` and `ContextLengthError`.
"""

from starqa.api.answers import DEFAULT_MAX_NEW_TOKENS, Answer, Question, Source, Timings
from starqa.api.asking import Chat, ask, ask_with, stream
from starqa.api.catalog import (Context, Listing, all_contexts, build_indexes, cache_usage,
    clean_cache, context, contexts, find, ingest, ingest_with, listing, remove, resolved, rm,
    shard_present, summary, watch)
from starqa.api.errors import ContextLengthError, ContextNotFound, ShardError, StarqaError, Stopped
from starqa.api.groups import (Group, GroupSettings, elsewhere, hand_over, running_groups,
    serve, stop, stop_groups, stopping, wait_started, warm)
from starqa.api.machine import KernelStatus, fetch_model, kernels
from starqa.api.service import Service
from starqa.api.streams import Stream
from starqa.cache.manifest import Manifest
from starqa.cache.store import CacheUsage, Damaged
from starqa.corpus import valid_text
from starqa.engine import DEFAULT_KEEPALIVE, AskOptions, IngestOptions, IngestResult, ServeOptions
from starqa.engine import Answer as AskResult  # the engine's whole record; `Answer` is the API's
from starqa.topk.indexes import KINDS as INDEX_KINDS
from starqa.topk.indexes import TopK, topk_settings
from starqa.workers.messages import GroupStatus
from starqa.workers.runfile import RunInfo

__all__ = ["Answer", "AskOptions", "AskResult", "CacheUsage", "Chat", "Context",
           "ContextLengthError", "ContextNotFound", "DEFAULT_KEEPALIVE", "DEFAULT_MAX_NEW_TOKENS",
           "Damaged", "Group", "GroupSettings", "GroupStatus", "INDEX_KINDS", "IngestOptions",
           "IngestResult", "KernelStatus", "Listing", "Manifest", "Question", "RunInfo",
           "ServeOptions", "Service", "ShardError", "Source", "StarqaError", "Stopped", "Stream",
           "Timings", "TopK", "all_contexts", "ask", "ask_with", "build_indexes", "cache_usage",
           "clean_cache", "context", "contexts", "elsewhere", "fetch_model", "find", "hand_over",
           "ingest", "ingest_with", "kernels", "listing", "remove", "resolved", "rm",
           "running_groups", "serve", "shard_present", "stop", "stop_groups", "stopping", "stream",
           "summary", "topk_settings", "valid_text", "wait_started", "warm", "watch"]
