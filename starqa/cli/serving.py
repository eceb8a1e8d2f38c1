"""The commands of warm groups: `serve` (a context's group, or with --http every context
behind the OpenAI chat API), `mcp`, `ps` and `stop`."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from typing import Annotated, Optional

import typer

from starqa.core import DEFAULT_KEEPALIVE  # a constant: nothing imported
from starqa.cli.options import (AllowOrigin, ApiKey, AsJson, Attention, ContextArg, Device,
    HttpAddress, IndexKind, KeepAlive, KvOnDisk, Model, Nnodes, NodeRank, Rdzv, TopKChoice,
    TopKOpt, TopKPrefill, TopKSchedule, TopKTail, Weights, Workers, one_topk)


def serve(
    context: ContextArg = None,
    model: Model = None,
    workers: Workers = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    device: Device = "auto",
    weights: Weights = None,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    http: HttpAddress = None,
    api_key: ApiKey = None,
    allow_origin: AllowOrigin = None,
) -> None:
    """Keep a worker group warm for a context; `ask` and `chat` use it while it runs (across
    machines: on the query host, the machine of the last node rank). With --http, serve every
    context through the OpenAI chat API instead."""

    def ready(info) -> None:  # an doors.RunInfo
        from starqa.cli.ui import err, safe

        ui._stop_status()
        name = safe(info.name)
        stop_it = safe(f"starqa stop {shlex.quote(info.name)}")
        if info.across and not info.socket:
            err.print(f"Serving node {info.node} of {info.nodes} for {name} "
                      f"({info.key}); ask and chat on the query host, "
                      f"{safe(info.query)}. `{stop_it}` there ends the group.")
            return
        across = f" across {info.nodes} machines" if info.across else ""
        err.print(f"Serving {name} ({info.key}) on {info.workers} warm worker"
                  f"{'s' * (info.workers > 1)}{across} ({info.weights} weights); "
                  + (f"idle exit after {keepalive:.0f} s" if keepalive > 0 else "no idle exit")
                  + f". Ctrl-C or `{stop_it}` ends it.")

    # SIGTERM (`kill`, a service manager) ends the group as Ctrl-C does, cleanup included,
    # and exits 143, the code of a process ended by SIGTERM (Ctrl-C's is 130); from the
    # first import on, so a SIGTERM while loading exits 143 as well.
    with _sigterm_exits(143):
        if http is not None:
            _serve_http(http, api_key, workers, keepalive, allow_origin)
            return
        from starqa.api import doors
        from starqa.cli.ui import RichUI

        with RichUI() as ui:
            doors.serve(doors.ServeOptions(context=context, model=model, workers=workers,
                                       keepalive=keepalive, device=device, weights=weights,
                                       topk=one_topk(TopKChoice(
                                           attention, top_k, top_k_schedule, index,
                                           kv_on_disk, top_k_prefill, top_k_tail)),
                                       nnodes=nnodes, node_rank=node_rank,
                                       rdzv_endpoint=rdzv_endpoint), ui, ready)


def _serve_http(address: str, api_key: str | None, workers: int | None,
                keepalive: float, origins: str | None) -> None:
    """`serve --http`: the OpenAI-compatible server (starqa.servers.http) until Ctrl-C."""
    from starqa.cli.ui import err, safe
    from starqa.servers import http

    http.serve(address, api_key, workers, keepalive, origins=origins,
               on_ready=lambda url: err.print(
                   f"Serving the OpenAI chat API at {safe(url)}: every context is a model "
                   "(GET /v1/models). Ctrl-C ends it."))


def mcp_(
    workers: Workers = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
) -> None:
    """Serve MCP on stdin and stdout, for coding agents: the tools list_contexts, ingest and
    ask (answers with their sources and timings), and each context as a resource."""
    from starqa.servers import mcp

    mcp.run(workers, keepalive)


@contextlib.contextmanager
def _sigterm_exits(code: int):
    """Inside, SIGTERM unwinds as Ctrl-C does (every `finally` runs), then the command exits
    with `code` and says so; the handler before it comes back after."""
    terminated: list[bool] = []

    def on_sigterm(signum, frame) -> None:
        terminated.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        if not terminated:
            raise
        print("stopped by SIGTERM", file=sys.stderr)
        sys.exit(code)
    finally:
        signal.signal(signal.SIGTERM, previous)


def ps(as_json: AsJson = False) -> None:
    """Show running worker groups."""
    from starqa.api import doors
    from starqa.cli.ui import groups_table

    groups = doors.running_groups()
    if as_json:
        print(json.dumps(groups, indent=1))
    else:
        groups_table(groups)


def stop(
    contexts: Annotated[Optional[list[str]], typer.Argument(help="Context names or keys.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every running group.")] = False,
) -> None:
    """Stop warm worker groups."""
    from starqa.api import doors
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import err, safe

    if not all_ and not contexts:
        raise StarqaError("Name the contexts whose workers to stop, or pass --all.",
                          hint="starqa ps shows them")
    groups, starting = doors.stopping(None if all_ else contexts)
    # groups still loading (an ask or ingest just started one): stopped once they listen
    if starting:
        err.print(f"Waiting for {len(starting)} group{'s' * (len(starting) > 1)} still "
                  "starting, to stop {}.".format("them" if len(starting) > 1 else "it"))
        groups += doors.wait_started(starting)
    if not groups:
        err.print("No matching worker group is running.")
    for group, outcome in doors.stop_groups(groups):
        if outcome == "elsewhere":  # stopped from its query host
            err.print(f"Not stopped here: {safe(doors.elsewhere(group))}")
        elif outcome == "died":  # without cleaning up (kill -9): its files are removed
            err.print(f"{safe(group.name)} ({safe(group.key)}) had already died; "
                      "removed the run file and socket it left.")
        else:
            err.print(f"Stopped {safe(group.name)} ({safe(group.key)})"
                      + (f" on its {group.nodes} machines." if group.across else "."))
