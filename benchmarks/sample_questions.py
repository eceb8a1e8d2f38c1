"""Accuracy on samples/questions.jsonl for each method, side by side on the same questions.

    python benchmarks/sample_questions.py [--methods dense star] [--workers 2] [--json out.json]
    python benchmarks/sample_questions.py --smoke   # toy model, corpus and two questions

Phase 1 runs through the real `starqa ingest` path (torchrun workers); Phase 2 runs in
this process as a world of one (the merge is exact, so N workers give the same tokens) so
the model loads once per method. A question counts as correct when any expected answer is
a case-insensitive substring of the model's answer. Accuracy only: the answers do not
depend on the CPU or its flags beyond rounding. --smoke asks the toy model of
benchmarks/toy.py two questions about a few hundred tokens, in a scratch cache.
"""

import argparse
import json
import time
from pathlib import Path

from starqa import engine

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["dense", "star"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None, help="write per-question results here")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model and corpus, two questions, 8 answer tokens")
    args = parser.parse_args()
    samples = toy_samples(args) if args.smoke else ROOT / "samples"

    questions = [json.loads(line) for line in (samples / "questions.jsonl").open()]
    results: dict[str, list[dict]] = {}
    for method in args.methods:
        ingested = engine.ingest(engine.IngestOptions(
            paths=(str(samples),), model=args.model, method=method,
            workers=args.workers, name=f"samples-{method}"))
        session = engine.LocalAnswerer.load(ingested.manifest)
        rows = []
        for q in questions:
            started = time.perf_counter()
            answer = session.ask(q["question"], args.max_new_tokens)
            ok = any(a.lower() in answer.text.lower() for a in q["answers"])
            rows.append({"question": q["question"], "expected": q["answers"], "answer": answer.text,
                         "correct": ok, "seconds": round(time.perf_counter() - started, 2)})
        results[method] = rows
        print(f"{method}: {sum(r['correct'] for r in rows)}/{len(rows)} correct "
              f"({ingested.manifest.n_tokens:,} context tokens, "
              f"{len(ingested.manifest.blocks)} blocks)", flush=True)

    print()
    print("| question | " + " | ".join(args.methods) + " |")
    print("|---|" + "---|" * len(args.methods))
    for i, q in enumerate(questions):
        marks = ["✓" if results[m][i]["correct"] else "✗" for m in args.methods]
        print(f"| {q['question']} | " + " | ".join(marks) + " |")
    totals = [sum(r["correct"] for r in results[m]) for m in args.methods]
    print("| **correct** | " + " | ".join(f"**{t}/{len(questions)}**" for t in totals) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def toy_samples(args) -> Path:
    """--smoke: the toy corpus with two questions (left out of the context as samples/
    leaves its own), the toy model, short answers."""
    import toy

    toy.banner("sample_questions")
    folder = toy.scratch("questions")
    args.model, args.max_new_tokens = str(toy.model(folder)), 8
    samples = toy.corpus(folder / "samples")
    (samples / ".starqaignore").write_text("questions.jsonl\n")
    (samples / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in (
        {"question": "what is the answer", "answers": ["answer"]},
        {"question": "who approved the travel budget", "answers": ["office"]})))
    return samples


if __name__ == "__main__":
    main()
