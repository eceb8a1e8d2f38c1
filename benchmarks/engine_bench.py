"""The cache against no cache: time to first token of `starqa ask` over a cached context of
~8K tokens of real files, against answering the same question with one dense forward over
the full prompt, in one run.

    python benchmarks/engine_bench.py [--tokens 7600] [--model smollm2-135m]
    python benchmarks/engine_bench.py --smoke   # toy model and context (benchmarks/toy.py)

Ingests copies of samples/ with star on 2 workers, then compares: cold (a fresh torchrun
group, as `starqa ask` runs, against a fresh process that loads the model) and warm (model
and shards loaded, against the model loaded). Both sides run on the CPU with the threads
torch gives them (every core); the speed of both follows the CPU's vector flags (AVX-512
and its bf16/VNNI extensions, else AVX2). Phase 1 and Phase 2 of every method on their
own (time, FLOPs, memory, bytes communicated): `starqa bench`.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Who approved the 2026 travel budget?"


def build_corpus(tokenizer, target: int, folder: Path) -> None:
    """Copies of samples/ (without the answer key) until about `target` tokens."""
    files = sorted(p for p in (ROOT / "samples").rglob("*")
                   if p.is_file() and p.name not in ("questions.jsonl", ".starqaignore"))
    total, copy = 0, 0
    while True:
        for path in files:
            text = path.read_text()
            cost = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 12
            if total + cost > target:
                return
            dest = folder / f"copy{copy}" / path.relative_to(ROOT / "samples")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            total += cost
        copy += 1


def dense_cold_first_token(model_path: Path, ids: list[int]) -> float:
    """Seconds from starting a fresh Python process to the first token of a dense forward."""
    code = ("import sys, torch; from starqa.models import load_model;"
            f"m = load_model({str(model_path)!r}, dtype=torch.bfloat16);"
            f"ids = torch.tensor([{ids!r}]);"
            "torch.inference_mode().__enter__();"
            "m(ids, logits_to_keep=1).logits.argmax(-1); print('first', flush=True)")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("first"):
            elapsed = time.perf_counter() - started
    proc.wait()
    return elapsed


def scratch_setup(args, name: str) -> tuple[Path, Path, object, Path]:
    """(a scratch $STARQA_HOME, the model folder, its tokenizer, a corpus folder in the
    home) for benchmark `name`_bench: with --smoke the toy model and corpus, else the model
    asked for (from the user's cache) and copies of samples/ of about `args.tokens`."""
    from starqa import models

    if args.smoke:
        import toy

        toy.banner(f"{name}_bench")
        home = toy.scratch(name)
        model_path = toy.model(home)
        return home, model_path, models.load_tokenizer(model_path), toy.corpus(home / "corpus")
    model_path = models.resolve_model(args.model)  # from the user's cache
    home = Path(tempfile.mkdtemp(prefix=f"starqa-{name}-"))
    # contexts go to a scratch cache beside the corpus (an ingest skips its own cache)
    os.environ["STARQA_HOME"] = str(home / "home")
    tokenizer = models.load_tokenizer(model_path)
    build_corpus(tokenizer, args.tokens, home / "corpus")
    return home, model_path, tokenizer, home / "corpus"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=7600)
    parser.add_argument("--model", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a toy model and a few hundred tokens: the run, not the numbers")
    args = parser.parse_args()

    import torch

    from starqa import engine, models
    from starqa.corpus import prompt

    home, model_path, tokenizer, corpus = scratch_setup(args, "engine")

    print(f"cpu cores: {os.cpu_count()}, torch {torch.__version__}, model {model_path.name}")
    star = engine.ingest(engine.IngestOptions(
        paths=(str(corpus),), model=str(model_path), method="star", workers=2,
        name="bench-star")).manifest
    ctx_ids = context_ids(tokenizer, corpus, star)
    query_ids = prompt.tokenize_query(tokenizer, QUESTION)
    full = ctx_ids + query_ids

    print(f"\nPhase 2: time to first token for one question ({len(query_ids)} tokens) "
          f"over {len(ctx_ids):,} context tokens")
    cold = engine.ask(engine.AskOptions(QUESTION, context="bench-star", workers=2,
                                        max_new_tokens=32))
    dense_cold = dense_cold_first_token(model_path, full)
    print(f"  cold  starqa ask (torchrun, 2 workers, load model + shards): "
          f"{cold.timings.first_token_s:6.2f} s   answer: {cold.text[:60]!r}")
    print(f"  cold  dense forward over the full prompt (fresh process):     {dense_cold:6.2f} s"
          f"   ratio {dense_cold / cold.timings.first_token_s:.1f}x")

    session = engine.LocalAnswerer.load(star, model_path)
    session.ask(QUESTION, 1)  # warm-up
    warm = min(session.ask(QUESTION, 1).timings.first_token_s for _ in range(3))
    model = models.load_model(model_path, dtype=torch.bfloat16)
    with torch.inference_mode():
        ids = torch.tensor([full])
        model(ids[:, :64], logits_to_keep=1)  # warm-up
        dense_warm = []
        for _ in range(2):
            started = time.perf_counter()
            model(ids, logits_to_keep=1).logits.argmax(-1)
            dense_warm.append(time.perf_counter() - started)
    print(f"  warm  starqa (model + shards loaded, question only):          {warm:6.2f} s")
    print(f"  warm  dense forward over the full prompt (model loaded):     "
          f"{min(dense_warm):6.2f} s   ratio {min(dense_warm) / warm:.1f}x")
    shutil.rmtree(home, ignore_errors=True)


def context_ids(tokenizer, corpus: Path, manifest):
    from starqa import corpus as corpus_mod
    from starqa.reingest import packorder
    from starqa.corpus import prompt

    files = packorder.as_packed(corpus_mod.collect([corpus]).files, manifest)
    packed, spans = corpus_mod.pack(files)
    return prompt.tokenize_context(tokenizer, packed, spans).ids


if __name__ == "__main__":
    main()
