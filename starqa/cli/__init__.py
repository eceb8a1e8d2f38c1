"""The `starqa` command line: thin commands over the Python API (`starqa.api`), drawn with
rich; `eval` and `bench` run the measurement tools beside it (`starqa.measure`).

The API, and the heavy imports (torch, transformers) inside the engine beneath it, are
imported inside the commands, so `--help` is instant. Every option can also come from a
`STARQA_*` environment variable.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
from typing import Annotated, Optional

import typer

from starqa import methods as method_registry  # pure Python: --help stays instant
from starqa.core import DEFAULT_KEEPALIVE  # a constant: nothing imported
from starqa.cli.options import (AllowOrigin, AnchorSize, ApiKey, AsJson, Attention, BenchLengths,
    BeyondWindow, BlockSize, ChunkSize, ContextArg, Device, Dtype, EvalLengths, Heuristic,
    HttpAddress, IndexKind, KeepAlive, KvOnDisk, MaxNewTokens, Model, Nnodes, NodeRank,
    PassingSize, Positions, ProbeWindow, Rdzv, SinkSize, SummaryBudget, TopKChoice, TopKOpt,
    TopKPrefill, TopKSchedule, TopKTail, Weights, Workers, compared, method_params, one_topk,
    topk_runs)

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Ask questions about documents and code too long for ordinary LLM "
                       "inference (Star Attention on torchrun workers).")

# The options several commands share are defined once, in starqa.cli.options.


def _name(name: str | None) -> str | None:
    """--name's check: a name is typed back (`--context NAME`, `rm NAME`), so it is text
    that can be typed: no control characters and no bytes that are not UTF-8."""
    from starqa.cli.ui import printable

    if name is not None and printable(name) != name:
        raise typer.BadParameter(f"'{printable(name)}' holds control characters or bytes "
                                 "that are not UTF-8; a name is typed back as --context NAME")
    return name


def _rerunnable(command: str) -> str:
    """`command` as hints quote it: run from the folder it was typed in, so that relative
    paths (to sources, a model folder) still work when the hint is pasted anywhere."""
    return f"cd {shlex.quote(os.getcwd())} && {command}"


@app.command()
def ingest(
    paths: Annotated[list[str], typer.Argument(help="Files and folders to pack into one context.")],
    model: Model = None,
    method: Annotated[str, typer.Option(envvar="STARQA_METHOD",
                                        help=method_registry.help_line())
                      ] = method_registry.DEFAULT,
    block_size: BlockSize = None,
    anchor_size: AnchorSize = None,
    sink_size: SinkSize = None,
    heuristic: Heuristic = None,
    summary_budget: SummaryBudget = None,
    chunk_size: ChunkSize = None,
    positions: Positions = None,
    passing_size: PassingSize = None,
    probe_window: ProbeWindow = None,
    question: Annotated[Optional[str], typer.Option(
        envvar="STARQA_QUESTION",
        help="apb: the question, when known before encoding: it joins every block's anchor "
             "and chooses what is passed on (the cache then favours that question).")] = None,
    workers: Workers = None,
    oversubscribe: Annotated[bool, typer.Option(
        "--oversubscribe", envvar="STARQA_OVERSUBSCRIBE",
        help="Start the --workers asked for even when they outnumber this machine's CPU "
             "cores or their copies of the model outgrow its memory.")] = False,
    name: Annotated[Optional[str], typer.Option(
        envvar="STARQA_NAME", callback=_name,
        help="Context name (default: the first path's name).")] = None,
    dtype: Dtype = None,
    max_file_size: Annotated[int, typer.Option(
        envvar="STARQA_MAX_FILE_SIZE", help="Skip files larger than this many bytes.")] = 1_000_000,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", "-i", envvar="STARQA_INCLUDE",
        help="Only files matching this glob (repeatable; the variable takes a space-separated "
             "list).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", "-x", envvar="STARQA_EXCLUDE",
        help="Skip files matching this glob (repeatable).")] = None,
    force: Annotated[bool, typer.Option("--force", envvar="STARQA_FORCE",
                                        help="Re-encode every block, even on a cache hit.")
                     ] = False,
    encode_in: Annotated[str, typer.Option(
        "--encode-in", envvar="STARQA_ENCODE_IN",
        help="Where a re-ingest encodes the blocks it cannot reuse: auto (in this process "
             "when blocks are reused and a worker group would not pay for its start), "
             "process, or group.")] = "auto",
    beyond_window: BeyondWindow = False,
    index: Annotated[Optional[str], typer.Option(
        "--index", envvar="STARQA_INGEST_INDEX",
        help="Also build top-k attention's indexes as the blocks are encoded: ivf or hnsw "
             "(default: none; `ask --attention topk` builds them on first use).")] = None,
    reserve: Annotated[Optional[int], typer.Option(
        envvar="STARQA_RESERVE", min=0,
        help="Tokens of the window kept free for a question and its answer: the context "
             "plus this must fit the window (default 512, at most a quarter of the "
             "window).")] = None,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    device: Device = "auto",
    watch: Annotated[bool, typer.Option(
        "--watch", envvar="STARQA_WATCH",
        help="Then keep watching: re-ingest incrementally a moment after files stop changing "
             "(edits to ignored files do nothing), a report line each time, a warm group "
             "handed over to the new version; Ctrl-C stops.")] = False,
) -> None:
    """Pack files into one context and encode it into cached KV shards (Phase 1)."""
    from starqa import api
    from starqa.cli.ui import as_text

    _ingest(api.IngestOptions(
        paths=tuple(paths), model=model, method=method, block_size=block_size,
        anchor_size=anchor_size, workers=workers, name=name, dtype=dtype,
        max_file_bytes=max_file_size, include=tuple(include or ()), exclude=tuple(exclude or ()),
        beyond_window=beyond_window, reserve=reserve, force=force, nnodes=nnodes, index=index,
        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, device=device, encode_in=encode_in,
        oversubscribe=oversubscribe,
        command=_rerunnable("starqa " + shlex.join(a for a in sys.argv[1:] if a != "--watch")),
        method_params={**method_params(sink_size, heuristic, summary_budget, chunk_size,
                                       positions, passing_size, probe_window),
                       "question": as_text(question)}), watch)


def _ingest(opts, watch: bool) -> None:
    """`starqa ingest` with its options parsed: Phase 1 on screen, its report, a warm group
    of the context handed over to the new version; then, with --watch, the watching."""
    from dataclasses import replace

    from starqa import api
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import RichUI, ingest_report

    if watch and opts.nnodes > 1:
        raise StarqaError("--watch re-ingests on this machine; it cannot run across machines.",
                          hint="drop --nnodes, or drop --watch")
    with RichUI() as ui:
        result = api.ingest_with(opts, ui)
    ingest_report(result)
    _hand_over(result)
    if watch:
        _watch(replace(opts, force=False), result)


def _hand_over(result) -> None:
    """A warm group serving an earlier ingest of this context now serves the new one."""
    from starqa import api
    from starqa.cli.ui import err, safe

    m = result.manifest
    for group in api.hand_over(result):
        err.print(f"Warm group of {safe(m.name)} ({safe(group.key[:8])}) restarted for "
                  f"the new version ({m.key[:8]}).")


def _watch(opts, first) -> None:
    """`ingest --watch`'s loop (`api.watch`): each re-ingest's report line, each error with
    its hint (watching goes on); Ctrl-C (or SIGTERM) stops cleanly."""
    from starqa import api
    from starqa.cli.ui import RichUI, err, print_error, safe, watch_line

    latest = [first.manifest]

    def reingest() -> None:
        with RichUI() as ui:
            result = api.ingest_with(opts, ui)
        err.print(watch_line(result))
        _hand_over(result)
        latest[0] = result.manifest

    err.print(f"Watching {safe(', '.join(opts.paths))} for changes (Ctrl-C stops).")
    try:
        api.watch(opts, reingest, print_error)
    except KeyboardInterrupt:
        m = latest[0]
        err.print(f"Stopped watching; {safe(m.name)} is {m.key[:8]}, its last committed "
                  "ingest.")


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question to answer from the context.")],
    context: Annotated[Optional[str], typer.Option(
        "--context", "-c", envvar="STARQA_CONTEXT",
        help="Context name or key (default: the one used last).")] = None,
    model: Model = None,
    workers: Workers = None,
    max_new_tokens: MaxNewTokens = 256,
    as_json: Annotated[bool, typer.Option("--json", envvar="STARQA_JSON",
                                          help="Print one JSON object.")] = False,
    cold: Annotated[bool, typer.Option(
        "--cold", envvar="STARQA_COLD",
        help="Start workers even when a warm group serves the context.")] = False,
    beyond_window: BeyondWindow = False,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    rdzv_endpoint: Rdzv = None,
    device: Device = "auto",
    weights: Weights = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
) -> None:
    """Answer a question from a cached context (Phase 2), streaming tokens.

    A cold ask answers as one worker when model and shards fit in memory (a process forked
    as the command started), which then stays for --keep-alive seconds as the context's
    warm group, so the next question needs no load."""
    from starqa import api
    from starqa.cli.ui import RichUI, answer_json, answer_stats, as_text

    opts = api.AskOptions(question=as_text(question), context=context, model=model,
                          workers=workers,
                          max_new_tokens=max_new_tokens, beyond_window=beyond_window,
                          nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                          device=device, warm=not cold, weights=weights,
                          keepalive=keepalive,
                          topk=one_topk(TopKChoice(attention, top_k, top_k_schedule, index,
                                                   kv_on_disk, top_k_prefill, top_k_tail)))
    with RichUI(stream=not as_json) as ui:
        answer = api.ask_with(opts, ui)
    if as_json:
        print(json.dumps(answer_json(answer), indent=1))
    else:
        answer_stats(answer)


# ---------------------------------------------------------------------------------------
# cache management

@app.command("list")
def list_(as_json: AsJson = False) -> None:
    """List cached contexts, most recently used first.

    `*` marks the one `ask` uses without --context."""
    import time

    from starqa import api

    found = api.listing()
    latest = found.latest  # the one a plain `ask` uses, damaged or not: marked
    if as_json:
        print(json.dumps([{**s, "default": s is latest} for s in found.contexts + found.damaged],
                         indent=1))
        return
    from starqa.cli.ui import context_list

    context_list(found.contexts, time.time(), found.damaged, latest)


@app.command()
def info(
    name: Annotated[Optional[str], typer.Argument(
        metavar="NAME", help="Context name or key prefix (default: the one `ask` uses).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest.")] = False,
) -> None:
    """Show everything about one cached context.

    Sources, the command that made it, model, method, blocks, files, skipped files, timing."""
    import time

    from starqa import api

    manifest = api.find(name)
    if as_json:
        print(json.dumps({**manifest.to_json(), "dir": str(manifest.folder)}, indent=1))
        return
    from starqa.cli.ui import context_info

    context_info(manifest, api.summary(manifest), time.time())


@app.command()
def rm(
    names: Annotated[Optional[list[str]], typer.Argument(
        metavar="NAME", help="Context names or key prefixes.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove every context.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask to confirm --all.")] = False,
) -> None:
    """Remove cached contexts and print the space freed."""
    from starqa import api
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import removed_report

    if bool(names) == all_:
        raise StarqaError("Give the names of the contexts to remove, or --all (not both).",
                          hint="starqa list shows the names")
    if all_:
        targets = api.all_contexts()
        if not targets:
            print("No contexts to remove.")
            return
        if not yes:
            if not sys.stdin.isatty():
                raise StarqaError(f"--all would remove {len(targets)} contexts.",
                                  hint="pass --yes to confirm when stdin is not a terminal")
            if not typer.confirm(f"Remove all {len(targets)} contexts?"):
                print("Nothing removed.")
                raise typer.Exit(1)
    else:  # every name resolved first, so a typo or an ambiguous prefix removes nothing
        targets = api.resolved(names)
    removed_report(api.remove(targets))  # their warm groups stopped first


@app.command()
def cache(
    clean: Annotated[bool, typer.Option(
        "--clean", help="Delete folders left by crashed or interrupted ingests and removals "
                        "(never those of a running process on this machine) and contexts "
                        "this starqa cannot read.")] = False,
    as_json: AsJson = False,
) -> None:
    """Show where the cache is and how big it is.

    Sizes of converted models and contexts, folders left by interrupted work, and contexts
    from an incompatible starqa."""
    from starqa import api
    from starqa.core import paths

    usage = api.cache_usage()
    cleaned = None
    if clean:
        cleaned = api.clean_cache(usage)
        usage = api.cache_usage()
    found = api.kernels()
    if as_json:
        built = {"state": found.state, "path": found.path and str(found.path),
                 "detail": found.detail}
        print(json.dumps({"home": str(paths.home()), **usage.as_dict(),
                          "cleaned_bytes": cleaned, "kernels": built}, indent=1))
        return
    from starqa.cli.ui import cache_report

    cache_report(paths.home(), usage, cleaned, found)


@app.command()
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

    def ready(info: dict) -> None:
        from starqa.cli.ui import err, safe

        ui._stop_status()
        name = safe(info["name"])
        stop_it = safe(f"starqa stop {shlex.quote(info['name'])}")
        if info.get("nodes") and not info["socket"]:
            err.print(f"Serving node {info['node']} of {info['nodes']} for {name} "
                      f"({info['key']}); ask and chat on the query host, "
                      f"{safe(info['query'])}. `{stop_it}` there ends the group.")
            return
        across = f" across {info['nodes']} machines" if info.get("nodes") else ""
        err.print(f"Serving {name} ({info['key']}) on {info['workers']} warm worker"
                  f"{'s' * (info['workers'] > 1)}{across} ({info['weights']} weights); "
                  + (f"idle exit after {keepalive:.0f} s" if keepalive > 0 else "no idle exit")
                  + f". Ctrl-C or `{stop_it}` ends it.")

    # SIGTERM (`kill`, a service manager) ends the group as Ctrl-C does, cleanup included,
    # and exits 143, the code of a process ended by SIGTERM (Ctrl-C's is 130); from the
    # first import on, so a SIGTERM while loading exits 143 as well.
    with _sigterm_exits(143):
        if http is not None:
            _serve_http(http, api_key, workers, keepalive, allow_origin)
            return
        from starqa import api
        from starqa.cli.ui import RichUI

        with RichUI() as ui:
            api.serve(api.ServeOptions(context=context, model=model, workers=workers,
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


@app.command("mcp")
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


@app.command()
def ps(as_json: AsJson = False) -> None:
    """Show running worker groups."""
    from starqa import api
    from starqa.cli.ui import groups_table

    groups = api.running_groups()
    if as_json:
        print(json.dumps(groups, indent=1))
    else:
        groups_table(groups)


@app.command()
def stop(
    contexts: Annotated[Optional[list[str]], typer.Argument(help="Context names or keys.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every running group.")] = False,
) -> None:
    """Stop warm worker groups."""
    from starqa import api
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import err, safe

    if not all_ and not contexts:
        raise StarqaError("Name the contexts whose workers to stop, or pass --all.",
                          hint="starqa ps shows them")
    groups, starting = api.stopping(None if all_ else contexts)
    # groups still loading (an ask or ingest just started one): stopped once they listen
    if starting:
        err.print(f"Waiting for {len(starting)} group{'s' * (len(starting) > 1)} still "
                  "starting, to stop {}.".format("them" if len(starting) > 1 else "it"))
        groups += api.wait_started(starting)
    if not groups:
        err.print("No matching worker group is running.")
    for group, outcome in api.stop_groups(groups):
        if outcome == "elsewhere":  # stopped from its query host
            err.print(f"Not stopped here: {safe(api.elsewhere(group))}")
        elif outcome == "died":  # without cleaning up (kill -9): its files are removed
            err.print(f"{safe(group['name'])} ({safe(group['key'])}) had already died; "
                      "removed the run file and socket it left.")
        else:
            err.print(f"Stopped {safe(group['name'])} ({safe(group['key'])})"
                      + (f" on its {group['nodes']} machines." if group.get("nodes") else "."))


@app.command()
def chat(
    context: ContextArg = None,
    workers: Workers = None,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    max_new_tokens: MaxNewTokens = 256,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
) -> None:
    """Interactive questions over a cached context, with warm workers."""
    from starqa.cli.repl import Chat

    code = Chat(context, workers, keepalive, max_new_tokens,
                one_topk(TopKChoice(attention, top_k, top_k_schedule, index, kv_on_disk,
                                    top_k_prefill, top_k_tail))).run()
    if code:  # a question or command of a script failed (each said why as it did)
        raise typer.Exit(code)


@app.command("index")
def index_(
    context: ContextArg = None,
    kind: Annotated[str, typer.Option(
        "--index", envvar="STARQA_INDEX", help="The index kind to (re)build: ivf or hnsw.")
    ] = "ivf",
) -> None:
    """Build, or rebuild, a context's indexes for top-k attention (ask --attention topk).

    One faiss index per block, layer and KV head, next to the shards, checksummed in the
    manifest; a damaged set is replaced whole."""
    from starqa import api
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import RichUI, err, safe

    if kind not in api.INDEX_KINDS or kind == "flat":
        raise StarqaError(f"--index {kind!r} has no index files to build.",
                          hint="choose ivf or hnsw (flat searches the keys themselves)")
    manifest = api.find(context)
    with RichUI(stream=False) as ui:
        manifest, built = api.build_indexes(manifest, kind, ui)
    err.print(f"Built {len(built.files):,} {kind} indexes for {safe(manifest.name)} "
              f"({sum(f.bytes for f in built.files) / 2**20:,.1f} MiB, "
              f"{built.build_seconds:.1f} s) in {safe(manifest.folder / built.folder)}")


@app.command()
def bench(
    methods: Annotated[Optional[str], typer.Option(
        envvar="STARQA_BENCH_METHODS",
        help="Methods, comma-separated (default: every method).")] = None,
    lengths: BenchLengths = "2k,4k,8k,16k,32k",
    workers: Annotated[str, typer.Option(
        "--workers", "-w", envvar="STARQA_BENCH_WORKERS",
        help="Worker counts, comma-separated (simulated hosts; may outnumber the cores).")
    ] = "1,2,4",
    model: Model = None,
    dtype: Dtype = None,
    new_tokens: Annotated[int, typer.Option(
        envvar="STARQA_BENCH_NEW_TOKENS",
        help="Tokens generated per run, for time to first token and per-token latency.")] = 16,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", envvar="STARQA_BENCH_JSON",
        help="Also write every measurement (per worker) to this JSON file.")] = None,
    device: Device = "auto",
    top_k: TopKOpt = None,
    index: IndexKind = None,
    top_k_schedule: TopKSchedule = None,
    kv_on_disk: KvOnDisk = False,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", envvar="STARQA_BENCH_ROUNDS",
        help="Phase 2 runs of exact and of each top-k, alternating; each reported by its "
             "run of median decode time (for a machine whose speed drifts).")] = 1,
) -> None:
    """Measure Phase 1 and Phase 2 of each method side by side on synthetic contexts.

    Phase 1 wall time, tokens/s, critical-path and total FLOPs, peak memory per worker,
    bytes communicated, shard size; Phase 2 time to first token and per-token latency
    (with --top-k, also of top-k attention against exact on the same context)."""
    from starqa.measure import bench as bench_mod

    topk = compared(TopKChoice(top_k=top_k, schedule=top_k_schedule, index=index,
                               kv_on_disk=kv_on_disk, prefill=top_k_prefill, tail=top_k_tail))
    _bench(bench_mod.options(methods, lengths, workers, model=model, dtype=dtype,
                             new_tokens=new_tokens, device=device, topk=topk, rounds=rounds),
           json_path)


def _bench(opts, json_path: str | None) -> None:
    """`starqa bench` with its options parsed: what it will run, the runs (a line each),
    the table, and the JSON file written after each run."""
    from pathlib import Path

    from starqa.measure import bench as bench_mod
    from starqa.cli.ui import RichUI, bench_notes, bench_table, err, safe

    _fetch_model(opts.model)
    plan = bench_mod.make_plan(opts)
    bench_notes(plan)
    result = bench_mod.run(plan, json_path=Path(json_path) if json_path else None,
                           new_ui=lambda: RichUI(stream=False), report=err.print)
    bench_table(result)
    if json_path:
        err.print(f"Wrote {safe(json_path)}")


@app.command("eval")
def eval_(
    model: Model = None,
    methods: Annotated[Optional[str], typer.Option(
        envvar="STARQA_EVAL_METHODS",
        help="Comma-separated methods to compare (default: every method starqa has); dense "
             "always runs, as the reference of retention.")] = None,
    tasks: Annotated[Optional[str], typer.Option(
        envvar="STARQA_EVAL_TASKS",
        help="Comma-separated tasks or groups (default: all): niah_single_1..3, "
             "niah_multikey_1..3, niah_multivalue, niah_multiquery, niah_files_1..2 (group: "
             "niah), vt, cwe, fwe, qa, repo_qa (questions about an installed package's code: "
             "$STARQA_EVAL_PACKAGE, default typer); with --edit: edit_changed, edit_unchanged "
             "(group: edit).")] = None,
    lengths: EvalLengths = None,
    samples: Annotated[int, typer.Option(
        "--samples", "-n", envvar="STARQA_EVAL_SAMPLES", min=1,
        help="Samples per task and length.")] = 4,
    seed: Annotated[int, typer.Option(envvar="STARQA_EVAL_SEED",
                                      help="Seed of the generated samples.")] = 0,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", envvar="STARQA_EVAL_JSON",
        help="Write the results here (default: $STARQA_HOME/evals/<time>-<model>.json).")] = None,
    dtype: Dtype = None,
    device: Device = "auto",
    weights: Weights = None,
    block_size: BlockSize = None,
    anchor_size: AnchorSize = None,
    sink_size: SinkSize = None,
    heuristic: Heuristic = None,
    summary_budget: SummaryBudget = None,
    chunk_size: ChunkSize = None,
    positions: Positions = None,
    passing_size: PassingSize = None,
    probe_window: ProbeWindow = None,
    attention: Attention = "exact",
    top_k: TopKOpt = None,
    top_k_schedule: TopKSchedule = None,
    index: IndexKind = None,
    top_k_prefill: TopKPrefill = None,
    top_k_tail: TopKTail = None,
    edit: Annotated[bool, typer.Option(
        "--edit", envvar="STARQA_EVAL_EDIT",
        help="Measure incremental re-ingest: a haystack of files is ingested, one file "
             "changes, and each method answers from an incremental re-ingest (\"star incr\") "
             "and a full one; tasks edit_changed, edit_unchanged (group: edit).")] = False,
) -> None:
    """Measure each method's accuracy, and its retention of dense accuracy, on generated
    long-context tasks (RULER-style: needles, variable tracking, word extraction, and
    questions over samples/), all in this process, offline and reproducible from --seed."""
    from starqa.measure.evals import runner

    topk = topk_runs(TopKChoice(attention, top_k, top_k_schedule, index,
                                prefill=top_k_prefill, tail=top_k_tail))
    _eval(runner.EvalOptions(
        model=model, methods=methods, tasks=tasks, lengths=lengths, samples=samples, seed=seed,
        json_path=json_path, dtype=dtype, device=device, weights=weights, block_size=block_size,
        anchor_size=anchor_size, command="starqa " + shlex.join(sys.argv[1:]), topk=topk,
        edit=edit, method_params=method_params(sink_size, heuristic, summary_budget, chunk_size,
                                               positions, passing_size, probe_window)))


def _eval(opts) -> None:
    """`starqa eval` with its options parsed: the plan on screen, the run with its progress
    (`kill` ends it as Ctrl-C does, and the JSON says so), the table and where the results
    are; an interrupted run exits 130."""
    from starqa.cli import eval_report as report
    from starqa.measure.evals import runner

    _fetch_model(opts.model)
    plan = runner.plan(opts)
    report.plan_report(plan)
    with _sigterm_interrupts(), report.RichProgress() as progress:
        results = runner.run(plan, progress)
    report.results_table(results)
    report.closing_report(results, plan.json_path)
    if results["status"] == "interrupted":
        sys.exit(130)  # not typer.Exit(130): main would take it for an unreported Ctrl-C


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM stops as Ctrl-C does while inside; the handler before it comes back after
    (a caller in the same process, as tests are, and the processes it forks, keep theirs)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fetch_model(spec: str | None) -> None:
    """An embedded model fetched (first use) with its progress on screen, before a command
    whose own display would otherwise hide a minutes-long download."""
    from starqa import api
    from starqa.cli.ui import RichUI

    with RichUI(stream=False) as ui:
        api.fetch_model(spec, ui)


def run() -> None:
    """The `starqa` command: `main`, then a quick exit. Once torch is imported, the
    interpreter's own teardown (freeing every module, torch's static state) takes another
    0.4-0.6 s after the answer is out. By the time `main` returns, every file starqa wrote
    is closed and renamed into place, so the exit runs the atexit hooks, flushes the
    streams and ends the process without the teardown. A non-daemon thread still running
    gets the ordinary exit, which waits for it."""
    import atexit
    import threading

    from starqa.core import gcpause

    gcpause.pause()  # until the model is loaded: a cold answer's first token sooner
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if "torch" not in sys.modules or others:
        sys.exit(code)
    if not isinstance(code, int):  # sys.exit("message") or sys.exit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`starqa ask ... | head -1`)
            pass
    os._exit(code)


def main() -> None:
    from starqa.core.errors import StarqaError, disk_full

    as_json = wants_json(sys.argv[1:])
    try:
        # Without standalone mode, typer hands back typer.Exit's code, and Ctrl-C as 130,
        # instead of raising them.
        with _sigterm_interrupts():
            code = app(standalone_mode=False)
    except StarqaError as err:
        _fail(err, 1, as_json)
    except KeyboardInterrupt:
        code = 130
    except OSError as err:
        from starqa.core.paths import read_only

        if (known := disk_full(err, "starqa") or read_only(err)) is None:
            _unexpected(err, as_json)
        _fail(known, 1, as_json)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as err:  # usage errors: bad option, missing argument
        err.show()
        if as_json:
            _json_error(err.format_message() if hasattr(err, "format_message") else str(err),
                        _help_command(sys.argv[1:]))
        sys.exit(err.exit_code)
    except Exception as err:
        _unexpected(err, as_json)
    if code == 130:
        print("\ninterrupted; nothing was changed on disk", file=sys.stderr)
        if as_json:
            _json_error("interrupted; nothing was changed on disk", None)
    if isinstance(code, int) and code:
        sys.exit(code)


# Commands whose --json makes their result one JSON object on stdout (bench's and eval's
# --json name a file to write instead).
JSON_COMMANDS = frozenset({"ask", "list", "info", "cache", "ps"})


def _options(args: list[str]) -> tuple[str | None, list[str]]:
    """(the command, the words before `--`) of a command line, before it is parsed."""
    words = args[:args.index("--")] if "--" in args else args
    return next((w for w in words if not w.startswith("-")), None), words


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON on stdout (`--json`, or STARQA_JSON for
    `ask`), read from the words before they are parsed, so that an option the parser
    refuses is still answered in JSON."""
    command, words = _options(args)
    if command not in JSON_COMMANDS:
        return False
    return "--json" in words or (command == "ask" and os.environ.get(
        "STARQA_JSON", "").strip().lower() in ("1", "true", "t", "yes", "y", "on"))


def _help_command(args: list[str]) -> str:
    """`starqa ask --help`: the help of the command a usage error is about."""
    command, _ = _options(args)
    return f"starqa {command} --help" if command in JSON_COMMANDS else "starqa --help"


def _json_error(message: str, hint: str | None) -> None:
    """`{"error": ..., "hint": ...}` on stdout: what a script reading --json output gets
    instead of a result (the human message stays on stderr)."""
    with contextlib.suppress(OSError, ValueError):  # stdout closed: stderr said it
        print(json.dumps({"error": message, "hint": hint}, indent=1), flush=True)


def _fail(error, code: int, as_json: bool):
    """A StarqaError reported (stderr; and stdout in JSON with --json), then exit `code`."""
    from starqa.cli.ui import print_error

    print_error(error)
    if as_json:
        _json_error(str(error), error.hint)
    sys.exit(code)


def _unexpected(error: BaseException, as_json: bool):
    """A fault of starqa's own: its traceback, as ever; with --json also a JSON error on
    stdout, so that a script never reads an empty result."""
    if not as_json:
        raise error
    import traceback

    traceback.print_exception(error, file=sys.stderr)
    _json_error(f"internal error: {type(error).__name__}: {error}", None)
    sys.exit(1)
