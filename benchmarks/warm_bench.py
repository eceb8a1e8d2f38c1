"""Warm-worker benchmark: time to first token from a warm group against one dense forward
over the full prompt, side by side in one run, on a cached context of about 8K tokens; then
many consecutive warm questions, printing the query host's memory at the start and the end.

    python benchmarks/warm_bench.py [--tokens 7600] [--questions 200] [--workers 2]
    python benchmarks/warm_bench.py --smoke   # toy model and context (benchmarks/toy.py)

The group's workers and the dense forward share the CPU's cores (torch's threads, split
between the workers); both follow its vector flags (AVX-512 with bf16/VNNI, else AVX2).
"""

import argparse
import os
import shutil
import statistics
import time

from engine_bench import QUESTION, context_ids, scratch_setup

QUESTIONS = ["Who approved the 2026 travel budget?", "What is the default retry limit?",
             "Who is the travel coordinator?", "What is the minimum password length?",
             "Who wrote the tidepool library?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=7600)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a toy model, a few hundred tokens, 5 questions")
    args = parser.parse_args()

    import torch

    from starqa.workers import client, messages
    from starqa import engine, models
    from starqa.corpus import prompt

    home, model_path, tokenizer, corpus = scratch_setup(args, "warm")
    if args.smoke:
        args.questions = min(args.questions, 5)
    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(corpus),), model=str(model_path), workers=args.workers)).manifest
    try:
        group = client.start(manifest.key, args.workers, keepalive=0)
        conn = client.Client(group)

        def ask(question: str, max_new_tokens: int) -> messages.Finished:
            return next(e for e in conn.ask(question, (), max_new_tokens)
                        if isinstance(e, messages.Finished))

        ask(QUESTION, 1)  # warm-up
        warm = [ask(QUESTION, 1).first_token_s for _ in range(5)]

        model = models.load_model(model_path, dtype=torch.bfloat16)
        full = torch.tensor([context_ids(tokenizer, corpus, manifest) +
                             prompt.tokenize_query(tokenizer, QUESTION)])
        dense = []
        with torch.inference_mode():
            model(full[:, :64], logits_to_keep=1)  # warm-up
            for _ in range(2):
                started = time.perf_counter()
                model(full, logits_to_keep=1).logits.argmax(-1)
                dense.append(time.perf_counter() - started)
        del model

        print(f"context {manifest.n_tokens:,} tokens ({manifest.method.name}, "
              f"{len(manifest.blocks)} blocks), {args.workers} warm workers, "
              f"{os.cpu_count()} cores, prompt {full.shape[1]:,} tokens")
        print(f"  warm time to first token (median of 5):      {statistics.median(warm):7.3f} s")
        print(f"  dense forward over the full prompt (best of 2): {min(dense):7.3f} s")
        print(f"  ratio: {min(dense) / statistics.median(warm):.1f}x faster warm")

        first = ask(QUESTIONS[0], 8)
        started = time.perf_counter()
        for i in range(args.questions - 1):
            last = ask(QUESTIONS[i % len(QUESTIONS)], 8)
        elapsed = time.perf_counter() - started
        print(f"\n{args.questions} consecutive warm questions (8 answer tokens each), "
              f"{elapsed / (args.questions - 1):.2f} s per question")
        print(f"  query host RSS after question 1:   {first.rss_bytes / 2**20:8.1f} MB")
        print(f"  query host RSS after question {args.questions}: "
              f"{last.rss_bytes / 2**20:8.1f} MB")
        conn.stop()
        conn.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
