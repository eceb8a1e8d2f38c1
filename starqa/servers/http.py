"""starqa's OpenAI-compatible HTTP server (`starqa serve --http [HOST:]PORT`): the routes an
OpenAI client, an editor or a notebook calls, answered from cached contexts through
`starqa.doors.Service` (one warm group per context, answering its questions together).

    GET  /health                 {"status": "ok", "waiting", "answering", ...}, no key needed
    GET  /v1/models              the contexts, each a model whose id is its ref (name or key)
    GET  /v1/models/{id}
    POST /v1/chat/completions    `model` names the context; the last user message is the
                                 question, the turns before it its history; `stream` (SSE,
                                 `stream_options.include_usage`), `max_tokens`, `stop`
    POST /v1/completions         the same with a `prompt` (the question)
    POST /v1/responses           the same with an `input` (a question, or messages)

`starqa.servers.openai_shapes` reads the requests and writes the answers of each API. An
answer's sources and timings ride in a `starqa` field next to OpenAI's; `usage`'s cached
tokens are the context; a stream can carry the question's prefill progress
(`"return_progress": true`, llama.cpp's `prompt_progress`). Questions to one context from
many clients are answered together (its warm group batches them).
Sampling settings (temperature, top_p, seed, ...) are accepted and unused: answers are
greedy. System messages are accepted and unused: a context's prompt is fixed at ingest.
Errors are OpenAI's objects, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed request (`context_length_exceeded` for one that does not fit the window), 401
for a missing or wrong key, 404 `model_not_found` for an unknown context, 500 for a fault
on this side (a damaged shard, a worker that died); in a stream that has begun, the error
object is its last event.

It listens on loopback unless told otherwise; any other address needs an API key, which
every route but /health then checks (`Authorization: Bearer KEY`). A client that
disconnects, while it waits its turn or while its answer streams, withdraws or cancels it.

A web page in the user's browser can send requests to a loopback server too, so `Guard`
refuses (403) what only a page sends: a request from an origin the server was not told to
let in (`--allow-origin`; pages served from this machine's loopback addresses are let in,
as ollama lets them in), and, without a key, one addressed to a host name that is not this
machine's (a page's own name made to resolve to 127.0.0.1: DNS rebinding). Origins let in
get CORS headers (starlette's `CORSMiddleware`), so a browser app can read the answers.

starlette on uvicorn rather than the standard library's `http.server`: uvicorn parses HTTP
as a server facing a network must (keep-alive, chunked bodies, slow or broken clients) and
tells the application when a client disconnects even while nothing is being written (a
queued client, an answer in its prefill), which `http.server` learns only from a failed
write. Both are small, pure Python dependencies of starqa (and the MCP SDK's own).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import socket
from dataclasses import dataclass

from starqa import api
from starqa.api import doors
from starqa.servers import openai_shapes as shapes
from starqa.servers.openai_shapes import ApiError, invalid as _invalid

MAX_BODY_BYTES = 4 << 20
# pages served from this machine's loopback addresses, any port: let in without being named
LOOPBACK_ORIGIN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"


# ------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class HttpSettings:
    """Where to listen and the key clients must send (None: none)."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    origins: tuple[str, ...] = ()  # web pages let in besides loopback's ("*": every one)

    @classmethod
    def parse(cls, address: str, api_key: str | None = None,
              origins: str | None = None) -> HttpSettings:
        """`PORT`, `HOST:PORT` or `[IPv6]:PORT` (no host: 127.0.0.1); an empty key is none;
        `origins`: comma-separated `scheme://host[:port]`, or `*`."""
        host, sep, port = address.strip().rpartition(":")
        host = host.strip("[]") if sep else "127.0.0.1"
        if not port.isdigit() or int(port) > 65535 or not host:
            raise api.StarqaError(f"{address!r} is not an address to listen on.",
                                  hint="give PORT, HOST:PORT or [IPv6]:PORT, e.g. 8080 or "
                                       "127.0.0.1:8080")
        return cls(host, int(port), api_key or None, parse_origins(origins or ""))

    def check(self) -> None:
        """Refuse to serve beyond this machine without a key."""
        if self.api_key is None and not loopback(self.host):
            raise api.StarqaError(
                f"Listening on {self.host} lets other machines in; that needs an API key.",
                hint="pass --api-key KEY (or set STARQA_API_KEY); clients send it as "
                     "`Authorization: Bearer KEY`. Or listen on 127.0.0.1, the default")


