"""starqa's Python API (docs/api.md): what `starqa ingest`, `ask`, `chat`, `list` and `rm` do,
as functions that return frozen data and raise the CLI's errors. The HTTP and MCP servers
(`starqa.servers`) sit on it; it sits on `starqa.engine` and the cache.

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

Errors are `StarqaError`s (a message and a hint), as the CLI prints them; two are told
apart: `ContextNotFound` and `ContextLengthError`.
"""

from starqa.api.answers import DEFAULT_MAX_NEW_TOKENS, Answer, Question, Source, Timings
from starqa.api.asking import Chat, ask, stream
from starqa.api.catalog import Context, context, contexts, ingest, rm
from starqa.api.errors import ContextLengthError, ContextNotFound, ShardError, StarqaError, Stopped
from starqa.api.groups import Group, GroupSettings, stop, warm
from starqa.api.service import Service
from starqa.api.streams import Stream
from starqa.engine import DEFAULT_KEEPALIVE

__all__ = ["DEFAULT_KEEPALIVE", "DEFAULT_MAX_NEW_TOKENS", "Answer", "Chat", "Context",
           "ContextLengthError", "ContextNotFound", "Group", "GroupSettings", "Question",
           "Service", "ShardError", "Source", "StarqaError", "Stopped", "Stream", "Timings",
           "ask", "context", "contexts", "ingest", "rm", "stop", "stream", "warm"]
