"""`starqa bench`: speed, memory and communication of every method, side by side in one run.

For each (method, context length, worker count) a synthetic context of exactly that many
tokens goes through the real torchrun path: Phase 1 (`engine.ingest_tokens`) and Phase 2
(`engine.ask_tokens`) with `measure` on, so every worker reports its own numbers (worker.py:
time, FLOPs from torch's counter, peak memory; dist.py: bytes communicated). Lengths may
pass the model's window: positions beyond it are fine for timing, and answers are not
looked at. Contexts go to a temporary folder, never the user's cache, and each is deleted
once measured.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from starqa import engine, methods, models
from starqa.corpus import prompt
from starqa.cache import store
from starqa.core.errors import StarqaError
from starqa.topk.indexes import TopK, find_set
from starqa.runtime.launch import cpu_count
from starqa.cache.manifest import Manifest, read_manifest, write_json_atomic
from starqa.methods import METHODS, method_config, plan_blocks
from starqa.measure.lengths import parse_lengths

DEFAULT_LENGTHS = "2k,4k,8k,16k,32k"
DEFAULT_WORKERS = "1,2,4"
MIN_LENGTH = 64
QUESTION = "Which function merges the partial attentions of the workers?"


@dataclass(frozen=True)
class BenchOptions:
    """What `starqa bench` runs, checked: every bad value is a clear error."""

    methods: tuple[str, ...]
    lengths: tuple[int, ...]  # context tokens
    workers: tuple[int, ...]  # requested worker counts
    model: str | None = None
    dtype: str | None = None
    new_tokens: int = 16  # tokens generated per run; per-token latency needs at least 2
    device: str = "auto"
    # Phase 2 also with each, on the same context, after exact (starqa.cli.options.compared)
    topk: tuple[TopK, ...] = ()
    rounds: int = 1  # Phase 2 runs of exact and each top-k, alternating (`phase2`)

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise StarqaError(f"--new-tokens must be at least 2 (got {self.new_tokens}): "
                              "per-token latency is measured between generated tokens.",
                              hint="--new-tokens 16")
        if self.rounds < 1:
            raise StarqaError(f"--rounds must be at least 1 (got {self.rounds}).",
                              hint="--rounds 3   (exact and each top-k three times, "
                                   "alternating)")


def options(methods: str | None = None, lengths: str | None = DEFAULT_LENGTHS,
            workers: str = DEFAULT_WORKERS, **settings) -> BenchOptions:
    """BenchOptions from the command line's comma-separated methods, lengths and worker
    counts; `settings`: its other fields (model, dtype, new_tokens, device, topk, rounds)."""
    return BenchOptions(parse_methods(methods), bench_lengths(lengths), parse_workers(workers),
                        **settings)


def parse_methods(text: str | None) -> tuple[str, ...]:
    """`star,pulsar` → ("star", "pulsar"); None or empty: every method."""
    if text is None or not text.strip():
        return METHODS
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise StarqaError(f"--methods {text!r} names no method.",
                          hint=f"choose from: {', '.join(METHODS)}")
    for name in names:
        if name not in METHODS:
            raise StarqaError(f"Unknown method {name!r} in --methods.",
                              hint=f"choose from: {', '.join(METHODS)}")
    return names


def bench_lengths(text: str | None) -> tuple[int, ...]:
    """--lengths (starqa.measure.lengths' grammar; none given: DEFAULT_LENGTHS), each at
    least MIN_LENGTH tokens."""
    lengths = parse_lengths(text) or parse_lengths(DEFAULT_LENGTHS)
    if (short := min(lengths)) < MIN_LENGTH:
        raise StarqaError(f"Bad --lengths {text!r}: {short:,} tokens is too short for a "
                          f"benchmark (at least {MIN_LENGTH}).", hint="--lengths 2k,4k,8k")
    return lengths


def parse_workers(text: str) -> tuple[int, ...]:
    """`1,2,4` → (1, 2, 4); sorted, unique, each at least 1."""
    counts = set()
    for part in text.split(","):
        if not re.fullmatch(r"\s*-?\d+\s*", part):
            raise StarqaError(f"Bad --workers {text!r}: {part.strip()!r} is not a whole number.",
                              hint="give worker counts separated by commas, e.g. 1,2,4")
        if int(part) < 1:
            raise StarqaError(f"--workers must be at least 1 (got {int(part)}).")
        counts.add(int(part))
    return tuple(sorted(counts))


# ---------------------------------------------------------------------------------------
# the plan: which runs, and what to say before them


@dataclass(frozen=True)
class Run:
    method: str
    tokens: int
    blocks: int
    workers: int  # the workers Phase 1 and Phase 2 really use
    requested: tuple[int, ...]  # the --workers values this run stands for


@dataclass(frozen=True)
class Plan:
    opts: BenchOptions
    model_path: Path
    model_name: str
    window: int
    cores: int
    runs: tuple[Run, ...]
    notes: tuple[str, ...]


def make_plan(opts: BenchOptions) -> Plan:
    """Resolve the model and list the runs: one per method, length and distinct number of
    workers the method really uses (dense always encodes on one, so it runs once per
    length; no method gets more workers than blocks)."""
    from transformers import AutoConfig

    from starqa import models

    model_path = models.resolve_model(opts.model)
    window = models.context_window(AutoConfig.from_pretrained(model_path))
    runs = []
    for tokens in opts.lengths:
        for method in opts.methods:
            blocks = len(plan_blocks(tokens, method_config(method, tokens).block_size))
            used: dict[int, list[int]] = {}
            for requested in opts.workers:
                used.setdefault(engine.ingest_worker_count(method, blocks, requested),
                                []).append(requested)
            runs += [Run(method, tokens, blocks, w, tuple(asked)) for w, asked in used.items()]
    cores = cpu_count()
    return Plan(opts, model_path, models.fingerprint(model_path)["name"], window, cores,
                tuple(runs), tuple(_notes(opts, runs, window, cores)))


def _notes(opts: BenchOptions, runs: Sequence[Run], window: int, cores: int) -> list[str]:
    notes = [(f"{len(runs)} runs, each Phase 1 then Phase 2 ({opts.new_tokens} new tokens) on "
              "its own torchrun group; contexts in a temporary folder, deleted as measured.")]
    most = max(r.workers for r in runs)
    if most > cores and opts.device != "cuda":
        notes.append(f"{most} simulated hosts on {cores} core{'s' * (cores > 1)}: wall times "
                     "are serialised; critical-path FLOPs are the per-worker figure that matters.")
    for method in opts.methods:
        mine = [r for r in runs if r.method == method]
        if methods.get(method).sequential and any(r.requested != (r.workers,) for r in mine):
            notes.append(f"{method} encodes on one worker (exact causal Phase 1 is "
                         "sequential): one run per length, Phase 1 and Phase 2 on 1 worker.")
        elif any(r.requested != (r.workers,) for r in mine):
            notes.append(f"{method} never uses more workers than blocks; runs asking for more "
                         "are run once with one worker per block.")
    over = [n for n in opts.lengths if n + opts.new_tokens > window]
    if over:
        notes.append(f"contexts of {', '.join(f'{n:,}' for n in over)} tokens, with the question "
                     f"and answer, go past the model's {window:,}-token window: fine for "
                     "timing; answers are not looked at.")
    return notes


# ---------------------------------------------------------------------------------------
# running


def synthetic_context(tokenizer, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` context tokens: the prompt's opening (chat template and system
    turn, as `ingest` makes it), then starqa's own source files, repeated as needed. Real
    text that is always at hand; its content does not change any size or FLOP count."""
    head = prompt.encoder(tokenizer).encode([(prompt.context_text(tokenizer, "")[0], True)])[0]
    text = "\n\n".join(p.read_text() for p in sorted(Path(__file__).parents[1].rglob("*.py")))
    body = prompt.encoder(tokenizer).text(text)
    if n_tokens <= len(head):
        raise StarqaError(f"{n_tokens:,} tokens is shorter than the prompt's opening "
                          f"({len(head):,} tokens) for this model.")
    repeats = math.ceil((n_tokens - len(head)) / len(body))
    return (head + body * repeats)[:n_tokens]


def run(plan: Plan, *, contexts_dir: Path | None = None, json_path: Path | None = None,
        new_ui: Callable[[], AbstractContextManager] = lambda: nullcontext(engine.UI()),
        report: Callable[[str], None] = lambda line: None) -> dict:
    """Run every run of `plan`; returns (and after each run, writes to `json_path`) the
    results: environment, notes, one row per run, and critical-path ratios against star.

    contexts_dir: keep the contexts there (tests inspect them); by default they go to a
    temporary folder and each is deleted as soon as it is measured. new_ui: a fresh
    progress display for each phase (a context manager giving an engine.UI); report: one
    line per finished run.
    """
    import torch
    import transformers

    from starqa.runtime import dist
    from starqa import models

    opts = plan.opts
    tokenizer = models.load_tokenizer(plan.model_path)
    query_ids = prompt.tokenize_query(tokenizer, QUESTION)
    result = {"environment": {
        "cores": plan.cores, "torch": torch.__version__, "transformers": transformers.__version__,
        "model": plan.model_name, "model_path": str(plan.model_path), "window": plan.window,
        "dtype": str(models.parse_dtype(opts.dtype, dist.resolve_device(opts.device))
                     ).removeprefix("torch."),
        "device": opts.device, "new_tokens": opts.new_tokens, "query_tokens": len(query_ids),
        "cpu": cpu_info(), "started": time.time()},
        "notes": list(plan.notes), "rows": [], "ratios": []}
    scratch = None
    if contexts_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="starqa-bench-"))
    root = contexts_dir or scratch / "contexts"
    try:
        contexts: dict[int, list[int]] = {}
        for i, r in enumerate(plan.runs, 1):
            if r.tokens not in contexts:
                contexts[r.tokens] = synthetic_context(tokenizer, r.tokens)
            ids = contexts[r.tokens]
            started = time.perf_counter()
            with new_ui() as ui:
                ingested = engine.ingest_tokens(ids, root, engine.TokenIngestOptions(
                    model=opts.model, method=r.method, workers=r.workers,
                    dtype=opts.dtype, name=f"bench-{r.method}-{r.tokens}", measure=True,
                    allow_over_window=True, device=opts.device), ui=ui)
            manifest = ingested.manifest
            shard_bytes = sum((manifest.folder / b.file).stat().st_size for b in manifest.blocks)
            answer, topk_rows, manifest = phase2(manifest, query_ids, r.workers, opts, new_ui,
                                                 report)
            if contexts_dir is None:
                store.remove_context(manifest)
            row = _row(r, manifest, ingested, answer, shard_bytes,
                       time.perf_counter() - started)
            row["topk"] = topk_rows
            result["rows"].append(row)
            result["ratios"] = ratios(result["rows"], opts)
            result["environment"]["seconds"] = time.time() - result["environment"]["started"]
            if json_path is not None:
                write_json_atomic(json_path, result)
            report(f"[{i}/{len(plan.runs)}] {_describe(row)}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return result


def phase2(manifest: Manifest, query_ids: list[int], workers: int, opts: BenchOptions,
           new_ui, report) -> tuple:
    """Phase 2 of one cached context side by side: exact, then each of `opts.topk` (its
    indexes built on first use), `opts.rounds` times in turn (exact, each top-k, exact,
    ...): on a machine whose speed drifts between runs minutes apart, each kind is then
    measured across the same stretch of time, and each is reported by its run of median
    decode time (its other numbers from that same run). Returns (exact's Answer, the top-k
    rows, the manifest with any indexes built). `run` calls it for every run;
    benchmarks/dev/topk_phase2.py for a context ingested once."""
    def answer(topk: TopK | None):
        with new_ui() as ui:
            return engine.ask_tokens(manifest, query_ids, engine.TokenAskOptions(
                workers=workers, max_new_tokens=opts.new_tokens, stop=False, measure=True,
                allow_over_window=True, device=opts.device, topk=topk), ui=ui)

    runs: list[list] = [[] for _ in range(1 + len(opts.topk))]  # exact's, then each top-k's
    for _ in range(opts.rounds):
        runs[0].append(answer(None))
        for i, settings in enumerate(opts.topk, 1):
            runs[i].append(answer(settings))
            manifest = read_manifest(runs[i][-1].context.folder)  # with the indexes built
    exact, rows = median_run(runs[0]), []
    for settings, found in zip(opts.topk, runs[1:]):
        rows.append(_topk_row(settings, manifest, median_run(found), exact))
        report(f"    {_describe_topk(rows[-1])}")
    return exact, rows, manifest


def median_run(answers: Sequence[engine.Answer]) -> engine.Answer:
    """Of one kind's runs, the one of median decode time per token (the lower middle one of
    an even count; runs without a per-token time last)."""
    order = sorted(answers, key=lambda a: (per_token(a) is None, per_token(a) or 0.0))
    return order[(len(order) - 1) // 2]


def _row(r: Run, manifest: Manifest, ingested, answer, shard_bytes: int, seconds: float) -> dict:
    """One run's numbers: Phase 1 per worker and its critical path (the slowest worker),
    the shards on disk, Phase 2 latencies."""
    p1 = [{"rank": m["rank"], "tokens": m["tokens"], "seconds": m["seconds"],
           "cpu_seconds": m["cpu_seconds"], "flops": m["flops"], "peak_bytes": peak,
           "sent_bytes": m["sent_bytes"], "received_bytes": m["received_bytes"],
           "by_op": m["by_op"]}
          for m, peak in zip(ingested.measures, ingested.peak_bytes)]
    p2 = [{"rank": m["rank"], "seconds": m["seconds"], "peak_bytes": peak,
           "sources_seconds": m["sources_seconds"],
           "sent_bytes": m["sent_bytes"], "received_bytes": m["received_bytes"],
           "by_op": m["by_op"]}
          for m, peak in zip(answer.measures, answer.peak_bytes)]
    wall = max(w["seconds"] for w in p1)
    new = len(answer.token_ids)
    return {
        "method": r.method, "tokens": r.tokens, "workers": r.workers,
        "requested_workers": list(r.requested), "blocks": len(manifest.blocks),
        "method_settings": manifest.method.as_dict(), "context_key": manifest.key,
        "seconds": seconds,
        "phase1": {
            "seconds": wall, "tokens_per_second": r.tokens / wall,
            "critical_path_flops": max(w["flops"] for w in p1),
            "total_flops": sum(w["flops"] for w in p1),
            "peak_bytes": max(w["peak_bytes"] for w in p1),
            "sent_bytes": sum(w["sent_bytes"] for w in p1),
            "launch_seconds": ingested.seconds, "per_worker": p1},
        "shard_bytes": shard_bytes,
        "phase2": {
            "workers": answer.workers, "query_tokens": answer.question_tokens,
            "new_tokens": new, "first_token_seconds": answer.timings.prefill_s,
            "cold_first_token_seconds": answer.timings.first_token_s,
            "seconds_per_token": per_token(answer),
            # source attribution after the answer (the slowest worker), inside decode_seconds
            "sources_seconds": max(w["sources_seconds"] for w in p2),
            "decode_seconds": answer.timings.decode_s,
            "peak_bytes": max(w["peak_bytes"] for w in p2),
            "sent_bytes": sum(w["sent_bytes"] for w in p2), "per_worker": p2},
    }


def per_token(answer) -> float | None:
    """An answer's decode seconds per token after the first (None for fewer than two)."""
    new = len(answer.token_ids)
    return answer.timings.decode_s / (new - 1) if new > 1 else None


def _topk_row(settings: TopK, manifest: Manifest, answer, exact) -> dict:
    """One top-k Phase 2 run against the exact one on the same context and workers."""
    built = find_set(manifest, settings.index)
    per_token_s, exact_per_token = per_token(answer), per_token(exact)
    peak, exact_peak = max(answer.peak_bytes), max(exact.peak_bytes)
    return {"attention": settings.describe(), "settings": settings.as_dict(),
            "k": settings.keys(manifest.n_tokens),
            "index_bytes": sum(f.bytes for f in built.files) if built else 0,
            "index_build_seconds": built.build_seconds if built else 0.0,
            "first_token_seconds": answer.timings.prefill_s, "seconds_per_token": per_token_s,
            "peak_bytes": peak, "same_tokens_as_exact": answer.token_ids == exact.token_ids,
            "decode_vs_exact": per_token_s / exact_per_token if per_token_s and exact_per_token
            else None,
            "peak_vs_exact": peak / exact_peak if exact_peak else None}


def _describe_topk(row: dict) -> str:
    per_token = row["seconds_per_token"]
    return (f"{row['attention']}, k = {row['k']:,}: first token "
            f"{row['first_token_seconds']:.2f} s"
            + (f", {per_token * 1e3:.0f} ms/token ({row['decode_vs_exact']:.2f} of exact)"
               if per_token is not None and row["decode_vs_exact"] else "")
            + f", peak {row['peak_bytes'] / 2**20:,.0f} MiB ({row['peak_vs_exact']:.2f} of exact)")


def cpu_info() -> dict:
    """The CPU's model name and the flags that decide bf16 speed (Linux /proc/cpuinfo)."""
    model, flags = models.cpu_description()
    wanted = ("avx2", "avx512f", *models.BF16_FLAGS, "amx_tile")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def ratios(rows: Sequence[dict], opts: BenchOptions, base: str = methods.DEFAULT
           ) -> list[dict]:
    """Critical-path FLOPs of every other method over `base`'s, per (length, requested
    workers) where both ran; a method that used fewer workers (dense: one) is compared as
    it ran."""
    def find(method: str, tokens: int, workers: int) -> dict | None:
        return next((row for row in rows if row["method"] == method and row["tokens"] == tokens
                     and workers in row["requested_workers"]), None)

    out = []
    for tokens in opts.lengths:
        for workers in opts.workers:
            star = find(base, tokens, workers)
            if star is None:
                continue
            found = {f"{m}/{base}": row["phase1"]["critical_path_flops"] /
                     star["phase1"]["critical_path_flops"]
                     for m in opts.methods if m != base
                     if (row := find(m, tokens, workers)) is not None}
            if found:
                out.append({"tokens": tokens, "workers": workers, **found})
    return out


def _describe(row: dict) -> str:
    p1, p2 = row["phase1"], row["phase2"]
    per_token = p2["seconds_per_token"]
    return (f"{row['method']}, {row['tokens']:,} tokens, {row['workers']} "
            f"worker{'s' * (row['workers'] > 1)}: Phase 1 {p1['seconds']:.1f} s, "
            f"{p1['critical_path_flops'] / 1e9:,.1f} GFLOP on the critical path; first token "
            f"{p2['first_token_seconds']:.2f} s"
            + (f", {per_token * 1e3:.0f} ms/token" if per_token is not None else "")
            + (f", sources {p2['sources_seconds'] * 1e3:.0f} ms "
               f"({p2['sources_seconds'] / p2['decode_seconds']:.1%} of decode)"
               if p2["decode_seconds"] else "")
            + f" ({row['seconds']:.0f} s in all)")
