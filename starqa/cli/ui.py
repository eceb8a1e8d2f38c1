"""Terminal output: spinners, the encoding progress bar, streamed answers, reports.

Progress and reports go to stderr; the answer alone goes to stdout, so `starqa ask ... >
answer.txt` captures just the answer. `list`, `info`, `rm` and `cache` print their result
to stdout. Every command that draws progress (ask, ingest, chat, ...), and `info` and
`cache`, first warns where starqa's compiled kernels are missing or stale.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from starqa import methods
from starqa.api import Answer, Source, doors
from starqa.api.doors import CacheUsage, Damaged, IngestResult, KernelStatus, Manifest
from starqa.core.progress import UI, ProgressLog
from starqa.methods import MethodConfig

MIN_WIDTH = 20  # columns: words stay whole on the narrowest terminal (the terminal wraps)


class _Console(Console):
    """rich's Console, never narrower than MIN_WIDTH: with COLUMNS=0 rich drew nothing at
    all, errors included, and on a 1-column terminal one character a line."""

    @property
    def size(self) -> ConsoleDimensions:
        width, height = Console.size.fget(self)
        return ConsoleDimensions(max(width, MIN_WIDTH), height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


err = _Console(stderr=True, highlight=False)
out = _Console(highlight=False)  # a command's own result (answers, tables): stdout


# ---------------------------------------------------------------------------------------
# untrusted text: every path, name, command and answer starqa prints comes from data

_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# C0 and C1 controls and DEL (escape sequences, bells, carriage returns), bidi embeddings,
# overrides and isolates (text that reads in another order than it runs), the Unicode line
# and paragraph separators, and the lone surrogates a file name's undecodable bytes become
# (os.fsdecode; printing one raises UnicodeEncodeError): each shown as its escape.
_UNPRINTABLE = {c: _NAMED.get(chr(c), f"\\x{c:02x}")
                for c in (*range(0x20), *range(0x7F, 0xA0))}
_UNPRINTABLE |= {c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A),
                                               0x2028, 0x2029, *range(0xD800, 0xE000))}
# Answers keep their lines and tabs (and Markdown); a carriage return only overwrites.
_ANSWER = {c: e for c, e in _UNPRINTABLE.items() if chr(c) not in "\n\t"} | {ord("\r"): ""}


def printable(text: str, keep_newlines: bool = False) -> str:
    r"""`text` with each character that would act on the terminal, instead of showing,
    written as its escape: a file named `esc` ESC `[2J.md` prints as `esc\x1b[2J.md`, a
    newline in a name as `\n`, a right-to-left override as `\u202e`. With `keep_newlines`
    (answers) newlines and tabs stay and carriage returns go. Rich markup is not escaped
    here: `safe` does both, for text given to rich."""
    return str(text).translate(_ANSWER if keep_newlines else _UNPRINTABLE)


def as_text(typed: str | None) -> str | None:
    """What was typed (a question, from the command line or a pipe) as a model reads it:
    bytes that were not UTF-8 become U+FFFD (`doors.valid_text`)."""
    return None if typed is None else doors.valid_text(typed)


def print_table(table: Table, console: Console | None = None) -> None:
    """`table` on `console` (stdout's by default); where that is no terminal (a log, a pipe,
    CI), as wide as the table needs: rich would fit it to 80 columns, its cells cut to
    "…"."""
    console = console or out
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update_width(10_000), table).maximum
    Console(file=console.file, width=max(console.width, need), highlight=False).print(table)


def safe(text) -> str:
    """`text` as data inside rich markup: printable, and `[red]` prints as `[red]`."""
    return escape(printable(str(text)))


def stream_writer():
    """A function that shows an answer as its text arrives; call it with None at the end.

    On a terminal the text is rendered as Markdown, live; piped, it is written as plain
    text. Either way its control characters are shown escaped (`printable`).
    """
    if not sys.stdout.isatty():
        state = {"any": False}

        def plain(text: str | None) -> None:
            if text is None:
                if state["any"]:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                state["any"] = False
                return
            state["any"] = True
            sys.stdout.write(printable(text, keep_newlines=True))
            sys.stdout.flush()

        return plain

    from rich.live import Live
    from rich.markdown import Markdown
    from rich.segment import Segment, Segments

    # The answer is rendered whole, at most 12 times a second (as rich's own refresh: the
    # decode never waits on a render of a long answer); the lines that would scroll above
    # the screen, where a live display cannot reach to redraw them (it drew them again
    # below, once per redraw), are printed once above it instead: only the rest is live.
    state = {"text": "", "live": None, "done": 0, "drawn_at": 0.0}

    def lines_of(lines) -> Segments:
        return Segments([segment for line in lines for segment in (*line, Segment.line())])

    def draw() -> None:
        live, done = state["live"], state["done"]
        lines = out.render_lines(Markdown(state["text"]), out.options, pad=False)
        cut = len(lines) - max(out.size.height - 2, 1)  # the live part fits the screen
        if cut > done:
            live.console.print(lines_of(lines[done:cut]), end="")
            state["done"] = done = cut
        live.update(lines_of(lines[done:]), refresh=True)
        state["drawn_at"] = time.monotonic()

    def rendered(text: str | None) -> None:
        if text is None:
            if state["live"] is not None:
                draw()
                state["live"].stop()
            state.update(text="", live=None, done=0, drawn_at=0.0)
            return
        state["text"] += printable(text, keep_newlines=True)
        if state["live"] is None:
            state["live"] = Live(console=out, auto_refresh=False, vertical_overflow="visible")
            state["live"].start()
        if time.monotonic() - state["drawn_at"] >= 1 / 12:
            draw()

    return rendered


class RichUI(UI):
    def __init__(self, stream: bool = True):
        self.stream = stream
        self._status = None
        self._step = None  # the rich status of the step running (`status`), if any
        self._step_text = ""
        self._progress: Progress | None = None
        self._logged: ProgressLog | None = None  # encoding progress, where stderr is a log
        self._task = None
        self._write = stream_writer() if stream else None

    def __enter__(self):
        kernels_warning()
        return self

    def __exit__(self, *exc):
        self._stop_status()
        if self._progress is not None:
            self._progress.stop()
        if self._write is not None:
            self._write(None)

    @contextmanager
    def status(self, message: str):
        message = safe(message)
        if self._step is not None:  # a step inside a step: show it, then the outer again
            outer = self._step_text
            self._step.update(message)
            self._step_text = message
            try:
                yield
            finally:
                self._step.update(outer)
                self._step_text = outer
            return
        with err.status(message) as self._step:
            self._step_text = message
            try:
                yield
            finally:
                self._step = None

    def note(self, message: str) -> None:
        err.print(safe(message), highlight=False)

    def waiting(self, message: str) -> None:
        self._stop_status()
        self._status = err.status(safe(message))
        self._status.start()

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def start_encoding(self, total_tokens: int, workers: int) -> None:
        self._stop_status()
        if not err.is_terminal:  # a log: a plain line now and then (`ProgressLog`)
            self._logged = ProgressLog(total_tokens, time.monotonic())
            return
        self._progress = Progress(
            TextColumn(f"Encoding on {workers} worker{'s' * (workers > 1)}"), BarColumn(),
            TaskProgressColumn(), TextColumn("{task.completed:,}/{task.total:,} tokens"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=err, transient=True)
        self._progress.start()
        self._task = self._progress.add_task("encode", total=total_tokens, rate="")

    def advance(self, tokens: int) -> None:
        if self._logged is not None:
            if line := self._logged.advance(tokens, time.monotonic()):
                err.print(line, highlight=False)
            return
        if self._progress is None:
            return
        self._progress.advance(self._task, tokens)
        task = self._progress.tasks[0]
        if task.elapsed:
            self._progress.update(self._task, rate=f"{task.completed / task.elapsed:,.0f} tok/s")

    def token(self, text: str) -> None:
        self._stop_status()
        if self._write is not None and text:
            self._write(text)


@functools.cache
def kernels_warning() -> None:
    """Where starqa's compiled kernels are missing or stale (`doors.kernels`): a warning on
    stderr with the fix to paste, once per process (the answers are right, only slower);
    STARQA_REQUIRE_KERNELS=1 raises the error instead."""
    found = doors.kernels()
    if not found.ok:
        err.print(f"[yellow]warning:[/] {safe(found.message())}", soft_wrap=True)
        err.print(f"[yellow]hint:[/] {safe(found.hint())}", soft_wrap=True)


def print_sources(sources: Sequence[Source] | None, limit: int = 3) -> None:
    """`path:first-last (share)` for the files the answer copied from, or that none stands
    out (sources.top_sources); nothing for None (not tracked: top-k attention)."""
    if sources is None:
        return
    if not sources:
        err.print("[dim]sources: none stands out (the answer copied little from the "
                  "documents: it may come from the model's own knowledge)[/]")
        return
    parts = [f"{s.path}:{s.lines[0]}" + (f"-{s.lines[1]}" if s.lines[1] != s.lines[0] else "")
             + f" ({s.share:.0%})" for s in sources[:limit]]
    err.print("[dim]sources: " + safe(", ".join(parts)) + "[/]")


def ingest_report(result: IngestResult) -> None:
    m = result.manifest
    if m is None:
        err.print(f"This machine's {result.workers} workers encoded their blocks in "
                  f"{result.encode_seconds:.1f} s; node 0 commits the context.")
        return
    files = sorted(m.files, key=lambda f: f.token_end - f.token_start, reverse=True)
    if result.cache_hit:
        err.print(f"[green]Cache hit[/]: {safe(m.name)} ({m.key}) is already encoded with "
                  f"{safe(_method(m.method))} on {safe(m.model.name)}; nothing to do "
                  f"({result.seconds:.1f} s). Use --force to re-encode.")
        return
    if result.reuse is not None:
        err.print(reuse_line(m.name, result.reuse, result.seconds))
    err.print(f"[bold]Ingested[/] {safe(m.name)} ({m.key}): {len(m.files)} files, "
              f"{m.n_tokens:,} tokens, {len(m.blocks)} blocks on {result.workers} "
              f"worker{'s' * (result.workers > 1)}, method {safe(_method(m.method))}, "
              f"model {safe(m.model.name)}, {m.dtype}")
    per_worker = _blocks_per_worker(m.method, len(m.blocks), result.workers)
    err.print(f"Blocks per worker: {per_worker}")
    room, window = m.model.window - m.query_position, m.model.window  # its positions
    err.print(f"Room to ask: {room:,} of the model's {window:,} tokens are left for a question "
              "and an answer" if room > 0 else
              f"[yellow]No room to ask[/]: the context fills the model's {window:,}-token "
              "window; only `ask --beyond-window` can use it")
    err.print(f"Encoded in {result.encode_seconds:.1f} s "
              f"({m.n_tokens / max(result.encode_seconds, 1e-9):,.0f} tokens/s); "
              f"total {result.seconds:.1f} s; shards {_size(sum(b.bytes for b in m.blocks))} "
              f"in {safe(m.folder)}")
    table = Table(title="Largest files", box=None, title_justify="left")
    table.add_column("file")
    table.add_column("tokens", justify="right")
    table.add_column("lines", justify="right")
    for f in files[:5]:
        table.add_row(safe(f.path), f"{f.token_end - f.token_start:,}", f"{f.lines:,}")
    err.print(table)
    if m.skipped:
        err.print(f"Skipped {len(m.skipped)}:")
        for s in m.skipped[:20]:
            err.print(f"  {safe(s.path)}: {safe(s.reason)}")
        if len(m.skipped) > 20:
            err.print(f"  … and {len(m.skipped) - 20} more")


def watch_line(result: IngestResult) -> str:
    """`ingest --watch`'s line after each re-ingest: what was reused and encoded."""
    m = result.manifest
    if result.cache_hit:
        return (f"[green]Unchanged[/]: {safe(m.name)} ({m.key[:8]}): the files it reads are "
                f"as ingested ({result.seconds:.1f} s)")
    if result.reuse is not None:
        return reuse_line(m.name, result.reuse, result.seconds) + f" → {m.key[:8]}"
    return (f"[bold]Ingested[/] {safe(m.name)} ({m.key[:8]}): {len(m.blocks)} blocks, "
            f"{m.n_tokens:,} tokens in {result.seconds:.1f} s")


