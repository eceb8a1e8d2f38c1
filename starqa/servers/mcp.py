"""starqa's MCP server (`starqa mcp`): a coding agent's door to cached contexts, over stdio
with the official MCP SDK, thin over `starqa.doors.Service`.

Tools:
    list_contexts()                       the contexts, the most recently used first
    ingest(path, name, model, method, include, exclude)
                                          encode a folder or files (or find them cached)
    ask(question, context, max_new_tokens)
                                          the answer, its sources (files and lines) and timings
    search(pattern, context, regex, around, paths, limit)
                                          `path:line` of each line of the context's files
                                          where a string or regex appears, with lines around
    read(path, context, start, end)       a file's lines as the context holds them (where an
                                          answer's sources point)

A client that sends a progress token gets progress notifications: `ingest`'s tokens encoded
of the total, `ask`'s question prefilled then answer pieces. Several agents' questions to one
context are answered together by its warm group.

Resources: each context as `starqa://contexts/{ref}` (JSON: its facts, files and skipped
files). Questions are answered by the context's warm group, started on the first one and
kept `keepalive` idle seconds after the last, so an agent's next run finds it warm; the KV
cache itself persists across runs. A StarqaError is the tool's error result, its message
and hint as the CLI prints them.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any
from urllib.parse import quote

from starqa import api
from starqa.api import doors
from starqa.api.doors import UI, files

URI_PREFIX = "starqa://contexts/"

INSTRUCTIONS = """\
starqa answers questions about long documents and repositories from a cached KV encoding:
ingest a folder once (it is cached across runs; an unchanged folder is found, not encoded
again), then ask about it by the context's name. Answers come with the files and lines
they drew on."""


def _sdk():
    try:
        from mcp.server.mcpserver import MCPServer, ResourceSecurity
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:
        raise api.StarqaError("`starqa mcp` needs the MCP SDK, which is not installed.",
                              hint="pip install 'starqa[mcp]'") from None
    return MCPServer, ResourceSecurity, ToolError


try:  # the type a tool names to be handed its request (progress notifications)
    from mcp.server.mcpserver import Context as ToolContext
except ImportError:  # the SDK is missing: `_sdk` says so when the server is made
    ToolContext = Any


class Notifications:
    """Progress notifications to the client of one tool call (none where it sent no
    progress token); `report` may be called from the tool's worker thread. Each value is
    larger than the last, as the protocol asks."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.last = -1.0

    def report(self, done: float, total: float | None, message: str) -> None:
        import anyio.from_thread

        if self.ctx is None or done <= self.last:
            return
        self.last = done
        with contextlib.suppress(Exception):  # a client gone, or no token: nothing to tell
            anyio.from_thread.run(self.ctx.report_progress, done, total, message)


class IngestProgress(UI):
    """An ingest's encoding as progress notifications: tokens encoded of the total."""

    def __init__(self, progress: Notifications):
        self.progress, self.total, self.done = progress, 0, 0

    def start_encoding(self, total_tokens: int, workers: int) -> None:
        self.total = total_tokens
        self.progress.report(0.0, total_tokens, f"encoding {total_tokens:,} tokens")

    def advance(self, tokens: int) -> None:
        self.done += tokens
        self.progress.report(self.done, self.total or None,
                             f"encoded {self.done:,} of {self.total:,} tokens")


def _failure(error: api.StarqaError) -> Exception:
    """A StarqaError as the tool's error result (what the agent reads)."""
    ToolError = _sdk()[2]
    return ToolError(f"{error}\nhint: {error.hint}" if error.hint else str(error))


def describe(context: api.Context) -> dict[str, Any]:
    """A context as its resource reads: its facts, with its files and skipped files."""
    return {**context.as_dict(), "files": list(context.files),
            "skipped": [{"path": path, "reason": why} for path, why in context.skipped]}


