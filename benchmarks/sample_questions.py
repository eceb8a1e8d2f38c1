"""Accuracy on samples/questions.jsonl for each method, side by side on the same questions.

    python benchmarks/sample_questions.py [--methods dense star] [--workers 2] [--json out.json]

Phase 1 runs through the real `starqa ingest` path (torchrun workers); Phase 2 runs in
this process as a world of one (the merge is exact, so N workers give the same tokens) so
the model loads once per method. A question counts as correct when any expected answer is
a case-insensitive substring of the model's answer.
"""

import argparse
import json
import time
from pathlib import Path

from starqa import engine
from starqa.measure.session import LocalSession

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["dense", "star"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None, help="write per-question results here")
    args = parser.parse_args()

    questions = [json.loads(line) for line in (ROOT / "samples/questions.jsonl").open()]
    results: dict[str, list[dict]] = {}
    for method in args.methods:
        ingested = engine.ingest(engine.IngestOptions(
            paths=(str(ROOT / "samples"),), model=args.model, method=method,
            workers=args.workers, name=f"samples-{method}"))
        session = LocalSession(ingested.manifest)
        rows = []
        for q in questions:
            started = time.perf_counter()
            answer = session.answer(q["question"], args.max_new_tokens)
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


if __name__ == "__main__":
    main()