def reuse_line(name: str, r, seconds: float) -> str:
    """`Re-ingested repo: 12 blocks, 11 reused, 1 encoded (src/api.py changed; 1 file added,
    0 removed) in 3.2 s`, and why more was encoded when it is not plain (issue #14)."""
    done = [f"{r.reused} reused"] + [f"{r.rotated} moved (keys re-rotated)"] * bool(r.rotated)
    parts = [f"{r.blocks} blocks", *done, f"{r.encoded} encoded"
             + (" in this process" if r.in_process and r.encoded else "")]
    line = f"[bold]Re-ingested[/] {safe(name)}: {', '.join(parts)}"
    c = r.changes
    if c is not None:
        what = []
        if c.changed:
            shown = ", ".join(c.changed[:3]) + (f" and {len(c.changed) - 3} more"
                                                if len(c.changed) > 3 else "")
            what.append(f"{safe(shown)} changed")
        elif not (c.added or c.removed):
            what.append("no file changed")
        what.append(f"{len(c.added)} file{'s' * (len(c.added) != 1)} added, "
                    f"{len(c.removed)} removed")
        line += f" ({'; '.join(what)})"
    line += f" in {seconds:.1f} s"
    return line + (f"\n  {safe(r.why)}" if r.why else "")


def _blocks_per_worker(method: MethodConfig, n_blocks: int, workers: int) -> str:
    assignment = methods.get(method.name).assignment

    def span(mine: list[int]) -> str:
        if len(mine) > 1 and mine == list(range(mine[0], mine[-1] + 1)):
            return f"{mine[0]}-{mine[-1]}"
        return ",".join(map(str, mine)) or "none"

    return ", ".join(f"worker {r}: " + span(assignment(n_blocks, workers, r))
                     for r in range(workers))


