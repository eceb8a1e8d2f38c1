"""Terminal output of `starqa eval`: the plan, a progress bar, the accuracy table.

Progress and notes go to stderr, the table (the command's result) to stdout, like the
other commands (ui.py).
"""

from __future__ import annotations

import time

from rich.markup import escape
from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from starqa.measure.evals import runner, scoring
from starqa.cli.ui import err, out, print_table


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def plan_report(plan: runner.Plan) -> None:
    """What will run, how much of it, and where the results go."""
    lengths = ", ".join(runner.length_label(n) for n in plan.lengths)
    err.print(f"[bold]Evaluating[/] {escape(plan.fingerprint['name'])} (window "
              f"{plan.window:,}, {plan.dtype}, {plan.opts.weights or 'default'} weights on {plan.device}) · seed {plan.opts.seed}")
    err.print(f"{_plural(len(plan.tasks), 'task')} × {_plural(len(plan.lengths), 'length')} "
              f"({lengths}) × {_plural(plan.opts.samples, 'sample')} = "
              f"{_plural(plan.n_samples, 'sample')} × {_plural(len(plan.labels), 'method')} "
              f"({', '.join(plan.labels)}) = {_plural(plan.n_runs, 'run')}")
    for note in plan.notes:
        err.print(f"[dim]{escape(note)}[/]")
    err.print(f"results: {escape(str(plan.json_path))} (rewritten after every sample; "
              "Ctrl-C stops and keeps what is done)")


class RichProgress(runner.Progress):
    """A spinner while the model loads, then a bar over the runs' token budget; where
    stderr is not a terminal (a log file, CI), a line per run done instead."""

    def __init__(self):
        self._status = None
        self._bar: Progress | None = None
        self._task = None
        self._runs = 0
        self._correct = 0
        self._total = 0
        self._current = ("", 0.0)  # the run under way, and when it began

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.stop()
        if self._bar is not None:
            self._bar.stop()

    def loading(self, plan: runner.Plan) -> None:
        self._status = err.status("Loading the model")
        self._status.start()

    def start(self, plan: runner.Plan) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        self._total = plan.n_runs
        if not err.is_terminal:  # a line per run instead (`done`)
            return
        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(),
            TextColumn("{task.fields[runs]}/" + f"{plan.n_runs:,} runs"),
            TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=err, transient=True)
        self._bar.start()
        self._task = self._bar.add_task("", total=plan.total_tokens, runs=0, acc="")

    def run(self, task: str, length: int, index: int, method: str) -> None:
        what = f"{task} {runner.length_label(length)} #{index + 1} {method}"
        self._current = (what, time.monotonic())
        if self._bar is not None:
            self._bar.update(self._task, description=what)

    def done(self, tokens: int, correct: bool) -> None:
        self._runs += 1
        self._correct += correct
        if self._bar is not None:
            self._bar.update(self._task, advance=tokens, runs=self._runs,
                             acc=f"{self._correct / self._runs:.0%} correct")
            return
        what, began = self._current
        err.print(f"{escape(what)}: {'correct' if correct else 'wrong'} in "
                  f"{time.monotonic() - began:,.1f} s · {self._runs:,}/{self._total:,} runs, "
                  f"{self._correct / self._runs:.0%} correct", soft_wrap=True)


def sources_cell(score: dict | None) -> str:
    """A sources score as "top-1 of n · top-3 of n · median line distance"; "–" for none."""
    if score is None:
        return "–"
    n = score["n"]
    distance = "–" if score["line_distance"] is None else f"±{score['line_distance']:g}"
    return f"{round(score['top1'] * n)}/{n} · {round(score['top3'] * n)}/{n} · {distance}"


def results_table(results: dict) -> None:
    """Rows: task × length; columns: accuracy per method, retention vs dense and, where
    samples know their answer's place, the sources score."""
    methods = results["settings"]["methods"]
    with_sources = any(row["methods"][m].get("sources") for row in results["summary"]
                       for m in methods)
    same = {m for row in results["summary"] for m in methods
            if "same_tokens" in row["methods"][m]}  # eval --edit's incremental runs
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column("task")
    table.add_column("length", justify="right")
    table.add_column("n", justify="right")
    for m in methods:
        table.add_column(m, justify="right")
        if m != scoring.REFERENCE:
            table.add_column(f"{m} ret", justify="right")
        if m in same:
            table.add_column(f"{m} same", justify="right")
        if with_sources:
            table.add_column(f"{m} src", justify="right")
    previous = None
    for row in results["summary"]:
        if previous is not None and row["length"] != previous:
            table.add_section()
        previous = row["length"]
        cells = []
        for m in methods:
            score = row["methods"][m]
            cells.append(f"{score['accuracy']:.0%}")
            if m != scoring.REFERENCE:
                cells.append("n/a" if score["retention"] is None else f"{score['retention']:.2f}")
            if m in same:
                cells.append(f"{score.get('same_tokens', 0):.0%}")
            if with_sources:
                cells.append(sources_cell(score.get("sources")))
        style = "bold" if row["task"] == "all" else None
        table.add_row(row["task"], runner.length_label(row["length"]), str(row["n"]), *cells,
                      style=style)
    if results["summary"]:
        print_table(table)
        out.print("[dim]accuracy: samples whose prediction holds every answer · "
                  "ret: retention, accuracy / dense accuracy on the same samples[/]")
        if same:
            out.print("[dim]incr: the edited haystack re-ingested incrementally (reused, "
                      "re-rotated and encoded blocks, as ingest does); its ret: accuracy / "
                      "the same method's full re-ingest · same: answers token for token equal "
                      "to the full re-ingest's[/]")
        if with_sources:
            out.print("[dim]src: over correct answers whose file and line are known: top "
                      "source is the answer's file · it is in the top 3 · median lines "
                      "from the answer's line to the top source's range[/]")
    else:
        err.print("No sample finished; nothing to tabulate.")


def closing_report(results: dict, path) -> None:
    """Where the JSON is, how long it took, and per-run timing."""
    runs = [r for s in results["samples"] for r in s["results"].values()]
    timing = ""
    if runs:
        per_method: dict[str, list[float]] = {}
        for s in results["samples"]:
            for m, r in s["results"].items():
                per_method.setdefault(m, []).append(r["seconds"])
        timing = " · mean per run: " + ", ".join(
            f"{m} {sum(v) / len(v):.1f} s" for m, v in per_method.items())
        finished = [s for s in results["samples"] if len(s["results"]) == len(per_method)]
        if finished:
            per_sample = sum(r["seconds"] for s in finished for r in s["results"].values())
            timing += f" · per sample (all methods) {per_sample / len(finished):.1f} s"
    state = {"complete": "Done", "interrupted": "[yellow]Interrupted[/]"}.get(
        results["status"], results["status"])
    err.print(f"{state}: {results['runs_done']:,}/{results['runs_total']:,} runs in "
              f"{results['seconds']:.0f} s{timing}")
    err.print(f"Results: {escape(str(path))}")
