"""starqa against llama.cpp and transformers, side by side in one run, on the same GGUF and
the same rendered prompt (copies of samples/ as the context, one question).

    python benchmarks/vs_llamacpp.py --llamacpp-python /path/to/llamacpp-venv/bin/python \\
        [--model smollm2-135m] [--tokens 7500] [--new-tokens 48] [--rounds 3]
    python benchmarks/vs_llamacpp.py --smoke [--llamacpp-python PY --gguf SMALL.gguf]
    python benchmarks/vs_llamacpp.py --first-ask [--llamacpp-python PY] [--model M] [--smoke]
    python benchmarks/vs_llamacpp.py --ingest [--llamacpp-python PY] [--model M] \\
        [--tokens 6000,22000] [--rounds 1] [--smoke]
        (--model: smollm2-135m, or with --first-ask and --ingest the default model;
        --tokens: one context size, or with --ingest a comma list of them)

--smoke runs starqa's side on the toy model and corpus of benchmarks/toy.py (one round, a
few hundred tokens); llama.cpp's side only where its python imports llama_cpp and a GGUF is
given, else a line says it was skipped.

--first-ask measures what a new user meets instead (issue 48): in each round a fresh
$STARQA_HOME, `starqa ingest CORPUS --model M` and then `starqa ask QUESTION` as typed, the
ask timed from the command's start to the first byte of its answer, beside llama.cpp's cold
path (a fresh process: model load + state restore + question, as below), and their ratio
(target: at most 2). The model is already fetched and converted, not timed: its converted
folder is linked into each round's home without the files starqa derives from it (Phase
2's prepared weights), as `starqa` leaves it after its first download; the ingest, which
prepares those weights, is timed and shown. With --smoke, on the toy model (with
STARQA_WEIGHTS=int4, so that its weights are prepared as an embedded model's are). Without
a python that imports llama_cpp (--llamacpp-python) llama.cpp's side is skipped, saying so,
and starqa's side runs alone.

--ingest measures Phase 1 against llama.cpp's prefill: for each --tokens size (copies of
samples/), `starqa ingest CORPUS --model M` in a fresh $STARQA_HOME, timed whole from the
command's start to its exit (Python's start and imports included), then a fresh llama.cpp
process that loads the model's GGUF and evaluates the same token ids (the context as that
ingest packed them; every core, batches of 512, flash attention on): load and prefill
seconds. Rounds and sizes interleave (each round: every size, starqa then llama.cpp). The
model is already fetched, converted and its Phase 2 weights prepared, none of it timed:
its folder is linked into each run's home, and an untimed warm-up (both sides once on ~500
tokens) prepares those weights, once per model as a user's first ingest does, and reads
each side's model file into the page cache. Prints per size: starqa's ingest seconds and
tokens/s (and what its own report says: Phase 1's encode seconds, its total), llama.cpp's
load + prefill (each part, tokens/s), their ratio (target: at most 0.20; per round
min-max), then the last ingest's own report and llama.cpp's build line. With --smoke, the
toy model at one toy size (llama.cpp's side with --gguf, as above).

Prints the CPU's model and the flags that pick the kernels (AVX2, AVX-512 with bf16 and
VNNI, AMX), then, on that CPU:
- starqa cold first token: `starqa ask --cold` as a user runs it (a fresh process, the
  context cached, no warm group used), from the command's start to the first byte of the
  answer;
- starqa warm first token and decode ms/token: a warm group (`starqa serve`), as the server
  measures them (question received → first token; first → last token), with its default
  prompt-lookup drafts and without them (the same tokens either way);
- transformers (bf16, SDPA) with the context's KV kept in memory: question → first token,
  decode ms/token;
- llama.cpp on the embedded model's own GGUF: the context evaluated and its state saved to
  disk once; then a fresh process loads the model, restores the state and asks; load,
  restore, question → first token, decode ms/token; and the same with llama-cpp-python's
  own prompt-lookup drafts (`LlamaPromptLookupDecoding`, as many tokens as starqa drafts).
Every engine decodes greedily the same number of tokens (starqa's answer length).
starqa's modules are byte-compiled first, as an installed package's are (pip compiles a
wheel's at install, Python an editable install's at first import): where
PYTHONDONTWRITEBYTECODE is set (some CI images set it), every cold ask would
otherwise compile them again (~50 ms of its first token). The
engines run interleaved, `--rounds` times (warm question, llama.cpp restore, cold ask in
each round), and the medians are compared: on shared virtual CPUs the speed of every
engine drifts by ±15% within an hour, so numbers taken minutes apart are no ratio.

llama-cpp-python is a benchmark-only extra, never a dependency of starqa nor of its CI.
Build it from source in a virtualenv of its own (about 8 minutes on 2 cores); a native
build crashed on a CPU without the instructions it assumed, hence the explicit flags:

    python3 -m venv /tmp/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON \\
      -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
      /tmp/llamacpp/bin/pip install llama-cpp-python==0.3.36

On a CPU without AVX-512 (flags without avx512f) those flags build code it cannot run
(SIGILL): there use CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import build_corpus  # noqa: E402

from starqa.phase2.decode import DRAFT_TOKENS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Who approved the 2026 travel budget, and what does the travel policy say about it?"
SIDE = Path(__file__).parent / "llamacpp_side.py"


def cpu_line() -> str:
    """The CPU model and the flags that decide which kernels run."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f.startswith("amx") or f in (
        "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni")]
    return (f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} cores; "
            f"flags: {' '.join(wanted) or 'none of note'}")