def answer_stats(answer: Answer) -> None:
    if not answer.query_host:
        err.print("The answer streams on the machine holding the last block (the last node).")
        return
    n_new, t = answer.answer_tokens, answer.timings
    rate = (n_new - 1) / t.decode_s if t.decode_s and n_new > 1 else 0.0
    prefill = answer.question_tokens / t.prefill_s if t.prefill_s else 0.0
    workers = f"{answer.workers} {'warm ' * answer.warm}worker{'s' * (answer.workers > 1)}" + \
        (f" ({safe(answer.weights)})" if answer.weights else "") + \
        (f" · {answer.attention}" if answer.attention != "exact" else "")
    err.print(f"[dim]{safe(answer.context.name)} · {safe(answer.context.method)} · "
              f"{answer.context.tokens:,} cached + {answer.question_tokens} question tokens · "
              f"{workers} · first token {t.first_token_s:.2f} s · prefill {prefill:,.0f} tok/s · "
              f"decode {rate:.1f} tok/s ({n_new} tokens) · total {t.total_s:.1f} s[/]"
              if t.first_token_s is not None else
              f"[dim]no answer tokens ({t.total_s:.1f} s)[/]")
    if answer.sources is None:
        err.print("[dim]Sources: not tracked with top-k attention (ask with --attention exact "
                  "to see them).[/]")
        return
    print_sources(answer.sources)


