"""Many questions at once on one context: N questions sent together to its warm group (the
door's path, `starqa.api.Service`, as HTTP and MCP clients reach it), against each asked
alone, side by side in one run.

    python benchmarks/many_questions.py [--tokens 6000] [--counts 1,2,4,8] [--max-new-tokens 64]
    python benchmarks/many_questions.py --smoke   # toy model and context (benchmarks/toy.py)

Prints, on this CPU (its model and the flags that pick the kernels): each question asked
alone (time to first token, answer tokens), then for each N the round's wall time, the
aggregate answer tokens a second over the round (from the first token of any to the end of
the last: decode) and its ratio to one question's alone, each
question's time to first token (median and worst) and the worst against the same question
asked alone, and whether every answer is token for token the one it got alone (so it is on
the CPU with int8/int4 weights, the default; with dense weights, up to rounding: an answer
that differs is shown). Timings: run it on an otherwise idle CPU.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from engine_bench import scratch_setup
from vs_llamacpp import cpu_line

QUESTIONS = ["Summarize the travel policy: budgets, allowances and who approves what.",
             "Describe the password rules of the security handbook in detail.",
             "Explain how annual leave works for new and long-serving employees.",
             "List what the code in the samples does, file by file.",
             "What must an employee do before booking a trip, step by step?",
             "Describe the retry and timeout settings the code uses.",
             "Explain the expense claims process from receipt to payment.",
             "Which rules apply to working from home, and who decides?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a toy model and a few hundred tokens: the run, not the numbers")
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    if args.smoke:
        counts, args.max_new_tokens = [1, 2, 3], 8

    from starqa import engine
    from starqa.api.groups import GroupSettings
    from starqa.api.service import Service
    from starqa.phase2.answer import Question
    from starqa.workers import client

    home, model_path, _, corpus = scratch_setup(args, "many")
    if not args.smoke:  # the user's models (and their prepared weights), not a copy
        from starqa.core import paths

        paths.models_dir().parent.mkdir(parents=True, exist_ok=True)
        paths.models_dir().symlink_to(model_path.parent, target_is_directory=True)
    # the model by its name, as users give it: an embedded model answers in its Phase 2
    # format (int4 on a CPU), where a row's result never depends on the others
    manifest = engine.ingest(engine.IngestOptions(
        paths=(str(corpus),), model=str(model_path) if args.smoke else args.model,
        workers=args.workers)).manifest
    service = Service(GroupSettings(workers=args.workers, keepalive=0))
    try:
        def ask(text: str):
            return service.ask(Question(text, manifest.key,
                                        max_new_tokens=args.max_new_tokens))

        ask(QUESTIONS[0])  # the group started, warmed up
        alone = {q: ask(q) for q in QUESTIONS[:max(counts)]}
        print(f"{cpu_line()}")
        print(f"context {manifest.n_tokens:,} tokens ({manifest.method.name}), model "
              f"{model_path.name}, answers up to {args.max_new_tokens} tokens")
        for q, a in alone.items():
            print(f"  alone: first token {a.timings.first_token_s:6.3f} s, "
                  f"{a.answer_tokens:3d} tokens in {a.timings.total_s:6.3f} s  {q}")
        one = None
        print(f"{'N':>3} {'wall s':>8} {'decode t/s':>10} {'x one':>6} {'TTFT med':>9} "
              f"{'TTFT max':>9} {'max/alone':>9}  same answers")
        for n in counts:
            asked = QUESTIONS[:n]
            answers: list = [None] * n
            gate = threading.Barrier(n)

            def run(i: int) -> None:
                gate.wait()
                answers[i] = ask(asked[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            first_token = min(a.timings.first_token_s or wall for a in answers)
            rate = sum(a.answer_tokens - 1 for a in answers) / (wall - first_token)
            one = one or rate
            firsts = [a.timings.first_token_s or wall for a in answers]
            worst = max(f / (alone[q].timings.first_token_s or wall)
                        for f, q in zip(firsts, asked))
            same = all(a.token_ids == alone[q].token_ids for a, q in zip(answers, asked))
            print(f"{n:3d} {wall:8.2f} {rate:10.1f} {rate / one:6.2f} "
                  f"{statistics.median(firsts):9.3f} {max(firsts):9.3f} {worst:9.2f}  "
                  f"{'yes' if same else 'NO'}", flush=True)
            for a, q in zip(answers, asked):
                if a.token_ids != alone[q].token_ids:
                    print(f"    differs: {q!r} ({a.finish}, {a.answer_tokens} tokens) alone: "
                          f"{alone[q].text!r}\n    beside others: {a.text!r}")

    finally:
        client.stop_group(manifest.key)


if __name__ == "__main__":
    main()