def starqa_cold(name: str, new_tokens: int) -> tuple[float, str]:
    """Seconds from starting `starqa ask` to the first byte of its answer on stdout."""
    return first_byte(["ask", QUESTION, "--context", name, "--cold", "--keep-alive", "0",
                       "--max-new-tokens", str(new_tokens)])


def first_byte(args: list[str], env: dict | None = None) -> tuple[float, str]:
    """(seconds from starting `starqa ARGS` to the first byte of its answer on stdout, the
    command's own first-token line)."""
    cmd = [sys.executable, "-m", "starqa", *args]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)
    first = time.perf_counter() - started
    proc.stdout.read()  # the rest of the answer
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise SystemExit(f"starqa ask failed:\n{err}")
    stats = re.search(r"first token [\d.]+\s+s", " ".join(err.split()))
    return first, stats[0] if stats else ""


class StarqaWarm:
    """A warm group (`starqa serve`) for the context, asked the question once per round; its
    own timings (question received → first token; first → last token)."""

    def __init__(self, key: str):
        from starqa.workers import client

        self.group = client.start(key, None, keepalive=600)
        self.conn = client.Client(self.group)
        self.weights = self.group.weights

    def ask(self, new_tokens: int, draft_tokens: int | None = None) -> dict:
        from starqa.workers import messages

        done = next(e for e in self.conn.ask(QUESTION, (), new_tokens, draft_tokens=draft_tokens)
                    if isinstance(e, messages.Finished))
        return {"first_token_s": done.first_token_s, "tokens": list(done.token_ids),
                "decode_ms_per_token": done.decode_s / max(len(done.token_ids) - 1, 1) * 1e3,
                "text": done.text}

    def close(self) -> None:
        try:
            self.conn.stop()
        finally:
            self.conn.close()


def transformers_dense(model_path: Path, context: list[int], query: list[int],
                       new_tokens: int) -> dict:
    """The same prompt on transformers (bf16, SDPA), the context's KV kept in memory."""
    import torch

    from starqa.models import load_model

    model = load_model(model_path, dtype=torch.bfloat16)
    with torch.inference_mode():
        cache = model(torch.tensor([context]), use_cache=True).past_key_values
        started = time.perf_counter()
        out = model(torch.tensor([query]), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        token = out.logits[0, -1].argmax()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[0, -1].argmax()
        end = time.perf_counter()
    return {"first_token_s": first - started,
            "decode_ms_per_token": (end - first) / max(new_tokens - 1, 1) * 1e3}


class LlamaCpp:
    """llama.cpp on the GGUF: `save` evaluates the context and saves its state once; each
    `restore` is a fresh process that loads the model, restores the state and asks."""

    def __init__(self, python: str, gguf: Path, context: list[int], query: list[int],
                 new_tokens: int, folder: Path):
        self.python, self.gguf, self.folder = python, gguf, folder
        self.job, self.state = folder / "job.json", folder / "state.bin"
        self.job.write_text(json.dumps({
            "context_ids": context, "query_ids": query, "new_tokens": new_tokens,
            "threads": os.cpu_count(), "n_ctx": len(context) + len(query) + new_tokens + 16,
            "lookup": DRAFT_TOKENS}))
        self.saved = self._side("save")
        self.saved["state_bytes"] = self.state.stat().st_size

    def _side(self, mode: str) -> dict:
        return llamacpp_side(self.python, mode, self.gguf, self.state, self.job)

    def restore(self, lookup: bool = False) -> dict:
        out = self._side("lookup" if lookup else "restore")
        out["cold_s"] = out["load_s"] + out["restore_s"] + out["question_s"]
        return out


def llamacpp_side(python: str, mode: str, gguf: Path, state: Path, job: Path) -> dict:
    """llamacpp_side.py's `mode` in a fresh process of `python`: its JSON line."""
    proc = subprocess.run([python, str(SIDE), mode, str(gguf), str(state), str(job)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", default=None,
                        help="python of a virtualenv with llama-cpp-python (see above); "
                             "required but with --smoke")
    parser.add_argument("--model", default=None,
                        help="an embedded model (default: smollm2-135m; with --first-ask or "
                             "--ingest, starqa's default model, which a new user meets)")
    parser.add_argument("--tokens", type=token_sizes, default=None,
                        help="context size to build (default 7500); with --ingest a comma "
                             "list of sizes (default 6000,22000)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of (warm, llama.cpp, cold), interleaved; medians reported "
                             "(default 3; with --ingest 1)")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model and a few hundred tokens, one round; llama.cpp's "
                             "side only with --gguf and a python that imports llama_cpp")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="with --smoke: any small GGUF for llama.cpp's side")
    parser.add_argument("--first-ask", action="store_true",
                        help="the first ask after a fresh ingest in a fresh STARQA_HOME (the "
                             "model already fetched) against llama.cpp's cold path, and their "
                             "ratio; llama.cpp's side only with --llamacpp-python")
    parser.add_argument("--ingest", action="store_true",
                        help="Phase 1: `starqa ingest` (a fresh context cache) against "
                             "llama.cpp's load + prefill of the same tokens (flash attention "
                             "on), at each --tokens size; llama.cpp's side only with "
                             "--llamacpp-python")
    args = parser.parse_args()
    checked_modes(parser, args)
    import compileall

    import starqa

    compileall.compile_dir(Path(starqa.__file__).parent, quiet=1)  # see the docstring

    import torch

    print(f"CPU: {cpu_line()}")
    with tempfile.TemporaryDirectory(prefix="starqa-vs-") as tmp:
        setup = smoke_setup(args) if args.smoke else embedded_setup(args, Path(tmp))
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
              f"model {setup['label']}")
        if args.first_ask:
            report_first_asks(args, *run_first_asks(args, setup, Path(tmp)))
            return
        if args.ingest:
            report_ingests(args, run_ingests(args, setup, Path(tmp)))
            return
        rounds, group, cpp, dense, n_new = run_engines(args, setup, Path(tmp))
    report(args, rounds, group, cpp, dense, n_new)