# ---------------------------------------------------------------------------------------
# cache management: list, info, rm, cache (their output is the command's result: stdout)


LIST_COLUMNS = ("", "name", "key", "sources", "tokens", "method", "model", "size", "last used")


def context_list(summaries: Sequence[dict], now: float, damaged: Sequence[dict] = (),
                 latest: dict | None = None) -> None:
    """The contexts as a table, most recently used first, then the damaged ones (named, so
    that they can be removed); `*` marks `latest`, the one a plain `ask` uses."""
    if not summaries and not damaged:
        err.print("No ingested context yet. Run: starqa ingest PATH")
        return
    latest = latest or (summaries[0] if summaries else None)
    caption = "* the context `starqa ask` uses without --context; method: block/anchor tokens"
    if any(s["past_window"] for s in summaries):
        caption += ("\n! past the model's window (ingested with --beyond-window): only "
                    "`ask --beyond-window` answers from it")
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0),
                  caption=caption, caption_justify="left")
    for column, justify in zip(LIST_COLUMNS, ("left", "left", "left", "left", "right", "left",
                                              "left", "right", "right")):
        # Only the sources may wrap; every other column keeps its width.
        table.add_column(column, justify=justify, overflow="fold", no_wrap=column != "sources",
                         min_width=len(column) if column != "sources" else 12)
    rows = [("*" if s is latest else "", safe(s["name"]), safe(s["key"][:8]),
             _sources(s["sources"]),
             f"[yellow]{s['n_tokens']:,} ![/]" if s["past_window"] else f"{s['n_tokens']:,}",
             safe(_method_short(s["method"])), safe(s["model"]), _size(s["bytes"]),
             _ago(now - s["last_used"])) for s in summaries]
    rows += [("*" if d is latest else "", "[red]damaged[/]", safe(d["key"][:8]),
              safe(d["dir"]), "", "", "", _size(d["bytes"]), _ago(now - d["last_used"]))
             for d in damaged]
    for row in rows:
        table.add_row(*row)
    need = sum(12 if header == "sources" else  # the only column that wraps
               max(len(header), *(Text.from_markup(row[i]).cell_len for row in rows))
               for i, header in enumerate(LIST_COLUMNS)) + len(LIST_COLUMNS) - 1
    if not out.is_terminal:  # a log, a pipe: whole, however wide
        print_table(table)
    elif need <= out.width:
        out.print(table)
    else:  # too narrow: rich would drop whole columns (the `*` first), so a line each
        for mark, *cells in rows:
            cells[3] = f"{cells[3]} tokens" if cells[3] else ""
            out.print(" ".join([mark or " ", *(c.replace("\n", ", ") for c in cells if c)]),
                      soft_wrap=True)  # the terminal wraps it; rich would break it anywhere
        out.print(caption, soft_wrap=True)
    for d in damaged:
        err.print(f"[red]damaged[/] {safe(d['key'])}: {safe(d['damaged'])}")
    if damaged:
        err.print("Remove damaged contexts with `starqa rm KEY` or `starqa cache --clean`.")


