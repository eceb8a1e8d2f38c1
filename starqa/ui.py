"""Terminal output: spinners, the encoding progress bar, streamed answers, reports.

Progress and reports go to stderr; the answer alone goes to stdout, so `starqa ask ... >
answer.txt` captures just the answer.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from starqa.engine import UI, Answer, IngestResult

err = Console(stderr=True, highlight=False)


class RichUI(UI):
    def __init__(self, stream: bool = True):
        self.stream = stream
        self._status = None
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop_status()
        if self._progress is not None:
            self._progress.stop()
        if self.stream and self._streamed:
            sys.stdout.write("\n")
            sys.stdout.flush()

    _streamed = False

    @contextmanager
    def status(self, message: str):
        with err.status(message):
            yield

    def waiting(self, message: str) -> None:
        self._stop_status()
        self._status = err.status(message)
        self._status.start()

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def start_encoding(self, total_tokens: int, workers: int) -> None:
        self._stop_status()
        self._progress = Progress(
            TextColumn(f"Encoding on {workers} worker{'s' * (workers > 1)}"), BarColumn(),
            TaskProgressColumn(), TextColumn("{task.completed:,}/{task.total:,} tokens"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=err, transient=True)
        self._progress.start()
        self._task = self._progress.add_task("encode", total=total_tokens, rate="")

    def advance(self, tokens: int) -> None:
        if self._progress is None:
            return
        self._progress.advance(self._task, tokens)
        task = self._progress.tasks[0]
        if task.elapsed:
            self._progress.update(self._task, rate=f"{task.completed / task.elapsed:,.0f} tok/s")

    def token(self, text: str) -> None:
        self._stop_status()
        if self.stream and text:
            self._streamed = True
            sys.stdout.write(text)
            sys.stdout.flush()


def ingest_report(result: IngestResult) -> None:
    m = result.manifest
    if m is None:
        err.print(f"This machine's {result.workers} workers encoded their blocks in "
                  f"{result.encode_seconds:.1f} s; node 0 commits the context.")
        return
    files = sorted(m["files"], key=lambda f: f["token_end"] - f["token_start"], reverse=True)
    method = m["method"]
    settings = f"block {method['block_size']:,}" + (
        f", anchor {method['anchor_size']:,}" if method["name"] == "star" else "")
    if result.cache_hit:
        err.print(f"[green]Cache hit[/]: {m['name']} ({m['key']}) is already encoded with "
                  f"{method['name']} ({settings}) on {m['model']['name']}; nothing to do "
                  f"({result.seconds:.1f} s). Use --force to re-encode.")
        return
    err.print(f"[bold]Ingested[/] {m['name']} ({m['key']}): {len(m['files'])} files, "
              f"{m['n_tokens']:,} tokens, {len(m['blocks'])} blocks on {result.workers} "
              f"worker{'s' * (result.workers > 1)}, method {method['name']} ({settings}), "
              f"model {m['model']['name']}, {m['dtype']}")
    err.print(f"Encoded in {result.encode_seconds:.1f} s "
              f"({m['n_tokens'] / max(result.encode_seconds, 1e-9):,.0f} tokens/s); "
              f"total {result.seconds:.1f} s; shards {_size(sum(b['bytes'] for b in m['blocks']))} "
              f"in {m['_dir']}")
    table = Table(title="Largest files", box=None, title_justify="left")
    table.add_column("file")
    table.add_column("tokens", justify="right")
    table.add_column("lines", justify="right")
    for f in files[:5]:
        table.add_row(f["path"], f"{f['token_end'] - f['token_start']:,}", f"{f['lines']:,}")
    err.print(table)
    if m["skipped"]:
        err.print(f"Skipped {len(m['skipped'])}:")
        for s in m["skipped"][:20]:
            err.print(f"  {s['path']}: {s['reason']}")
        if len(m["skipped"]) > 20:
            err.print(f"  … and {len(m['skipped']) - 20} more")


def answer_stats(answer: Answer) -> None:
    if not answer.query_host:
        err.print("The answer streams on the machine holding the last block (the last node).")
        return
    n_new = len(answer.token_ids)
    ttft = answer.first_token_seconds
    rate = (n_new - 1) / answer.decode_seconds if answer.decode_seconds and n_new > 1 else 0.0
    err.print(f"[dim]{answer.context['name']} · {answer.context['method']['name']} · "
              f"{answer.context['n_tokens']:,} cached + {answer.query_tokens} question tokens · "
              f"{answer.workers} worker{'s' * (answer.workers > 1)} · first token "
              f"{ttft:.2f} s · {n_new} tokens, {rate:.1f} tok/s · total {answer.seconds:.1f} s[/]"
              if ttft is not None else f"[dim]no answer tokens ({answer.seconds:.1f} s)[/]")


def answer_json(answer: Answer) -> dict:
    ctx = answer.context
    return {"answer": answer.text, "context": ctx["name"], "key": ctx["key"],
            "method": ctx["method"], "model": ctx["model"]["name"],
            "tokens": {"context": ctx["n_tokens"], "question": answer.query_tokens,
                       "answer": len(answer.token_ids)},
            "workers": answer.workers,
            "timings": {"first_token_s": answer.first_token_seconds,
                        "total_s": answer.seconds, "decode_s": answer.decode_seconds}}


def print_error(error) -> None:
    err.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
    if getattr(error, "hint", None):
        err.print(f"[yellow]hint:[/] {escape(error.hint)}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