def parse_origins(text: str) -> tuple[str, ...]:
    """The origins a comma-separated list names, each checked: `*`, `null`, or
    `scheme://host[:port]` as a browser sends it (no path, no trailing slash)."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    for origin in origins:
        if origin not in ("*", "null") and not re.fullmatch(
                r"[a-z][a-z0-9+.-]*://[^/\s?#]+", origin):
            raise api.StarqaError(
                f"{origin!r} is not a web page's origin.",
                hint="name it as the browser sends it, scheme and host (and port): "
                     "--allow-origin https://app.example.org,http://localhost:3000")
    return origins


def loopback(host: str) -> bool:
    """Whether `host` is this machine only: `localhost` or a loopback address (a host name
    could resolve anywhere: not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------- errors

def error_of(error: api.StarqaError, finding: bool = False) -> ApiError:
    """A StarqaError as the error an OpenAI client expects; `finding`: it came from
    finding the context the request's `model` names."""
    message = f"{error} (hint: {error.hint})" if error.hint else str(error)
    if isinstance(error, api.ContextNotFound):
        return ApiError(404, message, param="model", code="model_not_found")
    if isinstance(error, api.ContextLengthError):
        return ApiError(400, message, param="messages", code="context_length_exceeded")
    if finding and not isinstance(error, api.ShardError):  # an empty or ambiguous name
        return ApiError(400, message, param="model")
    return ApiError(500, message, kind="server_error")


# -------------------------------------------------------------------------------- guard

class Guard:
    """ASGI middleware that refuses what a web page in a browser could send unasked (see
    the module docstring): a request from an origin not let in, and, without a key, one
    addressed to a name that is not this machine's."""

    def __init__(self, app, settings: HttpSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (refusal := self.refusal(scope)) is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.settings.origins):
            return ApiError(
                403, f"Requests from web pages at {origin} are refused: any page open in a "
                     "browser could otherwise use this server. (hint: to let that page in, "
                     f"serve with --allow-origin {origin})", code="forbidden_origin")
        host = headers.get("host", "")
        if self.settings.api_key is None and not loopback(_host_name(host)):
            return ApiError(
                403, f"This server answers requests addressed to this machine only, not to "
                     f"{host!r}: a web page can give its own name this machine's address. "
                     "(hint: address it as 127.0.0.1 or localhost; or serve with --api-key "
                     "KEY, which clients then send)", code="forbidden_host")
        return None


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Whether a page at `origin` may use the server: one of `allowed` (or `*` among them),
    or a page served from this machine's loopback addresses."""
    return "*" in allowed or origin in allowed or \
        re.fullmatch(LOOPBACK_ORIGIN, origin) is not None


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (`[::1]:8080` → `::1`)."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# ------------------------------------------------------------------------------- requests

async def _body(request):
    """The request's JSON (ApiError 413 past MAX_BODY_BYTES, 400 when not JSON)."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is over {MAX_BODY_BYTES:,} bytes.")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise _invalid(f"We could not parse the JSON body of your request ({error}).") \
            from None


# ------------------------------------------------------------------------------- answers

GONE = object()  # what `_unless_gone` returns once the client has disconnected


async def _unless_gone(request, work, *args):
    """`await work(*args)`, or GONE once the client disconnects first (work is cancelled)."""
    import anyio

    outcome: dict = {}
    async with anyio.create_task_group() as group:
        async def run() -> None:
            try:
                outcome["value"] = await work(*args)
            except Exception as error:  # raised below, outside the task group
                outcome["error"] = error
            group.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value", GONE)


async def _next_event(stream: api.Stream) -> str | api.Progress | None:
    """The stream's next piece of text or report of the prefill's progress, None at its end
    (its thread waits, not the loop)."""
    import anyio

    def following() -> str | api.Progress | None:
        try:
            return stream.next_event()
        except StopIteration:
            return None

    return await anyio.to_thread.run_sync(following, abandon_on_cancel=True)


async def _result(stream: api.Stream) -> api.Answer:
    import anyio

    return await anyio.to_thread.run_sync(stream.result, abandon_on_cancel=True)


# ------------------------------------------------------------------------------- routes

class Routes:
    """The server's routes over one `doors.Service`."""

    def __init__(self, service: doors.Service, api_key: str | None):
        self.service = service
        self.api_key = api_key

    def check_key(self, request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "This server needs an API key: send `Authorization: Bearer "
                                "KEY`.", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", **self.service.health()})

    async def models(self, request):
        import anyio
        from starlette.responses import JSONResponse

        self.check_key(request)
        found = await anyio.to_thread.run_sync(self.service.contexts)
        return JSONResponse({"object": "list", "data": [_model(c) for c in found]})

    async def model(self, request):
        from starlette.responses import JSONResponse

        self.check_key(request)
        return JSONResponse(_model(await self._context(request.path_params["model"])))

    async def _context(self, ref: str) -> api.Context:
        import anyio

        try:
            return await anyio.to_thread.run_sync(self.service.context, ref)
        except api.StarqaError as error:
            raise error_of(error, finding=True) from None

    async def chat(self, request):
        return await self._answer(request, shapes.parse_chat)

    async def completions(self, request):
        return await self._answer(request, shapes.parse_completion)

    async def responses(self, request):
        return await self._answer(request, shapes.parse_response)

    async def _answer(self, request, parse):
        """A question in any of the APIs (`parse` reads its request): answered whole, or
        streamed as that API streams."""
        from starlette.responses import JSONResponse, Response, StreamingResponse

        self.check_key(request)
        call = parse(await _body(request))
        context = await self._context(call.model)
        stream = self.service.stream(call.question, context)
        try:
            done = await _unless_gone(request, _next_event if call.stream else _result, stream)
        except api.StarqaError as error:
            stream.close()
            raise error_of(error) from None
        if done is GONE:
            stream.close()
            return Response(status_code=204)  # nobody reads it
        shape = shapes.Shape(call, context)
        if not call.stream:
            return JSONResponse(shape.whole(done))
        return StreamingResponse(self._events(shape, stream, done),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, shape: shapes.Shape, stream: api.Stream,
                      first: str | api.Progress | None):
        """The answer as server-sent events in its API's shape: the start, the prefill's
        progress where asked for, the pieces, the end (with the `starqa` record). The client
        leaving cancels this (starlette), which stops the answer."""
        try:
            for line in shape.start():
                yield line
            item = first
            while item is not None:
                line = shape.piece(item) if isinstance(item, str) else shape.progress(item)
                if line is not None:
                    yield line
                item = await _next_event(stream)
            answer = stream.result()  # complete: the pieces have ended
            for line in shape.end(answer):
                yield line
        except api.StarqaError as error:
            yield shape.error(error_of(error).body)
        finally:
            stream.close()


def _model(context: api.Context) -> dict:
    return {"id": context.ref, "object": "model", "created": int(context.created),
            "owned_by": "starqa", "starqa": context.as_dict()}


def app(service: doors.Service, settings: HttpSettings = HttpSettings()):
    """The ASGI application: the routes behind the `Guard` and CORS, and every error as an
    OpenAI error object."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.routing import Route

    routes = Routes(service, settings.api_key)

    async def api_error(request, error: ApiError):
        return error.response()

    async def internal_error(request, error: Exception):  # a fault of starqa's own
        return ApiError(500, f"internal error: {type(error).__name__}: {error}",
                        kind="server_error").response()

    async def http_error(request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return ApiError(error.status_code, f"{request.method} {request.url.path}: "
                                           f"{error.detail}", code=code).response()

    return Starlette(routes=[
        Route("/health", routes.health),
        Route("/v1/models", routes.models),
        Route("/v1/models/{model:path}", routes.model),
        Route("/v1/chat/completions", routes.chat, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/responses", routes.responses, methods=["POST"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error,
                           Exception: internal_error}, middleware=[
        Middleware(Guard, settings=settings),
        Middleware(CORSMiddleware, allow_origins=settings.origins,
                   allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=("GET", "POST"),
                   allow_headers=("Authorization", "Content-Type"))])


# ------------------------------------------------------------------------------- serving

class HttpServer:
    """The server, listening from the moment it is made (so a busy port is an error now,
    and port 0 has its number); `run` serves until `stop` (or Ctrl-C)."""

    def __init__(self, settings: HttpSettings, service: doors.Service):
        import uvicorn

        settings.check()
        self.settings = settings
        self.sock = _listen(settings.host, settings.port)
        self.server = uvicorn.Server(uvicorn.Config(
            app(service, settings), log_config=None, log_level="warning",
            access_log=False, lifespan="off", timeout_graceful_shutdown=5))

    @property
    def url(self) -> str:
        """The base URL an OpenAI client is given (`.../v1`)."""
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    @property
    def started(self) -> bool:
        return self.server.started

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        return socket.create_server(address, family=family)
    except OSError as error:
        raise api.StarqaError(f"Cannot listen on {host}:{port} ({error}).",
                              hint="choose another port, or stop what listens there") from None


def serve(address: str, api_key: str | None = None, workers: int | None = None,
          keepalive: float = doors.DEFAULT_KEEPALIVE, on_ready=None,
          origins: str | None = None) -> None:
    """`starqa serve --http`: serve until Ctrl-C. `on_ready(url)` once listening; the warm
    groups it starts have `workers` workers and exit `keepalive` idle seconds after their
    last question (they outlive the server by as much); `origins`: the web pages let in
    besides loopback's (`parse_origins`)."""
    server = HttpServer(HttpSettings.parse(address, api_key, origins),
                        doors.Service(doors.GroupSettings(workers, keepalive)))
    if on_ready is not None:
        on_ready(server.url)
    server.run()