def context_info(manifest: Manifest, summary: dict, now: float) -> None:
    """Everything useful in a context's manifest: identity, model, method, blocks, files
    (after a warning where the compiled kernels that would answer from it are missing or
    stale)."""
    kernels_warning()
    m, model, run = manifest, manifest.model, manifest.ingest
    model_text = (f"{model.name} (digest {model.digest[:12]}, window {model.window:,}, "
                  f"from {model.spec})")
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(m.created))
    ingest_text = (f"{run.workers} workers, {run.encode_seconds:.1f} s encoding, "
                   f"{run.tokens_per_second:,.0f} tokens/s")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    for label, value in (
            ("name", m.name), ("key", m.key), ("folder", m.folder),
            ("sources", m.sources), ("command", m.rerun),
            ("model", model_text), ("model path", model.path),
            ("method", _method(m.method)), ("dtype", m.dtype),
            ("tokens", f"{m.n_tokens:,} in {len(m.blocks)} blocks, {len(m.files)} files"
                       + (f" (past the model's {model.window:,}-token window: only `ask "
                          "--beyond-window` answers from it)" if m.past_window else "")),
            ("size", _size(summary["bytes"])),
            ("created", f"{created} ({_ago(now - m.created)})"),
            ("last used", _ago(now - summary["last_used"])), ("ingest", ingest_text)):
        lines = value if isinstance(value, tuple) else (value,)
        facts.add_row(label, "\n".join(safe(line) for line in lines))
    out.print(facts)
    out.print()
    blocks = _table("Blocks", ("block", "right"), ("tokens", "right"), ("range", "right"),
                    ("size", "right"), ("shard", "left"), ("files", "left"))
    for b in m.blocks:
        state = b.file if doors.shard_present(m, b.index) else \
            f"[red]{b.file} missing or wrong size[/]"
        held = [f.path for f in m.files if f.token_start < b.end and b.start < f.token_end]
        blocks.add_row(str(b.index), f"{b.end - b.start:,}",
                       f"{b.start:,}–{b.end:,}", _size(b.bytes), state,
                       safe(", ".join(held[:4]) + (f" +{len(held) - 4}" if len(held) > 4
                                                     else "")))
    out.print(blocks)
    out.print()
    files = _table("Files", ("file", "left"), ("tokens", "right"), ("range", "right"),
                   ("lines", "right"), ("bytes", "right"))
    for f in m.files:
        files.add_row(safe(f.path), f"{f.token_end - f.token_start:,}",
                      f"{f.token_start:,}–{f.token_end:,}", f"{f.lines:,}",
                      _size(f.bytes))
    out.print(files)
    if m.skipped:
        out.print()
        skipped = _table(f"Skipped ({len(m.skipped)})", ("file", "left"), ("reason", "left"))
        for s in m.skipped:
            skipped.add_row(safe(s.path), safe(s.reason))
        out.print(skipped)


