"""The measuring commands: `bench` (speed and memory) and `eval` (accuracy and retention),
over `starqa.measure`."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated, Optional

import typer

from starqa.cli.app import sigterm_interrupts
from starqa.cli.options import (AnchorSize, Attention, BenchLengths, BlockSize, ChunkSize, Device,
    Dtype, EvalLengths, Heuristic, IndexKind, KvOnDisk, Model, PassingSize, Positions, ProbeWindow,
    SinkSize, SummaryBudget, TopKChoice, TopKOpt, TopKPrefill, TopKSchedule, TopKTail, Weights,
    compared, method_params, topk_runs)


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


def eval_(
    model: Model = None,
    methods: Annotated[Optional[str], typer.Option(
        envvar="STARQA_EVAL_METHODS",
        help="Comma-separated methods to compare (default: every method starqa has); dense "
             "runs too, as the reference of retention, unless every length is past the "
             "model's window (where it would extrapolate: name it to run it).")] = None,
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
    kv: Annotated[Optional[str], typer.Option(
        "--kv", envvar="STARQA_EVAL_KV",
        help="Also run each method over this KV precision (int8: as `ingest --kv int8` "
             "stores it), its retention against the same method over float KV.")] = None,
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
        edit=edit, kv=tuple(p.strip() for p in kv.split(",") if p.strip()) if kv else (),
        method_params=method_params(sink_size, heuristic, summary_budget, chunk_size,
                                               positions, passing_size, probe_window)))


def _eval(opts) -> None:
    """`starqa eval` with its options parsed: the plan on screen, the run with its progress
    (`kill` ends it as Ctrl-C does, and the JSON says so), the table and where the results
    are; an interrupted run exits 130."""
    import starqa.cli.eval_report as report
    from starqa.measure.evals import runner

    _fetch_model(opts.model)
    plan = runner.plan(opts)
    report.plan_report(plan)
    with sigterm_interrupts(), report.RichProgress() as progress:
        results = runner.run(plan, progress)
    report.results_table(results)
    report.closing_report(results, plan.json_path)
    if results["status"] == "interrupted":
        sys.exit(130)  # not typer.Exit(130): main would take it for an unreported Ctrl-C


def _fetch_model(spec: str | None) -> None:
    """An embedded model fetched (first use) with its progress on screen, before a command
    whose own display would otherwise hide a minutes-long download."""
    from starqa.api import doors
    from starqa.cli.ui import RichUI

    with RichUI(stream=False) as ui:
        doors.fetch_model(spec, ui)
