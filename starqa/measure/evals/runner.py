"""`starqa eval`: every method over the very same generated samples, in this one process.

The model loads once. For each sample (generators.generate) every method encodes the
context with Phase 1 for all of its blocks here (its registry entry's `encode_local`: what
the workers would store) and answers the question with Phase 2 as a world of one, the query host
attending to the whole shard (answerer.Answerer: the Phase 2 path `ask` runs). Dense runs
first on every sample: it is the reference of retention. The results go to a JSON file
rewritten atomically after every sample, so an interrupted run keeps what it finished.
"""

from __future__ import annotations

import hashlib
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from starqa import methods as methods_mod
from starqa.core import gcpause, paths
from starqa.core.defaults import default_reserve
from starqa.core.errors import StarqaError
from starqa.topk.indexes import TopK
from starqa.measure.evals import edit, generators, scoring
from starqa.measure.evals.encoded import Encoded
from starqa.measure.lengths import length_label, parse_lengths
from starqa.cache.manifest import KV_KINDS, write_json_atomic
from starqa.cache.shards import shard_of

FORMAT = "starqa-eval/1"
DEFAULT_SAMPLES = 4
DECODING = ("greedy; stops at the end of the turn, after the task's max_new_tokens, or as "
            "soon as the prediction holds the answers (a substring match stays true)")


class Progress:
    """Callbacks while the evaluation runs; the default does nothing."""

    def loading(self, plan: Plan) -> None: ...

    def start(self, plan: Plan) -> None: ...

    def run(self, task: str, length: int, index: int, method: str) -> None: ...

    def done(self, tokens: int, correct: bool) -> None: ...


@dataclass(frozen=True)
class EvalOptions:
    model: str | None = None
    methods: str | None = None  # comma-separated; None: every method starqa has
    tasks: str | None = None  # comma-separated tasks and groups; None: all
    lengths: str | None = None  # e.g. "1k,2k,4k"; None: 1k doubling up to the model's window
    samples: int = DEFAULT_SAMPLES  # per task and length
    seed: int = 0
    json_path: str | None = None  # None: $STARQA_HOME/evals/<time>-<model>.json
    dtype: str | None = None
    device: str = "auto"
    weights: str | None = None  # Phase 2 weight format; None: the default for the model
    block_size: int | None = None
    anchor_size: int | None = None
    method_params: dict | None = None  # method-specific settings given (methods.OPTIONS)
    command: str | None = None  # how the user ran it, recorded in the JSON
    topk: tuple[TopK, ...] = ()  # top-k attention settings, each also run after exact
    edit: bool = False  # the edit tasks: each method re-ingests incrementally and in full
    kv: tuple[str, ...] = ()  # KV precisions besides float each method also runs ("int8")


@dataclass
class Plan:
    opts: EvalOptions
    tasks: list[str]
    lengths: list[int]
    methods: list[str]  # dense first (left out past the window unless asked for)
    model_path: Path
    window: int
    fingerprint: dict
    json_path: Path
    device: str  # resolved: "cpu", "cuda"
    dtype: str  # resolved: "bfloat16", ...
    notes: list[str] = field(default_factory=list)

    @property
    def n_samples(self) -> int:
        return len(self.tasks) * len(self.lengths) * self.opts.samples

    @property
    def variants(self) -> list[tuple[str, str, TopK | None, str]]:
        """(label, method, top-k settings, KV precision) of every run of a sample: each
        method with exact attention (label: the method), then with each top-k setting
        ("dense topk 1%"), then over each other KV precision ("star int8"), all on the
        method's one Phase 1 encoding. With --edit: each method's full re-ingest (label: the
        method), then its incremental one ("star incr")."""
        runs = []
        for m in self.methods:
            runs.append((m, m, None, KV_FLOAT))
            runs += [(topk_label(m, t), m, t, KV_FLOAT) for t in self.opts.topk]
            runs += [(f"{m} {kv}", m, None, kv) for kv in self.opts.kv]
            if self.opts.edit:
                runs.append((edit.label(m), m, None, KV_FLOAT))
        return runs

    @property
    def labels(self) -> list[str]:
        """The results' columns: `variants`' labels (dense first: the reference)."""
        return [label for label, _, _, _ in self.variants]

    @property
    def references(self) -> dict[str, str]:
        """What a label's retention compares with, where not dense: an incremental run, the
        full one; a KV precision, the same method over float KV."""
        kv = {label: method for label, method, _, precision in self.variants
              if precision != KV_FLOAT}
        return {**kv, **{label: edit.reference(label) for label in self.labels
                         if edit.reference(label)}}

    @property
    def n_runs(self) -> int:
        return self.n_samples * len(self.labels)

    @property
    def total_tokens(self) -> int:
        """Token budget of all runs: the progress bar's unit (a run costs about its length)."""
        return sum(self.lengths) * len(self.tasks) * self.opts.samples * len(self.labels)