class Tools:
    """The tools, over one `doors.Service`; blocking work runs in a thread of its own."""

    def __init__(self, service: doors.Service):
        self.service = service

    async def list_contexts(self) -> list[dict[str, Any]]:
        """The ingested contexts, the most recently used first: each one's `ref` (what
        `ask` takes as `context`), name, tokens, model, method and sources."""
        import anyio

        return [c.as_dict() for c in await anyio.to_thread.run_sync(self.service.contexts)]

    async def ingest(self, path: str, name: str | None = None, model: str | None = None,
                     method: str | None = None, include: list[str] | None = None,
                     exclude: list[str] | None = None,
                     ctx: ToolContext = None) -> dict[str, Any]:
        """Pack a folder (or file) into a context and encode it, or find it cached
        (`cache_hit`). Inside a git work tree, what git tracks; elsewhere .gitignore is
        honoured. `include`/`exclude`: glob patterns; `name`: the context's name (default:
        the folder's); `model`, `method`: as `starqa ingest --model/--method`."""
        import anyio

        def run() -> api.Context:
            return self.service.ingest(path, name=name, model=model, method=method,
                                       options=api.IngestSettings(include=include or (),
                                                                  exclude=exclude or ()),
                                       ui=IngestProgress(Notifications(ctx)))

        try:
            return describe(await anyio.to_thread.run_sync(run))
        except api.StarqaError as error:
            raise _failure(error) from None

    async def ask(self, question: str, context: str | None = None,
                  max_new_tokens: int = api.DEFAULT_MAX_NEW_TOKENS,
                  ctx: ToolContext = None) -> dict[str, Any]:
        """Answer a question from an ingested context (`context`: its ref or name; default:
        the one used last): the answer, the files and lines it drew on (`sources`: `read`
        shows them), token counts and timings."""
        import anyio

        try:
            asked = api.Question(question, context, max_new_tokens=max_new_tokens)
            found = await anyio.to_thread.run_sync(self.service.context, context)
        except api.StarqaError as error:
            raise _failure(error) from None
        stream, progress = self.service.stream(asked, found), Notifications(ctx)

        def follow() -> api.Answer:  # the prefill's progress, then the answer's pieces
            prompt, pieces = 0, 0
            for item in iter(lambda: _next(stream), None):
                if isinstance(item, api.Progress):
                    prompt = item.total
                    progress.report(item.processed, item.total + max_new_tokens,
                                    f"read {item.processed:,} of {item.total:,} tokens")
                else:
                    pieces += 1
                    progress.report(prompt + pieces, prompt + max_new_tokens, "answering")
            return stream.result()

        try:
            answer = await anyio.to_thread.run_sync(follow, abandon_on_cancel=True)
        except api.StarqaError as error:
            raise _failure(error) from None
        finally:
            stream.close()  # the call was cancelled: so is the answer
        return answer.as_dict()

    async def search(self, pattern: str, context: str | None = None, regex: bool = False,
                     around: int = 2, paths: str | None = None,
                     limit: int = files.MAX_MATCHES) -> dict[str, Any]:
        """Find a string (or, with `regex`, a Python regular expression) in the context's
        files as ingested: each matching line as `at` ("path:line"), its text and `around`
        lines before and after, in file order, at most `limit`; `paths`: only files whose
        path matches this glob (e.g. "src/**/*.py")."""
        import anyio

        try:
            found = await anyio.to_thread.run_sync(
                lambda: files.search(context, pattern, regex, around, limit, paths=paths))
        except api.StarqaError as error:
            raise _failure(error) from None
        return {"matches": [{"at": f"{m.path}:{m.line}", **m.as_dict()} for m in found],
                "truncated": len(found) >= limit}

    async def read(self, path: str, context: str | None = None, start: int = 1,
                   end: int | None = None) -> dict[str, Any]:
        """A file's lines from the context, as ingested (`path` as `ask`'s sources and
        `search` name it): lines `start` to `end`, 1-based and inclusive (default: to its
        end, at most 2,000 lines), with its total number of lines."""
        import anyio

        try:
            return await anyio.to_thread.run_sync(
                lambda: files.read(context, path, start, end))
        except api.StarqaError as error:
            raise _failure(error) from None


def _next(stream: api.Stream):
    """The stream's next piece or progress report, None at its end."""
    try:
        return stream.next_event()
    except StopIteration:
        return None


def server(service: doors.Service):
    """The MCP server: the tools, and the contexts as resources."""
    MCPServer, ResourceSecurity, _ = _sdk()
    from mcp_types import Resource

    class Server(MCPServer):
        async def list_resources(self) -> list[Resource]:
            """The contexts there are now (not only those when the server started)."""
            import anyio

            found = await anyio.to_thread.run_sync(service.contexts)
            return [Resource(uri=URI_PREFIX + quote(c.ref, safe=""), name=c.ref,
                             title=f"{c.name} ({c.tokens:,} tokens, {c.model})",
                             description=f"starqa context of {', '.join(c.sources)}",
                             mime_type="application/json")
                    for c in found] + await super().list_resources()

    door = Server(name="starqa", instructions=INSTRUCTIONS)
    tools = Tools(service)
    for tool in (tools.list_contexts, tools.ingest, tools.ask, tools.search, tools.read):
        door.add_tool(tool, name=tool.__name__)

    @door.resource(URI_PREFIX + "{ref}", name="context", mime_type="application/json",
                   description="An ingested context: its facts, files and skipped files.",
                   security=ResourceSecurity(exempt_params={"ref"}))  # a name, not a path
    def read_context(ref: str) -> str:
        try:
            return json.dumps(describe(service.context(ref)), indent=1)
        except api.StarqaError as error:
            from mcp.server.mcpserver.exceptions import ResourceError

            raise ResourceError(str(error)) from None

    return door


def run(workers: int | None = None, keepalive: float = doors.DEFAULT_KEEPALIVE) -> None:
    """`starqa mcp`: serve MCP over stdin and stdout until the client closes them. The
    warm groups it starts have `workers` workers and exit `keepalive` idle seconds after
    their last question."""
    server(doors.Service(doors.GroupSettings(workers, keepalive))).run("stdio")


if __name__ == "__main__":  # python -m starqa.servers.mcp: `starqa mcp` with its defaults
    run()
