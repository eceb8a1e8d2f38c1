"""A whole package as a user meets it: `starqa ingest` of an installed package's folder, its
wall time and peak memory, then questions about its code asked together and scored.

    python benchmarks/whole_package.py anyio [--questions 8] [--model M] [--attention topk]
                                             [--keep]
    python benchmarks/whole_package.py --smoke   # toy model and package (benchmarks/toy.py)

The package is any importable one (or a folder of .py files). The ingest runs as a user
runs it (`python -m starqa ingest FOLDER --model M`, timed by vs_llamacpp.timed_ingest;
the planner choosing as it does with no other flags: past the model's window, star blocks
at contiguous positions) into the user's cache, as `starqa ingest` would (a context
already there is found, not encoded again: the report says how many blocks were encoded).
Its peak memory is the largest resident set of the
command and the processes it started. The questions are `starqa eval --tasks repo_qa`'s
(starqa/measure/evals/repo_qa.py: exact answers from the package's own source, each kind
in turn) about the whole package, sent together to the context's warm group
(`starqa.api.ask_all`, the path of `starqa ask --questions`); each is scored as `eval`
scores it (the answer found in the reply) and its top source against the answer's file.

Prints, on this CPU (its model and the flags that pick the kernels): the ingest's plan,
tokens, wall time, tokens a second and peak memory; each question with its answer, the
expected one and the top source; then accuracy and top-1 source. Timings: run it on an
otherwise idle CPU. `--keep` leaves the context in the cache (the default removes it when
this run ingested it).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from pathlib import Path

from vs_llamacpp import cpu_line, timed_ingest

# a package small enough for the toy model's 512-token window, with a question of each kind
SMOKE_PACKAGE = {
    "settings.py": 'TIMEOUT = 30\nGREETING = "hello there"\n',
    "checks.py": "class TooLarge(Exception):\n    pass\n\n\n"
                 "def check(value, limit=17):\n    if value > limit:\n"
                 "        raise TooLarge(value)\n    return value\n",
    "shapes.py": "class Square:\n    def area_of_square(self, side):\n"
                 "        return side * side\n",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="typer",
                        help="an importable package's name, or a folder of .py files")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention", default="exact", help="exact, or topk (k = 1%%)")
    parser.add_argument("--keep", action="store_true", help="leave the context in the cache")
    parser.add_argument("--smoke", action="store_true",
                        help="a toy model and package: the run, not the numbers")
    args = parser.parse_args()

    from starqa import api, models
    from starqa.measure.evals import repo_qa, scoring

    if args.smoke:
        import toy

        toy.banner("whole_package")
        home = toy.scratch("whole")
        args.model = str(toy.model(home))
        folder = home / "toypkg"
        folder.mkdir()
        for name, text in SMOKE_PACKAGE.items():
            (folder / name).write_text(text)
        args.package, args.max_new_tokens = str(folder), 8
    package = repo_qa.load(args.package)
    facts = repo_qa.in_turn(package, random.Random(args.seed),
                            {f.path for f in package.files})[:args.questions]

    known = {c.key for c in api.contexts()}
    ingest = timed_ingest(Path(package.folder), args.model or models.DEFAULT_MODEL,
                          dict(os.environ))
    seconds = ingest["ingest_s"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    ctx = api.contexts()[0]  # the most recently used: the one just ingested or found
    fresh = ctx.key not in known

    print(cpu_line())
    print(f"package {package.name} {package.version or ''} ({len(package.files)} .py files), "
          f"model {ctx.model}")
    for line in ingest["report"]:
        if line.startswith(("Plan:", "Ingested", "Encoded in")):
            print(f"  {line}")
    print(f"ingest: {ctx.tokens:,} tokens in {seconds:,.1f} s "
          f"({ctx.tokens / seconds:,.1f} tokens/s, the whole command), peak memory "
          f"{peak / 2**30:.2f} GiB" + ("" if fresh else " (found in the cache: not encoded)"))

    try:
        started = time.perf_counter()
        streams = api.ask_all([f.text for f in facts], ctx,
                              max_new_tokens=args.max_new_tokens, keepalive=0,
                              attention=api.topk_settings(args.attention))
        answers = [s.result() for s in streams]
        asked = time.perf_counter() - started
    finally:
        api.stop(ctx)
        if fresh and not args.keep:
            api.remove(ctx)
    right = top1 = 0
    for fact, answer in zip(facts, answers):
        ok = scoring.is_correct(answer.text, [fact.answer])
        named = [s.as_dict() for s in answer.sources or ()]
        source = scoring.source_score(named, {"file": fact.file, "line": fact.line})
        right += ok
        top1 += ok and source["top1"]
        top = named[0]["path"] if named else "-"
        print(f"{'right' if ok else 'wrong'}  [{fact.kind}] {fact.text}\n"
              f"       expected {fact.answer!r} ({fact.file}:{fact.line}); top source {top}\n"
              f"       answer: {answer.text.strip()[:160]!r}")
    print(f"accuracy {right}/{len(facts)}; top-1 source the answer's file for {top1} of the "
          f"{right} right; {len(facts)} questions answered together in {asked:,.1f} s")


if __name__ == "__main__":
    main()