KV_FLOAT = KV_KINDS[0]  # the KV precision every method runs in; --kv adds others


def topk_label(method: str, topk: TopK) -> str:
    """A top-k run's column: the method, then the settings that differ from the defaults."""
    extra = "".join(f" {v}" for v, d in ((topk.index, "flat"), (topk.schedule, "uniform"))
                    if v != d) + (" question-topk" if topk.prefill == "topk" else "") \
        + (" no-tail" if topk.index == "ivf" and not topk.tails else "")
    return f"{method} topk {topk.label}{extra}"


# ---------------------------------------------------------------------------------------
# options


def parse_methods(text: str | None) -> tuple[list[str], bool]:
    """Methods to run, dense first, and whether dense was added (not asked for: it is the
    reference of retention)."""
    names = list(methods_mod.METHODS) if not text or not text.strip() else list(
        dict.fromkeys(p.strip() for p in text.split(",")))
    for name in names:
        if name not in methods_mod.METHODS:
            raise StarqaError(f"Unknown method {name!r}.",
                              hint=f"choose from: {', '.join(methods_mod.METHODS)}")
    return ([scoring.REFERENCE, *(n for n in names if n != scoring.REFERENCE)],
            scoring.REFERENCE not in names)


def reference(methods: list[str], added: bool, lengths: Sequence[int], window: int
              ) -> tuple[list[str], str | None]:
    """(methods, the note that says what became of dense) once the window is known: dense,
    `added` as the reference, runs too, unless every length is past the window: there it
    would extrapolate over the whole context, a baseline `ingest` never picks and the
    slowest run of all (its attention grows with the square of the length), so it is left
    out and retention is n/a. Named in --methods, it runs (no note)."""
    if not added:
        return methods, None
    if any(n + default_reserve(window) <= window for n in lengths):
        return methods, f"{scoring.REFERENCE} runs too: it is the reference of retention"
    return ([m for m in methods if m != scoring.REFERENCE],
            f"{scoring.REFERENCE} left out: every length is past the {window:,}-token window, "
            "where it would extrapolate (name it in --methods to run it)")


def fit_window(lengths: Sequence[int] | None, window: int) -> tuple[list[int], list[str]]:
    """(`lengths`, by default 1k, 2k, 4k ... up to the model's window; a note for those past
    it, where each method runs as `ingest` would plan it: star at contiguous positions
    within the window, the others extrapolating past it, a baseline `ingest` never picks)."""
    if lengths is None:
        doubling = [1024 << i for i in range(32) if 1024 << i <= window]
        return doubling or [window], []
    past = [length_label(n) for n in lengths if n + default_reserve(window) > window]
    notes = [f"{', '.join(past)} past the {window:,}-token window: "
             f"{', '.join(m.name for m in methods_mod.REGISTRY.values() if m.fits_any_window)} "
             "at contiguous positions within it (as ingest plans it; --positions sparse: "
             "extrapolating), the other methods extrapolating"] if past else []
    return list(lengths), notes


def fitted_options(name: str, options: dict, n: int, window: int) -> dict:
    """`method_options` for a context of `n` tokens as `ingest` plans it on a `window`:
    past it, a method that fits any window at contiguous positions, blocks and anchor sized
    to it (`methods.fitted_contiguous`), unless sparse positions were asked for."""
    reserve = default_reserve(window)
    params = options["params"]
    if n + reserve <= window or not methods_mod.get(name).fits_any_window \
            or params.get("positions") == "sparse":
        return options
    block, anchor, fitted = methods_mod.fitted_contiguous(
        n, window - reserve, options["block_size"], options["anchor_size"], params)
    return {"block_size": block, "anchor_size": anchor, "params": fitted}


