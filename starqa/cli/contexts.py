"""The commands that make and keep contexts: `ingest` (with --watch and the warm group's
hand-over), `list`, `info`, `rm`, `cache` and `index`."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Annotated, Optional

import typer

from starqa import methods as method_registry  # pure Python: --help stays instant
from starqa.cli.options import (AnchorSize, AsJson, BeyondWindow, BlockSize, ChunkSize, ContextArg,
    Device, Dtype, Heuristic, Model, Nnodes, NodeRank, PassingSize, Positions, ProbeWindow, Rdzv,
    SinkSize, SummaryBudget, Workers, method_params)


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
    kv: Annotated[Optional[str], typer.Option(
        "--kv", envvar="STARQA_KV",
        help="The KV's precision, on disk and in Phase 2: float (the cache's dtype) or int8 "
             "(each key and value row int8 with an fp32 scale: about half the bytes). "
             "Default: float, or int8 where float would take more than half the memory.")
                  ] = None,
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
        help="Where the blocks are encoded: auto (in this process where a worker group "
             "would not pay for its start: one worker on the CPU, or a re-ingest's few "
             "blocks), process, or group.")] = "auto",
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
    from starqa.api import doors
    from starqa.cli.ui import as_text

    _ingest(doors.IngestOptions(
        paths=tuple(paths), model=model, method=method, block_size=block_size,
        anchor_size=anchor_size, workers=workers, name=name, dtype=dtype,
        max_file_bytes=max_file_size, include=tuple(include or ()), exclude=tuple(exclude or ()),
        beyond_window=beyond_window, reserve=reserve, force=force, nnodes=nnodes, index=index,
        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, device=device, encode_in=encode_in,
        oversubscribe=oversubscribe, kv=kv,
        command=_rerunnable("starqa " + shlex.join(a for a in sys.argv[1:] if a != "--watch")),
        method_params={**method_params(sink_size, heuristic, summary_budget, chunk_size,
                                       positions, passing_size, probe_window),
                       "question": as_text(question)}), watch)


def _ingest(opts, watch: bool) -> None:
    """`starqa ingest` with its options parsed: Phase 1 on screen, its report, a warm group
    of the context handed over to the new version; then, with --watch, the watching."""
    from dataclasses import replace

    from starqa.api import doors
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import RichUI, ingest_report

    if watch and opts.nnodes > 1:
        raise StarqaError("--watch re-ingests on this machine; it cannot run across machines.",
                          hint="drop --nnodes, or drop --watch")
    with RichUI() as ui:
        result = doors.ingest_with(opts, ui)
    ingest_report(result)
    _hand_over(result)
    if watch:
        _watch(replace(opts, force=False), result)


def _hand_over(result) -> None:
    """A warm group serving an earlier ingest of this context now serves the new one."""
    from starqa.api import doors
    from starqa.cli.ui import err, safe

    m = result.manifest
    for group in doors.hand_over(result):
        err.print(f"Warm group of {safe(m.name)} ({safe(group.key[:8])}) restarted for "
                  f"the new version ({m.key[:8]}).")


def _watch(opts, first) -> None:
    """`ingest --watch`'s loop (`doors.watch`): each re-ingest's report line, each error with
    its hint (watching goes on); Ctrl-C (or SIGTERM) stops cleanly."""
    from starqa.api import doors
    from starqa.cli.ui import RichUI, err, print_error, safe, watch_line

    latest = [first.manifest]

    def reingest() -> None:
        with RichUI() as ui:
            result = doors.ingest_with(opts, ui)
        err.print(watch_line(result))
        _hand_over(result)
        latest[0] = result.manifest

    err.print(f"Watching {safe(', '.join(opts.paths))} for changes (Ctrl-C stops).")
    try:
        doors.watch(opts, reingest, print_error)
    except KeyboardInterrupt:
        m = latest[0]
        err.print(f"Stopped watching; {safe(m.name)} is {m.key[:8]}, its last committed "
                  "ingest.")


def list_(as_json: AsJson = False) -> None:
    """List cached contexts, most recently used first.

    `*` marks the one `ask` uses without --context."""
    import time

    from starqa.api import doors

    found = doors.listing()
    latest = found.latest  # the one a plain `ask` uses, damaged or not: marked
    if as_json:
        print(json.dumps([{**s, "default": s is latest} for s in found.contexts + found.damaged],
                         indent=1))
        return
    from starqa.cli.ui import context_list

    context_list(found.contexts, time.time(), found.damaged, latest)


def info(
    name: Annotated[Optional[str], typer.Argument(
        metavar="NAME", help="Context name or key prefix (default: the one `ask` uses).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest.")] = False,
) -> None:
    """Show everything about one cached context.

    Sources, the command that made it, model, method, blocks, files, skipped files, timing."""
    import time

    from starqa.api import doors

    manifest = doors.find(name)
    if as_json:
        print(json.dumps({**manifest.to_json(), "dir": str(manifest.folder)}, indent=1))
        return
    from starqa.cli.ui import context_info

    context_info(manifest, doors.summary(manifest), time.time())


def rm(
    names: Annotated[Optional[list[str]], typer.Argument(
        metavar="NAME", help="Context names or key prefixes.", show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove every context.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask to confirm --all.")] = False,
) -> None:
    """Remove cached contexts and print the space freed."""
    from starqa.api import doors
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import removed_report

    if bool(names) == all_:
        raise StarqaError("Give the names of the contexts to remove, or --all (not both).",
                          hint="starqa list shows the names")
    if all_:
        targets = doors.all_contexts()
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
        targets = doors.resolved(names)
    removed_report(doors.remove_found(targets))  # their warm groups stopped first


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
    from starqa.api import doors
    from starqa.core import paths

    usage = doors.cache_usage()
    cleaned = None
    if clean:
        cleaned = doors.clean_cache(usage)
        usage = doors.cache_usage()
    found = doors.kernels()
    if as_json:
        built = {"state": found.state, "path": found.path and str(found.path),
                 "detail": found.detail}
        print(json.dumps({"home": str(paths.home()), **usage.as_dict(),
                          "cleaned_bytes": cleaned, "kernels": built}, indent=1))
        return
    from starqa.cli.ui import cache_report

    cache_report(paths.home(), usage, cleaned, found)


def index_(
    context: ContextArg = None,
    kind: Annotated[str, typer.Option(
        "--index", envvar="STARQA_INDEX", help="The index kind to (re)build: ivf or hnsw.")
    ] = "ivf",
) -> None:
    """Build, or rebuild, a context's indexes for top-k attention (ask --attention topk).

    One faiss index per block, layer and KV head, next to the shards, checksummed in the
    manifest; a damaged set is replaced whole."""
    from starqa.api import doors
    from starqa.core.errors import StarqaError
    from starqa.cli.ui import RichUI, err, safe

    if kind not in doors.INDEX_KINDS or kind == "flat":
        raise StarqaError(f"--index {kind!r} has no index files to build.",
                          hint="choose ivf or hnsw (flat searches the keys themselves)")
    manifest = doors.find(context)
    with RichUI(stream=False) as ui:
        manifest, built = doors.build_indexes(manifest, kind, ui)
    err.print(f"Built {len(built.files):,} {kind} indexes for {safe(manifest.name)} "
              f"({sum(f.bytes for f in built.files) / 2**20:,.1f} MiB, "
              f"{built.build_seconds:.1f} s) in {safe(manifest.folder / built.folder)}")