def checked_modes(parser: argparse.ArgumentParser, args) -> None:
    """The mode's defaults filled in (--model, --tokens, --rounds); what it cannot take
    refused."""
    if args.first_ask and args.ingest:
        parser.error("--first-ask and --ingest are two runs: pick one")
    if args.tokens is None:
        args.tokens = (6000, 22000) if args.ingest else (7500,)
    if args.rounds is None:
        args.rounds = 1 if args.ingest else 3
    if len(args.tokens) > 1 and not args.ingest:
        parser.error("several --tokens sizes are for --ingest only")
    if args.model is None:
        from starqa import models

        args.model = (models.DEFAULT_MODEL if args.first_ask or args.ingest
                      else "smollm2-135m")
    if not (args.smoke or args.first_ask or args.ingest) and args.llamacpp_python is None:
        parser.error("--llamacpp-python is required (or --smoke, --first-ask, --ingest)")


def token_sizes(text: str) -> tuple[int, ...]:
    """--tokens: one context size, or a comma list of them ("6000,22000", for --ingest)."""
    try:
        return tuple(int(size) for size in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size or a comma list of sizes: {text!r}")


def smoke_setup(args) -> dict:
    """--smoke: the toy model and corpus (benchmarks/toy.py) in a scratch cache; llama.cpp's
    side where it can run (its python imports llama_cpp, a GGUF is given), else None."""
    import toy

    toy.banner("vs_llamacpp")
    folder = toy.scratch("vs")
    args.new_tokens, args.rounds = min(args.new_tokens, 8), 1
    args.tokens = (toy.TOKENS,)  # --ingest's one size, in the toy's window
    model_path = toy.model(folder)
    return {"label": "tiny-llama (toy)", "spec": str(model_path), "path": model_path,
            "corpus": toy.corpus(folder / "vs-llamacpp-toy"),
            "gguf": llamacpp_usable(args.llamacpp_python, args.gguf)}


def embedded_setup(args, folder: Path) -> dict:
    """The embedded model, its GGUF (fetched once) and copies of samples/ of --tokens, in
    `folder`."""
    from starqa import models
    from starqa.core import paths

    embedded = models.embedded_model(args.model)
    if embedded is None:
        raise SystemExit("--model must be an embedded model (llama.cpp needs its GGUF)")
    model_path = models.resolve_model(embedded.name)
    corpus = samples_corpus(model_path, args.tokens[0], folder)
    why = llamacpp_missing(args.llamacpp_python)
    if why:  # its GGUF is not fetched either
        print(f"llama.cpp side skipped: {why}; starqa's side runs alone", flush=True)
    return {"label": embedded.name, "spec": embedded.name, "path": model_path,
            "corpus": corpus,
            "gguf": None if why else models.fetch_gguf(embedded, paths.home() / "bench"
                                                       / "gguf" / embedded.gguf_file)}


def samples_corpus(model_path: Path, tokens: int, folder: Path) -> Path:
    """Copies of samples/ of about `tokens` of the model's tokens in `folder` (built once)."""
    from starqa import models

    corpus = folder / f"vs-llamacpp-{model_path.name}-{tokens}"
    if not corpus.exists():
        build_corpus(models.load_tokenizer(model_path), tokens, corpus)
    return corpus


def llamacpp_usable(python: str | None, gguf: Path | None) -> Path | None:
    """The GGUF for llama.cpp's side of a smoke run, or None after a line saying why that
    side is skipped."""
    why = llamacpp_missing(python)
    if why is None and gguf is None:
        why = "no --gguf given (the toy model has none)"
    if why:
        print(f"llama.cpp side skipped: {why}; starqa's side runs alone", flush=True)
        return None
    return gguf


def llamacpp_missing(python: str | None) -> str | None:
    """Why llama.cpp's side cannot run with `python`, or None where it can."""
    if python is None:
        return "no --llamacpp-python given"
    if subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode:
        return f"llama_cpp is not importable by {python}"
    return None


def run_engines(args, setup: dict, folder: Path):
    """Ingest the corpus, then the engines interleaved round by round: (rounds, the warm
    group, llama.cpp or None, transformers' numbers, tokens decoded)."""
    from starqa import engine
    from starqa.cache import store

    name = setup["corpus"].name
    manifest = engine.ingest(engine.IngestOptions(paths=(str(setup["corpus"]),),
                                                  model=setup["spec"], name=name)).manifest
    context, query = prompt_ids(setup, manifest)
    print(f"context {len(context):,} tokens ({manifest.method.name}, "
          f"{len(manifest.blocks)} blocks, {manifest.dtype}), question "
          f"{len(query)} tokens", flush=True)

    # Engines interleaved, round by round: a shared CPU's speed drifts by ±15% within an
    # hour, so each ratio is taken within a round and the medians are reported.
    group = StarqaWarm(manifest.key)
    cpp = None
    try:
        n_new = max(len(group.ask(args.new_tokens)["tokens"]), 2)  # also a warm-up
        if setup["gguf"] is not None:
            cpp = LlamaCpp(args.llamacpp_python, setup["gguf"], context, query, n_new, folder)
        rounds = []
        for index in range(args.rounds):
            one = {"warm": group.ask(n_new), "plain": group.ask(n_new, 0)}
            if cpp is not None:
                one.update(cpp=cpp.restore(), cpp_lookup=cpp.restore(lookup=True))
            one["cold"] = starqa_cold(name, n_new)
            rounds.append(one)
            print(f"round {index + 1}: " + round_line(rounds[-1]), flush=True)
    finally:
        group.close()
    dense = transformers_dense(setup["path"], context, query, n_new)
    store.remove_context(manifest)
    return rounds, group, cpp, dense, n_new


def prompt_ids(setup: dict, manifest) -> tuple[list[int], list[int]]:
    """(the context's token ids as `ingest` packed them into `manifest`, the question's)."""
    from starqa import models
    from starqa.corpus import prompt

    return (context_ids(setup["path"], setup["corpus"], manifest),
            prompt.tokenize_query(models.load_tokenizer(setup["path"]), QUESTION))


def context_ids(model_path: Path, folder: Path, manifest) -> list[int]:
    """The token ids of the context `ingest` packed from `folder` into `manifest`."""
    from starqa import corpus, models
    from starqa.corpus import prompt
    from starqa.reingest import packorder

    files = packorder.as_packed(corpus.collect([str(folder)]).files, manifest)
    packed, spans = corpus.pack(files)
    context = prompt.tokenize_context(models.load_tokenizer(model_path), packed, spans).ids
    assert len(context) == manifest.n_tokens
    return context


def report(args, rounds: list[dict], group: StarqaWarm, cpp, dense: dict, n_new: int) -> None:
    """The table of medians, the targets (with llama.cpp) and what the last round said."""
    def median(engine: str, field: str) -> float:
        values = [r[engine][field] if engine != "cold" else r["cold"][0] for r in rounds]
        return statistics.median(values)

    warm_decode, warm_first = median("warm", "decode_ms_per_token"), median("warm",
                                                                            "first_token_s")
    rows = [
        ("starqa cold ask (command start → first byte)", median("cold", ""), None),
        (f"starqa warm group ({group.weights} weights, {DRAFT_TOKENS} drafted tokens)",
         warm_first, warm_decode),
        ("starqa warm group, no drafts (draft_tokens 0)", median("plain", "first_token_s"),
         median("plain", "decode_ms_per_token")),
        ("transformers bf16, context KV in memory", dense["first_token_s"],
         dense["decode_ms_per_token"]),
    ]
    if cpp is not None:
        rows += [
            (f"llama.cpp, state restored (load {median('cpp', 'load_s'):.2f} s + restore "
             f"{median('cpp', 'restore_s'):.2f} s + question)", median("cpp", "question_s"),
             median("cpp", "decode_ms_per_token")),
            (f"llama.cpp, the same, prompt-lookup drafts ({DRAFT_TOKENS} tokens)",
             median("cpp_lookup", "question_s"), median("cpp_lookup", "decode_ms_per_token")),
        ]
    print(f"\n{n_new} tokens decoded greedily by each engine; medians of {args.rounds} rounds "
          "(transformers: one run)\n")
    print(f"{'system':<72} {'first token':>12} {'decode':>14}")
    for label, first, decode in rows:
        dec = f"{decode:.1f} ms/token" if decode is not None else "—"
        print(f"{label:<72} {first:>10.2f} s {dec:>14}")
    last = rounds[-1]
    print(f"\nstarqa's answer: {last['warm']['text']!r}")
    print(f"starqa cold ask's own report: {last['cold'][1]} (from its start, after Python "
          "began)")
    print(f"starqa's tokens with and without drafts equal: "
          f"{last['warm']['tokens'] == last['plain']['tokens'][:len(last['warm']['tokens'])]}")
    if cpp is not None:
        report_llamacpp(rounds, cpp, n_new, median)


def report_llamacpp(rounds: list[dict], cpp, n_new: int, median) -> None:
    """starqa against llama.cpp: like for like, the targets, the tokens each chose."""
    warm_decode, cpp_decode = median("warm", "decode_ms_per_token"), median(
        "cpp", "decode_ms_per_token")
    warm_first, cpp_question = median("warm", "first_token_s"), median("cpp", "question_s")
    cold, cpp_cold = median("cold", ""), median("cpp", "cold_s")
    print("\nLike for like: without drafts starqa / llama.cpp "
          f"{median('plain', 'decode_ms_per_token') / cpp_decode:.2f}; both with drafts "
          f"{warm_decode / median('cpp_lookup', 'decode_ms_per_token'):.2f}")
    print("\nTargets (ratios of the medians; per round: min-max):")
    for label, ours, theirs, target, field in (
            ("decode", warm_decode, cpp_decode, 1, "decode"),
            ("warm first token", warm_first, cpp_question, 1, "warm"),
            ("cold first token", cold, cpp_cold, 2, "cold")):
        per_round = [ratios(r)[field] for r in rounds]
        print(f"  {label}: starqa {ours:.3f} / llama.cpp {theirs:.3f} = {ours / theirs:.2f} "
              f"(target ≤ {target}; rounds {min(per_round):.2f}-{max(per_round):.2f})")
    last = rounds[-1]
    print(f"llama.cpp's tokens with and without drafts equal: "
          f"{last['cpp_lookup']['tokens'] == last['cpp']['tokens']}")
    same = sum(a == b for a, b in zip(last["warm"]["tokens"], last["cpp"]["tokens"]))
    print(f"greedy tokens equal to llama.cpp's: {same} of {min(len(last['warm']['tokens']), n_new)}"
          " (different 4-bit kernels round differently)")
    print(f"llama.cpp: {last['cpp']['system_info'].strip()}; state file "
          f"{cpp.saved.get('state_bytes', 0) / 1e6:.0f} MB, context prefill "
          f"{cpp.saved['prefill_s']:.1f} s")


def ratios(one: dict) -> dict:
    """starqa / llama.cpp within one round: decode, warm first token, cold first token."""
    warm, cpp, cold = one["warm"], one["cpp"], one["cold"][0]
    return {"decode": warm["decode_ms_per_token"] / cpp["decode_ms_per_token"],
            "warm": warm["first_token_s"] / cpp["question_s"], "cold": cold / cpp["cold_s"]}


def round_line(one: dict) -> str:
    """One round's numbers (and ratios, when llama.cpp ran)."""
    if "cpp" not in one:
        return (f"decode {one['warm']['decode_ms_per_token']:.1f} ms/token, warm first token "
                f"{one['warm']['first_token_s']:.2f} s, cold {one['cold'][0]:.2f} s, no drafts "
                f"{one['plain']['decode_ms_per_token']:.1f} ms/token")
    r = ratios(one)
    return (f"decode {one['warm']['decode_ms_per_token']:.1f} vs "
            f"{one['cpp']['decode_ms_per_token']:.1f} ms/token ({r['decode']:.2f}); warm first "
            f"token {one['warm']['first_token_s']:.2f} vs {one['cpp']['question_s']:.2f} s "
            f"({r['warm']:.2f}); cold {one['cold'][0]:.2f} vs {one['cpp']['cold_s']:.2f} s "
            f"({r['cold']:.2f}); no drafts {one['plain']['decode_ms_per_token']:.1f}, llama.cpp "
            f"drafts {one['cpp_lookup']['decode_ms_per_token']:.1f} ms/token")

# ---------------------------------------------------------------------------- --first-ask


def run_first_asks(args, setup: dict, folder: Path) -> tuple[list[dict], LlamaCpp | None]:
    """--first-ask's rounds, each in a fresh $STARQA_HOME (`first_ask_round`), then
    llama.cpp's cold path (its context state saved once, after the first round's ingest):
    (the rounds, llama.cpp or None where its side is skipped)."""
    from starqa.cache import store
    from starqa.core import paths

    extra = {"STARQA_WEIGHTS": "int4"} if args.smoke else {}
    print("First ask after a fresh ingest in a fresh STARQA_HOME, as a new user meets it; the "
          "model already fetched and converted (linked in, not timed)"
          + ("; STARQA_WEIGHTS=int4 (the toy model)" if extra else ""), flush=True)
    rounds: list[dict] = []
    cpp = None
    for index in range(args.rounds):
        # beside the model cache, so that the model's files are linked, not copied
        home = paths.home() / "bench" / f"first-ask-{os.getpid()}-{index}"
        try:
            one = first_ask_round(args, setup, home, extra)
            if cpp is None and setup["gguf"] is not None:
                context, query = prompt_ids(setup, store.find_context(home / "contexts", None))
                cpp = LlamaCpp(args.llamacpp_python, setup["gguf"], context, query,
                               args.new_tokens, folder)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        if cpp is not None:
            one["cpp"] = cpp.restore()
        rounds.append(one)
        print(f"round {index + 1}: {first_ask_line(one)}", flush=True)
    return rounds, cpp


def first_ask_round(args, setup: dict, home: Path, extra: dict) -> dict:
    """One newcomer's start in `home`, a fresh $STARQA_HOME with the model linked in:
    `starqa ingest CORPUS --model M` (timed whole), then `starqa ask QUESTION` (to its first
    byte), then the warm group that ask leaves is stopped."""
    spec, model = fresh_model(setup, home)
    env = {**os.environ, **extra, "STARQA_HOME": str(home)}
    env.pop("STARQA_MODEL", None)
    ingest_s = timed_ingest(setup["corpus"], spec, env)["ingest_s"]
    prepared = sorted(p.name for p in model.glob(".starqa-phase2-*.safetensors"))
    try:
        first, own = first_byte(["ask", QUESTION, "--max-new-tokens", str(args.new_tokens)],
                                env)
    finally:
        subprocess.run([sys.executable, "-m", "starqa", "stop", "--all"], env=env,
                       capture_output=True)
    return {"ingest_s": ingest_s, "prepared": prepared, "first_s": first, "own": own}


def fresh_model(setup: dict, home: Path) -> tuple[str, Path]:
    """The model in `home`'s models folder as its first download leaves it: its files
    (hard links where they can be, else copies) without the hidden ones starqa derives from
    them (Phase 2's prepared weights, the weights' remembered hash). (the --model to pass,
    the folder)."""
    source = setup["path"]
    target = home / "models" / source.name
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith("."):
            try:
                os.link(file, target / file.name)
            except OSError:  # another file system
                shutil.copy2(file, target / file.name)
    return model_spec(setup, target), target


def model_spec(setup: dict, target: Path) -> str:
    """The --model that names the model placed at `target` in a home's models folder: an
    embedded name resolves to models/NAME of the home; any other model by its path."""
    return setup["spec"] if setup["spec"] == setup["path"].name else str(target)


def first_ask_line(one: dict) -> str:
    """One --first-ask round's numbers (and the ratio, when llama.cpp ran)."""
    line = (f"ingest {one['ingest_s']:.2f} s, first ask {one['first_s']:.2f} s to its first "
            "byte")
    if "cpp" in one:
        line += (f"; llama.cpp cold {one['cpp']['cold_s']:.2f} s "
                 f"({one['first_s'] / one['cpp']['cold_s']:.2f})")
    return line


def report_first_asks(args, rounds: list[dict], cpp: LlamaCpp | None) -> None:
    """--first-ask's medians, what the ingest prepared, and the ratio to llama.cpp's cold
    path where its side ran."""
    def median(field: str, engine: str | None = None) -> float:
        return statistics.median(r[engine][field] if engine else r[field] for r in rounds)

    last = rounds[-1]
    print(f"\nFirst ask after a fresh ingest; medians of {len(rounds)} rounds")
    print(f"  starqa ingest (a fresh home; Phase 1, then Phase 2's weights prepared): "
          f"{median('ingest_s'):.2f} s")
    print(f"  prepared by the ingest: {', '.join(last['prepared']) or 'nothing (dense weights)'}")
    print(f"  starqa's first ask, command start → first byte: {median('first_s'):.2f} s "
          f"(its own report: {last['own'] or '—'})")
    if cpp is None:
        print("  llama.cpp: skipped (no --llamacpp-python whose python imports llama_cpp), "
              "so no ratio")
        return
    cold = median("cold_s", "cpp")
    print(f"  llama.cpp cold path (load {median('load_s', 'cpp'):.2f} s + restore "
          f"{median('restore_s', 'cpp'):.2f} s + question {median('question_s', 'cpp'):.2f} s): "
          f"{cold:.2f} s; its context prefill and state save, once: "
          f"{cpp.saved['prefill_s']:.1f} s")
    per_round = [r["first_s"] / r["cpp"]["cold_s"] for r in rounds]
    print(f"\nTarget: starqa's first ask / llama.cpp's cold path = "
          f"{median('first_s') / cold:.2f} (target ≤ 2; rounds "
          f"{min(per_round):.2f}-{max(per_round):.2f})")


# ---------------------------------------------------------------------------- --ingest

WARM_UP_TOKENS = 500  # the untimed warm-up's context (with --smoke: half the toy's)
INGEST_REPORT = re.compile(r"Encoded in ([\d.]+) s \([\d,]+ tokens/s\); total ([\d.]+) s")


def run_ingests(args, setup: dict, folder: Path) -> dict[int, list[dict]]:
    """--ingest's rounds after an untimed warm-up (`warm_up`): in each round, for each size,
    a fresh `starqa ingest` (`starqa_ingest`), then llama.cpp's load + prefill of the tokens
    it encoded (where its side runs): {size: one dict per round}."""
    extra = {"STARQA_WEIGHTS": "int4"} if args.smoke else {}
    print("Phase 1: `starqa ingest` in a fresh context cache, from the command's start to its "
          "exit, the model already fetched, converted and its Phase 2 weights prepared "
          "(linked in, not timed), against llama.cpp's load + prefill of the same tokens "
          "in a fresh process (flash attention on, batches of 512)"
          + ("; STARQA_WEIGHTS=int4 (the toy model)" if extra else ""), flush=True)
    warm_up(args, setup, folder, extra)
    corpora = {size: sized_corpus(args, setup, size, folder) for size in args.tokens}
    ids: dict[int, list[int]] = {}
    rounds: dict[int, list[dict]] = {size: [] for size in args.tokens}
    for index in range(args.rounds):
        for size in args.tokens:
            one, context = starqa_ingest(setup, corpora[size], extra, size not in ids)
            ids.setdefault(size, context)  # the first run's: the same corpus packs the same
            one["tokens"] = len(ids[size])
            if setup["gguf"] is not None:
                one["cpp"] = llamacpp_prefill(args.llamacpp_python, setup["gguf"], ids[size],
                                              folder)
            rounds[size].append(one)
            print(f"round {index + 1}, {size:,} tokens: {ingest_line(one)}", flush=True)
    return rounds


def sized_corpus(args, setup: dict, tokens: int, folder: Path) -> Path:
    """A corpus of about `tokens` tokens: with --smoke the toy's words, else copies of
    samples/."""
    if args.smoke:
        import toy

        return toy.corpus(folder / f"vs-llamacpp-toy-{tokens}", tokens)
    return samples_corpus(setup["path"], tokens, folder)


def warm_up(args, setup: dict, folder: Path, extra: dict) -> None:
    """Both sides once on a small context, untimed: Phase 2's weights prepared beside the
    model (once per model, and no part of Phase 1: later ingests find them), each side's
    model file read into the page cache."""
    tokens = min(WARM_UP_TOKENS, min(args.tokens) // 2)
    started = time.perf_counter()
    _, context = starqa_ingest(setup, sized_corpus(args, setup, tokens, folder), extra, True)
    if setup["gguf"] is not None:
        llamacpp_prefill(args.llamacpp_python, setup["gguf"], context, folder)
    print(f"warm-up on {len(context):,} tokens (untimed): {time.perf_counter() - started:.1f} s",
          flush=True)


def starqa_ingest(setup: dict, corpus: Path, extra: dict, want_ids: bool
                  ) -> tuple[dict, list[int] | None]:
    """`starqa ingest CORPUS --model M` in a fresh $STARQA_HOME with the model linked in
    (`timed_ingest`), then that home removed: (its numbers, the context's token ids where
    wanted, else None)."""
    from starqa.cache import store
    from starqa.core import paths

    # beside the model cache, as --first-ask's homes are
    home = paths.home() / "bench" / f"ingest-{os.getpid()}"
    try:
        one = timed_ingest(corpus, linked_model(setup, home),
                           {**os.environ, **extra, "STARQA_HOME": str(home)})
        context = (context_ids(setup["path"], corpus, store.find_context(home / "contexts",
                                                                          None))
                   if want_ids else None)
    finally:
        shutil.rmtree(home, ignore_errors=True)  # the link goes, never the model it names
    return one, context


def linked_model(setup: dict, home: Path) -> str:
    """The model's folder linked (a symbolic link) into `home`'s models folder, with the
    files starqa derives from it (Phase 2's prepared weights, written there by the warm-up
    or an earlier ingest): the --model to pass."""
    source = setup["path"]
    target = home / "models" / source.name
    target.parent.mkdir(parents=True)
    target.symlink_to(source.resolve(), target_is_directory=True)
    return model_spec(setup, target)


def timed_ingest(corpus: Path, spec: str, env: dict) -> dict:
    """`starqa ingest CORPUS --model SPEC` timed from its start to its exit, with what its
    own report says (Phase 1's encode seconds, its total; None where it says neither) and
    the report's lines (from its plan, where it says one, or `Ingested`, to the table of
    the largest files)."""
    env = {**env, "COLUMNS": "400"}  # its report's lines (a plan's too) unwrapped
    env.pop("STARQA_MODEL", None)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "starqa", "ingest", str(corpus),
                           "--model", spec], env=env, capture_output=True, text=True)
    ingest_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"starqa ingest failed:\n{proc.stderr[-3000:]}")
    lines = proc.stderr.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(("Plan:", "Ingested"))),
                 0)
    last = next((i for i, line in enumerate(lines) if line.startswith("Largest files")),
                len(lines))
    own = INGEST_REPORT.search(" ".join(proc.stderr.split()))
    return {"ingest_s": ingest_s, "encode_s": float(own[1]) if own else None,
            "total_s": float(own[2]) if own else None, "report": lines[first:last]}


