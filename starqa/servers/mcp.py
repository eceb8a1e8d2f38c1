"""starqa's MCP server (`starqa mcp`): a coding agent's door to cached contexts, over stdio
with the official MCP SDK, thin over `starqa.doors.Service`.

Tools:
    list_contexts()                       the contexts, the most recently used first
    ingest(path, name, model, method, include, exclude)
                                          encode a folder or files (or find them cached)
    ask(question, context, max_new_tokens)
                                          the answer, its sources (files and lines) and timings

Resources: each context as `starqa://contexts/{ref}` (JSON: its facts, files and skipped
files). Questions are answered by the context's warm group, started on the first one and
kept `keepalive` idle seconds after the last, so an agent's next run finds it warm; the KV
cache itself persists across runs. A StarqaError is the tool's error result, its message
and hint as the CLI prints them.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from starqa import api
from starqa.api import doors

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
                     exclude: list[str] | None = None) -> dict[str, Any]:
        """Pack a folder (or file) into a context and encode it, or find it cached
        (`cache_hit`). Inside a git work tree, what git tracks; elsewhere .gitignore is
        honoured. `include`/`exclude`: glob patterns; `name`: the context's name (default:
        the folder's); `model`, `method`: as `starqa ingest --model/--method`."""
        import anyio

        def run() -> api.Context:
            return self.service.ingest(path, name=name, model=model, method=method,
                                       options=api.IngestSettings(include=include or (),
                                                                  exclude=exclude or ()))

        try:
            return describe(await anyio.to_thread.run_sync(run))
        except api.StarqaError as error:
            raise _failure(error) from None

    async def ask(self, question: str, context: str | None = None,
                  max_new_tokens: int = api.DEFAULT_MAX_NEW_TOKENS) -> dict[str, Any]:
        """Answer a question from an ingested context (`context`: its ref or name; default:
        the one used last): the answer, the files and lines it drew on (`sources`), token
        counts and timings."""
        import anyio

        try:
            asked = api.Question(question, context, max_new_tokens=max_new_tokens)
            found = await anyio.to_thread.run_sync(self.service.context, context)
        except api.StarqaError as error:
            raise _failure(error) from None
        stream = self.service.stream(asked, found)
        try:
            answer = await anyio.to_thread.run_sync(stream.result, abandon_on_cancel=True)
        except api.StarqaError as error:
            raise _failure(error) from None
        finally:
            stream.close()  # the call was cancelled: so is the answer
        return answer.as_dict()


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
    for tool in (tools.list_contexts, tools.ingest, tools.ask):
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