def removed_report(removed: list[tuple[Manifest | Damaged, int]]) -> None:
    """One line per removed context (damaged ones by key) with the bytes it freed, then the
    total."""
    for context, freed in removed:
        name = "damaged context" if isinstance(context, Damaged) else context.name
        out.print(f"Removed {safe(name)} ({safe(context.key)}), freed {_size(freed)}")
    if len(removed) > 1:
        out.print(f"Removed {len(removed)} contexts, freed {_size(sum(f for _, f in removed))}")


def cache_report(home: Path, usage: CacheUsage, cleaned: int | None,
                 found: KernelStatus) -> None:
    """Where the cache lives, what takes its space, leftovers of interrupted work, and
    whether the compiled kernels are here (`found`; a warning where not)."""
    kernels_warning()
    out.print(f"Cache at {safe(str(home))}")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(justify="right")
    facts.add_column()
    facts.add_row("models", _size(usage.models_bytes), "")
    facts.add_row("contexts", _size(usage.contexts_bytes),
                  f"{usage.n_contexts} context{'s' * (usage.n_contexts != 1)}")
    if usage.leftovers:
        stale = [x for x in usage.leftovers if not x.running]
        facts.add_row("leftovers", _size(sum(x.bytes for x in usage.leftovers)),
                      f"{len(usage.leftovers)} folder{'s' * (len(usage.leftovers) > 1)}, "
                      f"{len(stale)} removable with --clean")
    facts.add_row("total", _size(usage.total_bytes), "")
    facts.add_row("kernels", found.state if found.ok else f"[yellow]{found.state}[/]",
                  safe(found.path or ""))
    out.print(facts)
    for x in usage.leftovers:
        out.print(f"  {safe(x.path.name)}  {_size(x.bytes)}  {safe(x.state)}")
    if cleaned is not None:
        out.print(f"Cleaned leftovers, freed {_size(cleaned)}")