def method_options(name: str, opts: EvalOptions) -> dict:
    """The keyword arguments of methods.method_config that apply to method `name`."""
    given = opts.method_params or {}
    return {"block_size": opts.block_size,
            "anchor_size": opts.anchor_size if name in methods_mod.owners("anchor") else None,
            "params": {k: v for k, v in given.items() if name in methods_mod.owners(k)}}


def plan(opts: EvalOptions) -> Plan:
    """Check every option (cheap errors first), resolve the model, size the work."""
    from transformers import AutoConfig

    from starqa.runtime import dist
    from starqa import models

    tasks = generators.resolve_tasks(opts.tasks, opts.edit)
    if opts.edit and opts.topk:
        raise StarqaError("--edit measures re-ingest, with exact attention; --attention topk "
                          "does not apply to it.", hint="drop --attention topk (or --edit)")
    for kv in opts.kv:
        if kv not in KV_KINDS[1:]:
            raise StarqaError(f"Unknown --kv {kv!r}: every method runs over float KV, and "
                              f"--kv adds one of: {', '.join(KV_KINDS[1:])}.",
                              hint=f"--kv {KV_KINDS[1]}")
    if opts.edit and opts.kv:
        raise StarqaError("--edit measures re-ingest over float KV; --kv does not apply to it.",
                          hint="drop --kv (or --edit)")
    methods, added = parse_methods(opts.methods)
    requested = parse_lengths(opts.lengths)
    if opts.samples < 1:
        raise StarqaError(f"--samples must be at least 1 (got {opts.samples}).")
    for key in methods_mod.given_settings(opts.anchor_size, opts.method_params):
        owners = methods_mod.owners(key)
        if not set(owners) & set(methods):
            raise StarqaError(f"{methods_mod.OPTIONS.get(key, key)} only applies to "
                              f"{' or '.join(owners)}, which --methods leaves out.")
    for name in methods:  # the methods' own checks, before any model is loaded
        methods_mod.method_config(name, 1024, **method_options(name, opts))
    device = dist.resolve_device(opts.device)
    dtype = str(models.parse_dtype(opts.dtype, device)).removeprefix("torch.")
    model_path = models.resolve_model(opts.model)
    window = models.context_window(AutoConfig.from_pretrained(model_path))
    lengths, past = fit_window(requested, window)
    methods, note = reference(methods, added, lengths, window)
    notes = ([note] if note else []) + past
    fingerprint = models.fingerprint(model_path)
    if opts.json_path:
        json_path = Path(opts.json_path).expanduser().resolve()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^\w.-]+", "-", fingerprint["name"]).strip("-") or "model"
        json_path = paths.home() / "evals" / f"{stamp}-{safe}.json"
    return Plan(opts, tasks, lengths, methods, model_path, window, fingerprint, json_path,
                device, dtype, notes)


# ---------------------------------------------------------------------------------------
# running