def llamacpp_prefill(python: str, gguf: Path, context: list[int], folder: Path) -> dict:
    """llama.cpp's load + prefill of `context` in a fresh process (llamacpp_side.py prefill):
    every core, flash attention on; its load_s, prefill_s and system_info."""
    job = folder / "prefill-job.json"
    job.write_text(json.dumps({"context_ids": context, "threads": os.cpu_count(),
                               "n_ctx": len(context) + 16, "flash_attn": True}))
    return llamacpp_side(python, "prefill", gguf, folder / "no-state.bin", job)


def cpp_s(one: dict) -> float:
    """llama.cpp's load + prefill seconds in one --ingest run."""
    return one["cpp"]["load_s"] + one["cpp"]["prefill_s"]


def ingest_line(one: dict) -> str:
    """One --ingest run's numbers (and the ratio, when llama.cpp ran)."""
    own = ("" if one["encode_s"] is None
           else f" (its own report: encoded in {one['encode_s']:.1f} s)")
    line = f"starqa ingest {one['ingest_s']:.2f} s{own}, {one['tokens']:,} tokens"
    if "cpp" in one:
        line += (f"; llama.cpp load {one['cpp']['load_s']:.2f} s + prefill "
                 f"{one['cpp']['prefill_s']:.2f} s ({one['ingest_s'] / cpp_s(one):.2f})")
    return line


