"""`starqa bench`'s Phase 2 rows, exact against top-k, on a context already cached: the
bench's own code (`starqa.measure.bench.phase2`: torchrun workers, wall time, each worker's peak
memory), without encoding the context again. Where Phase 1 of a long context takes most
of an hour (32K on 2 cores of an AVX2 CPU), encode it once and measure Phase 2 as often
as needed:

    python benchmarks/dev/topk_phase2.py CONTEXT_DIR --top-k 1% --index flat,ivf --kv-on-disk \\
        [--rounds 3]

CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s. The question
and the tokens generated are the bench's (16 by default, every one decoded).
"""

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

from starqa.cli.options import TopKChoice, compared
from starqa.measure import bench
from starqa import engine, models
from starqa.corpus import prompt
from starqa.launchers.query import checked_model
from starqa.cache.manifest import read_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--top-k", default="1%")
    parser.add_argument("--index", default="flat,ivf")
    parser.add_argument("--kv-on-disk", action="store_true")
    parser.add_argument("--top-k-prefill", default=None)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1,
                        help="exact and each top-k this many times, alternating (medians)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    topk = compared(TopKChoice(top_k=args.top_k, index=args.index, kv_on_disk=args.kv_on_disk,
                               prefill=args.top_k_prefill))
    opts = bench.options(lengths="1k", workers=str(args.workers), new_tokens=args.new_tokens,
                         topk=topk, rounds=args.rounds)
    manifest = read_manifest(args.context)
    tokenizer = models.load_tokenizer(checked_model(manifest, None))
    query_ids = prompt.tokenize_query(tokenizer, bench.QUESTION)
    print(f"{manifest.n_tokens:,} tokens, {len(manifest.blocks)} blocks; CPU: "
          f"{bench.cpu_info()}")
    exact, rows, _ = bench.phase2(manifest, query_ids, args.workers, opts,
                                lambda: nullcontext(engine.UI()), print)
    exact_row = {"first_token_seconds": exact.timings.prefill_s,
                 "seconds_per_token": bench.per_token(exact),
                 "peak_bytes": max(exact.peak_bytes)}
    print(f"    exact: first token {exact_row['first_token_seconds']:.2f} s, "
          f"{exact_row['seconds_per_token'] * 1e3:.1f} ms/token, "
          f"peak {exact_row['peak_bytes'] / 2**20:,.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"exact": exact_row, "topk": rows}, indent=1))


if __name__ == "__main__":
    main()