class Evaluator:
    """The model, loaded once, answering generated samples with any method."""

    def __init__(self, plan: Plan):
        import torch

        from starqa.runtime import dist
        from starqa.phase1 import hooks
        from starqa import models
        from starqa.models.decoder_io import load_decoder

        self.device = torch.device(plan.device)
        self.dtype = getattr(torch, plan.dtype)
        self.tokenizer = models.load_tokenizer(plan.model_path)
        self.model = models.load_model(  # Phase 1's, in the dtype it computes in
            plan.model_path, device=self.device, attn_implementation=hooks.register(),
            dtype=getattr(torch, models.phase1_dtype(plan.dtype, plan.device, plan.model_path)))
        self.weights = models.phase2_weights(plan.opts.weights, plan.opts.model, plan.device)
        self.decoder = load_decoder(plan.model_path, self.dtype, self.weights, self.device)
        self.stop_ids = models.stop_ids(self.tokenizer, plan.model_path)
        self.info = dist.local_world(self.device)
        self.options = {m: method_options(m, plan.opts) for m in plan.methods}
        self.model_path = plan.model_path
        self.window = plan.window
        self.model_digest = plan.fingerprint["digest"]  # block addresses (eval --edit)
        gcpause.settle()  # started (see starqa.core.gcpause)

    def encode(self, sample: generators.Sample, method: str) -> Encoded:
        """Phase 1 over all blocks of the sample's context, as the workers would store it."""
        import torch

        n = len(sample.context_ids)
        config = methods_mod.method_config(
            method, n, **fitted_options(method, self.options[method], n, self.window))
        encoder = methods_mod.get(method)
        blocks = methods_mod.plan_blocks(n, config.block_size)
        started = time.perf_counter()
        prepared = encoder.prepare(sample.context_ids, config, blocks)
        encoded = encoder.encode_local(self.model, torch.tensor(sample.context_ids), config,
                                       blocks, prepared)
        parts = [(k.to(self.dtype), v.to(self.dtype))  # stored in the cache's dtype
                 for _, k, v in sorted(encoded, key=lambda x: x[0])]
        start = encoder.query_position(sample.context_ids, config, blocks, prepared)
        return Encoded(config, len(blocks), parts, start, time.perf_counter() - started)

    def answer(self, sample: generators.Sample, method: str, topk: TopK | None = None,
               encoded: Encoded | None = None, kv: str = "float") -> dict:
        """Phase 2 for the sample's question over its Phase 1 encoding (done here unless
        given), with exact attention or `topk`; over int8 KV (`kv`), its rows quantised as
        `ingest --kv int8` stores them."""
        import torch

        from starqa.phase2.answerer import Answerer, RankShare
        from starqa.topk.listlayout import mean_queries
        from starqa.topk import retrieval

        encoded = encoded or self.encode(sample, method)
        config, start, parts = encoded.config, encoded.query_position, encoded.parts
        bias = methods_mod.ContextBias.of(  # as the manifest's
            len(sample.context_ids), start, methods_mod.get(method).shared_from(config))
        if kv != KV_FLOAT:
            from starqa.attention.kvint8 import quantize_rows

            parts = [(quantize_rows(k), quantize_rows(v)) for k, v in parts]
        started = time.perf_counter()
        if topk is None:
            answerer = Answerer(self.info, self.decoder, RankShare(
                shard_of(parts, self.dtype), start, tuple(sample.files),
                ids=torch.tensor(sample.context_ids), context_bias=bias))
        else:
            toward = None
            if topk.index == "ivf":  # its lists laid out as `Answerer.from_cache` lays them
                toward = mean_queries(self.decoder, sample.context_ids, start)
            retriever = retrieval.from_parts(parts, topk, len(sample.context_ids), self.dtype,
                                             toward=toward)
            answerer = Answerer(self.info, self.decoder,
                                RankShare(None, start, tuple(sample.files), retriever=retriever,
                                          context_bias=bias))
        started -= encoded.seconds  # phase1_s: the encoding, and top-k's index build
        encoded_at = time.perf_counter()
        tokens: list[int] = []
        first: list[float] = []
        answered = [False]

        def on_token(token: int) -> None:
            first or first.append(time.perf_counter())
            tokens.append(token)

        def should_stop() -> bool:
            # Greedy decoding: once the answers are in and no later text can undo them
            # (a number at the very end may still grow), the score is the full answer's.
            answered[0] = answered[0] or bool(tokens) and scoring.settled(
                self._decode(tokens), sample.answers, sample.match)
            return answered[0]

        _, named = answerer.answer(sample.query_ids, sample.max_new_tokens, self.stop_ids,
                                   on_token, should_stop)
        end = time.perf_counter()
        text = self._decode(tokens).strip()
        stop = ("answer" if answered[0] else
                "max_new_tokens" if len(tokens) >= sample.max_new_tokens else "end")
        where = sample.meta.get("source")
        # scored where the answer was attributed (exact attention: none found counts as
        # wrong); top-k names no sources (`Answerer.answer`), so it has no score to count
        scored = {"source_score": scoring.source_score(named, where)} \
            if where and named is not None else {}
        return {"prediction": text,
                "correct": scoring.is_correct(text, sample.answers, sample.match),
                "found": scoring.found(text, sample.answers), "token_ids": tokens, "stop": stop,
                "method": config.as_dict(), "blocks": encoded.blocks, "query_position": start,
                "attention": topk.as_dict() if topk else "exact",
                "phase1_s": round(encoded_at - started, 3),
                "first_token_s": round(first[0] - encoded_at, 3) if first else None,
                "seconds": round(end - started, 3), "sources": named, **scored}

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def run(plan: Plan, progress: Progress = Progress(), evaluator: Evaluator | None = None) -> dict:
    """Run the plan; returns the results (also in plan.json_path), with status "complete",
    or "interrupted" after Ctrl-C (the samples every method finished are summarised)."""
    progress.loading(plan)
    evaluator = evaluator or Evaluator(plan)
    results = _skeleton(plan, evaluator)
    plan.json_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def save(status: str) -> None:
        results["status"] = status
        results["seconds"] = round(time.perf_counter() - started, 2)
        results["runs_done"] = sum(len(s["results"]) for s in results["samples"])
        results["summary"] = scoring.summarize(results["samples"], plan.labels,
                                               plan.references)
        write_json_atomic(plan.json_path, results)

    progress.start(plan)
    kept: dict[str, Encoded] = {}  # a one-context task's encodings of its context, by method
    kept_ids: list[int] | None = None
    try:
        for length in plan.lengths:
            for task in plan.tasks:
                for index in range(plan.opts.samples):
                    sample = generators.generate(task, length, plan.opts.seed,
                                                 evaluator.tokenizer, index)
                    record = _record(sample)
                    results["samples"].append(record)
                    encoded, edited = None, {}
                    if kept_ids != sample.context_ids:  # a one-context task's next context
                        kept, kept_ids = {}, sample.context_ids
                    for label, method, topk, kv in plan.variants:
                        progress.run(task, length, index, label)
                        if plan.opts.edit and method not in edited:  # full, incremental
                            edited[method] = edit.encode_both(evaluator, sample, method)
                        if plan.opts.edit:
                            full, incremental, reused = edited[method]
                            encoded = full if label == method else incremental
                        elif encoded is None or encoded.config.name != method:
                            encoded = kept.get(method) or evaluator.encode(sample, method)
                            if generators.TASKS[task].one_context:
                                kept[method] = encoded
                        result = evaluator.answer(sample, method, topk, encoded, kv)
                        if plan.opts.edit and label != method:
                            result["reuse"] = reused
                            result["same_tokens"] = (result["token_ids"] == record["results"]
                                                     [method]["token_ids"])
                        record["results"][label] = result
                        progress.done(length, result["correct"])
                    save("running")
    except KeyboardInterrupt:
        save("interrupted")
        return results
    except BaseException as e:
        results["error"] = f"{type(e).__name__}: {e}"
        save("failed")
        raise
    save("complete")
    return results