def _table(title: str, *columns: tuple[str, str]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=None,
                  header_style="bold", pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify)
    return table


def _method(method: MethodConfig) -> str:
    """`apb (block 1,024, anchor 256, passing 128, window 64)`: every setting but token ids."""
    settings = [f"block {method.block_size:,}"]
    if method.name in methods.owners("anchor"):
        settings.append(f"anchor {method.anchor_size:,}")
    for key, value in method.params.items():
        if value is not None and key != "question_ids":
            text = str(value)
            settings.append(f"{key} {text if len(text) <= 40 else text[:39] + '…'}")
    return f"{method.name} ({', '.join(settings)})"


def _method_short(method: dict) -> str:
    """`star 1,024/1,024` (block/anchor) or `dense 1,024` (block)."""
    has_anchor = method["name"] in methods.owners("anchor")
    anchor = f"/{method['anchor_size']:,}" if has_anchor else ""
    return f"{method['name']} {method['block_size']:,}{anchor}"


def _sources(sources: list[str]) -> str:
    """The first two sources (the home folder as ~), one a line, as rich markup."""
    home = str(Path.home())
    short = [safe("~" + s[len(home):] if s == home or s.startswith(home + "/") else s)
             for s in sources]
    return "\n".join(short[:2]) + (f"\n+{len(short) - 2} more" if len(short) > 2 else "")


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0)
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' * (unit == 'day' and n > 1)} ago"
    return "just now" if seconds < 5 else f"{int(seconds)} s ago"