def report_ingests(args, rounds: dict[int, list[dict]]) -> None:
    """--ingest's medians per size: starqa's whole ingest, llama.cpp's load + prefill, the
    ratio against its target, tokens/s; starqa's own report and llama.cpp's build last."""
    print(f"\nPhase 1 side by side; medians of {args.rounds} round(s) per size")
    for size, runs in rounds.items():
        report_ingest_size(size, runs)
    last = rounds[args.tokens[-1]][-1]
    print("\nstarqa ingest's own report (the last run):")
    for line in last["report"]:
        print(f"  {line}")
    if "cpp" in last:
        print(f"llama.cpp: {last['cpp']['system_info'].strip()}")


def report_ingest_size(size: int, runs: list[dict]) -> None:
    """One size's lines of --ingest's report."""
    def median(pick) -> float:
        return statistics.median(pick(one) for one in runs)

    tokens, ours = runs[0]["tokens"], median(lambda one: one["ingest_s"])
    print(f"\n~{size:,} tokens ({tokens:,} in the context):")
    own = ("" if runs[0]["encode_s"] is None else
           f"; its own report: encoded in {median(lambda one: one['encode_s']):.2f} s, total "
           f"{median(lambda one: one['total_s']):.2f} s")
    print(f"  starqa ingest, command start → exit: {ours:.2f} s "
          f"({tokens / ours:,.0f} tokens/s){own}")
    if "cpp" not in runs[0]:
        print("  llama.cpp: skipped (no --llamacpp-python whose python imports llama_cpp, or "
              "no GGUF), so no ratio")
        return
    load, prefill = median(lambda one: one["cpp"]["load_s"]), median(
        lambda one: one["cpp"]["prefill_s"])
    theirs = median(cpp_s)
    print(f"  llama.cpp load {load:.2f} s + prefill {prefill:.2f} s = {theirs:.2f} s "
          f"({tokens / theirs:,.0f} tokens/s; the prefill alone {tokens / prefill:,.0f})")
    per_round = [one["ingest_s"] / cpp_s(one) for one in runs]
    print(f"  Target: starqa ingest / llama.cpp load + prefill = {ours / theirs:.2f} "
          f"(target ≤ 0.20; rounds {min(per_round):.2f}-{max(per_round):.2f})")


if __name__ == "__main__":
    main()