def _record(sample: generators.Sample) -> dict:
    return {"task": sample.task, "length": sample.length, "index": sample.index,
            "sample_seed": generators.sample_seed(sample.seed, sample.task, sample.length,
                                                  sample.index),
            "tokens": {"context": len(sample.context_ids), "query": len(sample.query_ids),
                       "max_new": sample.max_new_tokens},
            "context_sha256": hashlib.sha256(sample.context_text.encode()).hexdigest(),
            "question": sample.question, "answers": sample.answers, "match": sample.match,
            "meta": sample.meta, "results": {}}


def _skeleton(plan: Plan, evaluator: Evaluator) -> dict:
    import torch
    import transformers

    import starqa
    from starqa import models

    opts = plan.opts
    return {
        "format": FORMAT, "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command, "json": str(plan.json_path),
        "settings": {
            "model": {"spec": opts.model or models.DEFAULT_MODEL, "path": str(plan.model_path),
                      "window": plan.window, **plan.fingerprint},
            "dtype": plan.dtype, "weights": evaluator.weights, "device": str(evaluator.device),
            "threads": torch.get_num_threads(),
            "seed": opts.seed, "samples_per_task": opts.samples,
            "lengths": plan.lengths, "methods": plan.labels, "reference": scoring.REFERENCE,
            "edit": {"about": edit.__doc__.split("\n\n")[0],
                     "retention": "<method> incr: accuracy / the same method's full "
                                  "re-ingest accuracy"} if opts.edit else None,
            "topk": [t.as_dict() for t in opts.topk], "kv": list(opts.kv),
            "method_options": evaluator.options,
            "tasks": {t: {"about": generators.TASKS[t].about,
                          "max_new_tokens": generators.TASKS[t].max_new_tokens,
                          "match": generators.TASKS[t].match} for t in plan.tasks},
            "decoding": DECODING,
            "scoring": "case-insensitive substring match: every answer (match all), or one "
                       "of the alternatives (match any)",
            "sources_scoring": "over correct answers whose sample knows the answer's file and "
                               "line: top source is that file (top1), it is in the first "
                               "three (top3), lines from the truth to the top source's range "
                               "(line_distance, median)",
            "versions": {"starqa": starqa.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "python": platform.python_version()},
        },
        "runs_total": plan.n_runs, "runs_done": 0, "seconds": 0.0,
        "summary": [], "samples": [],
    }