def print_error(error) -> None:
    """`error: ...` and `hint: ...` on stderr; the message keeps its lines (a worker's last
    lines), every other control is shown escaped."""
    message = escape(printable(str(error), keep_newlines=True))
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    if getattr(error, "hint", None):
        err.print(f"[yellow]hint:[/] {safe(error.hint)}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def groups_table(groups: list[dict]) -> None:
    """Running worker groups (`starqa ps`)."""
    import time

    if not groups:
        err.print("No worker group is running.")
        return
    table = Table(box=None)
    for column in ("context", "key", "workers", "here", "weights", "pid", "up", "answered",
                   "RSS (query host)", "keep-alive"):
        table.add_column(column)
    now = time.time()
    for g in groups:
        rss = f"{g['rss_bytes'] / 2**20:,.0f} MB" if "rss_bytes" in g else "?"
        # across machines: this one's node, and whether it is the query host (the socket)
        here = ("all" if not g.get("nodes") else
                f"node {g['node']} of {g['nodes']}"
                + (" (query host)" if g["socket"] else f"; asks go to {g['query']}"))
        table.add_row(safe(g["name"]), safe(g["key"]), str(g["workers"]), safe(here),
                      safe(g.get("weights", "?")),
                      str(g["pid"]), _ago(now - g["started"]).removesuffix(" ago"),
                      str(g.get("answered", "?")), rss,
                      f"{g['keepalive']:.0f} s" if g["keepalive"] > 0 else "never")
    print_table(table)


# ---------------------------------------------------------------------------------------
# starqa bench


def _topk_table(result: dict) -> None:
    """Phase 2 with top-k attention against exact, on the same contexts (stdout)."""
    rows = [(row, t) for row in result["rows"] for t in row.get("topk", ())]
    if not rows:
        return
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
    for name in ("method", "tokens", "workers", "attention", "k", "TTFT s", "ms/token",
                 "× exact", "peak MB", "× exact", "index MB", "build s"):
        table.add_column(name, justify="left" if name in ("method", "attention") else "right",
                         no_wrap=True)
    mb = 2**20
    for row, t in rows:
        exact = row["phase2"]
        per_token = exact["seconds_per_token"]
        if t is row["topk"][0]:  # the exact run first
            table.add_row(row["method"], f"{row['tokens']:,}", str(row["workers"]), "exact",
                          "all", f"{exact['first_token_seconds']:.2f}",
                          f"{per_token * 1e3:.1f}" if per_token is not None else "–", "1.00",
                          f"{exact['peak_bytes'] / mb:,.0f}", "1.00", "–", "–")
        per_token = t["seconds_per_token"]
        table.add_row("", "", "", t["attention"], f"{t['k']:,}",
                      f"{t['first_token_seconds']:.2f}",
                      f"{per_token * 1e3:.1f}" if per_token is not None else "–",
                      f"{t['decode_vs_exact']:.2f}" if t["decode_vs_exact"] else "–",
                      f"{t['peak_bytes'] / mb:,.0f}",
                      f"{t['peak_vs_exact']:.2f}" if t["peak_vs_exact"] else "–",
                      f"{t['index_bytes'] / mb:,.1f}", f"{t['index_build_seconds']:.1f}")
    out.print()
    out.print("[bold]Phase 2: top-k attention against exact[/] (same context and workers; "
              "peak: the largest worker's max RSS; index: files on disk, built once)")
    print_table(table)


def bench_notes(plan) -> None:
    """What the run will do, said before it starts (stderr)."""
    opts = plan.opts
    err.print(f"[bold]starqa bench[/]: {', '.join(opts.methods)} · "
              f"{', '.join(f'{n:,}' for n in opts.lengths)} tokens · workers "
              f"{', '.join(map(str, opts.workers))} · {safe(plan.model_name)} · {plan.cores} "
              f"core{'s' * (plan.cores > 1)}")
    for note in plan.notes:
        err.print(f"[dim]note:[/] {safe(note)}")


def bench_table(result: dict) -> None:
    """One row per run, then critical-path FLOPs against star (stdout)."""
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
    for name in ("method", "tokens", "workers", "P1 s", "P1 tok/s", "crit GFLOP",
                 "total GFLOP", "peak MB", "P1 comm MB", "shards MB", "TTFT s", "ms/token"):
        table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    mb = 2**20
    for row in result["rows"]:
        p1, p2 = row["phase1"], row["phase2"]
        per_token = p2["seconds_per_token"]
        table.add_row(row["method"], f"{row['tokens']:,}", str(row["workers"]),
                      f"{p1['seconds']:.1f}", f"{p1['tokens_per_second']:,.0f}",
                      f"{p1['critical_path_flops'] / 1e9:,.1f}",
                      f"{p1['total_flops'] / 1e9:,.1f}", f"{p1['peak_bytes'] / mb:,.0f}",
                      f"{p1['sent_bytes'] / mb:,.1f}", f"{row['shard_bytes'] / mb:,.1f}",
                      f"{p2['first_token_seconds']:.2f}",
                      f"{per_token * 1e3:.0f}" if per_token is not None else "–")
    print_table(table)
    cpu = result["environment"].get("cpu")
    if cpu:
        out.print(f"[dim]CPU: {safe(cpu['model'])} ({', '.join(cpu['flags']) or 'no avx2'})[/]")
    out.print("[dim]P1: Phase 1. s, tok/s, crit: the slowest worker (the critical path); "
              "total: all workers;\npeak: the largest worker's max RSS (GPU memory on CUDA); "
              "comm: payload all workers sent;\nTTFT: question prefill to first token on "
              "loaded workers; ms/token: each token after it.[/]")
    _topk_table(result)
    if result["ratios"]:
        names = list(dict.fromkeys(k for r in result["ratios"] for k in r if "/" in k))
        ratios = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
        for name in ("tokens", "workers", *names):
            ratios.add_column(name, justify="right")
        for r in result["ratios"]:
            ratios.add_row(f"{r['tokens']:,}", str(r["workers"]),
                           *(f"{r[n]:.2f}" if n in r else "–" for n in names))
        out.print()
        out.print("[bold]Critical-path FLOPs relative to star[/] (same length and workers"
                  + ("; dense: its one worker against star's slowest" if "dense/star" in names
                     else "") + ")")
        print_table(ratios)
