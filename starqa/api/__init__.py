"""starqa's Python API (docs/api.md): ingest a folder, ask about it, chat, manage what the
cache holds and the warm groups that answer, with frozen records back and typed errors.

    from starqa import api

    ctx = api.ingest("./docs")                   # a Context (cache_hit: found, not encoded)
    answer = api.ask("who approved the budget?", ctx)
    answer.text, answer.sources, answer.timings
    [s.result() for s in api.ask_all(["who?", "when?"], ctx)]   # answered together

    with api.stream("and when?", ctx, stop=["\\n\\n"]) as pieces:   # text as it comes
        for piece in pieces:
            print(piece, end="")
    pieces.result()                              # then the Answer

    with api.Chat(ctx) as chat:                  # turns with history, on a warm group
        chat.ask("who approved it?"); chat.ask("when?")

    api.contexts(); api.remove("docs")
    api.Client(home="/data/starqa").contexts()   # the same calls on another cache root

Errors are `StarqaError`s (a message and a hint), as the CLI prints them; `ContextNotFound`
and `ContextLengthError` are told apart. What only the doors (the CLI, the HTTP and MCP
servers) need, every option and whole result, is `starqa.api.doors`.
"""

from starqa.api.asking import Chat, ask, ask_all, stream
from starqa.api.catalog import context, contexts, ingest, remove
from starqa.api.client import Client
from starqa.api.errors import ContextLengthError, ContextNotFound, ShardError, StarqaError, Stopped
from starqa.api.groups import Group, stop, warm
from starqa.api.settings import AskSettings, IngestSettings
from starqa.api.streams import Stream
from starqa.cache.context import Context
from starqa.phase2.answer import DEFAULT_MAX_NEW_TOKENS, Answer, Progress, Question, Source, \
    Timings
from starqa.topk.indexes import TopK, topk_settings

__all__ = ["Answer", "AskSettings", "Chat", "Client", "Context", "ContextLengthError",
           "ContextNotFound", "DEFAULT_MAX_NEW_TOKENS", "Group", "IngestSettings", "Progress",
           "Question", "ShardError", "Source", "StarqaError", "Stopped", "Stream", "Timings",
           "TopK", "ask", "ask_all", "context", "contexts", "ingest", "remove", "stop",
           "stream", "topk_settings", "warm"]
