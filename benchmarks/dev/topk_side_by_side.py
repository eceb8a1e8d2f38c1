"""Phase 2 with exact or top-k attention on a cached context, one run in this process:
exact against top-k side by side (docs/results.md, "Top-k attention"), for CPUs too
busy for `starqa bench` (CPU time, not wall time, and one torch thread by default, so
another job on the other core changes little).

    python benchmarks/dev/topk_side_by_side.py CONTEXT_DIR exact
    python benchmarks/dev/topk_side_by_side.py CONTEXT_DIR ivf --kv-on-disk [--top-k 1%]
    python benchmarks/dev/topk_side_by_side.py CONTEXT_DIR flat --threads 2 --new 32 \\
        --draft-tokens 0

CONTEXT_DIR: a context folder (its manifest.json), e.g. one `starqa bench --json` kept, or
`starqa ingest`'s. Each variant should run in a fresh process (peak memory is the
process's max RSS). Prints load seconds, decode CPU ms per token and wall ms per token, RSS
after loading and the peak, and the first generated tokens.
"""

import argparse
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("attention", choices=["exact", "flat", "ivf", "hnsw"])
    parser.add_argument("--top-k", default="1%")
    parser.add_argument("--kv-on-disk", action="store_true")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="drafted tokens per step (default: starqa's; 0: one token a step)")
    parser.add_argument("--question", default="Which function merges the partial attentions "
                                              "of the workers?")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from starqa.runtime import dist
    from starqa.topk import indexes
    from starqa import models
    from starqa.phase2.answerer import Answerer
    from starqa.launchers.query import question_ids
    from starqa.cache.manifest import read_manifest

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    manifest = read_manifest(args.context)
    settings = None
    if args.attention != "exact":
        settings = indexes.topk_settings("topk", args.top_k, None, args.attention,
                                         args.kv_on_disk)
        manifest = indexes.ensure(manifest, args.attention)
    path = models.resolve_model(manifest.model.spec)
    # as `starqa ask` does: the plain tokenizers library (transformers' import alone is
    # ~170 MB of resident memory, which would count in both peaks)
    query = question_ids(manifest, path, args.question)[1]
    started = time.perf_counter()
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
    loaded, load_rss = time.perf_counter() - started, rss_mb()
    first: list[tuple[float, float]] = []  # (wall, cpu) at the first token

    def on_token(token: int) -> None:
        if not first:
            first.append((time.perf_counter(), time.process_time()))

    tokens, _ = answerer.answer(query, args.new, set(), on_token,
                                draft_tokens=args.draft_tokens)
    wall, cpu = time.perf_counter(), time.process_time()
    steps = max(1, len(tokens) - 1)
    label = args.attention + (" kv-on-disk" if args.kv_on_disk else "")
    print(f"{label}: load {loaded:.1f} s, decode {(cpu - first[0][1]) / steps * 1e3:.1f} CPU "
          f"ms/token ({(wall - first[0][0]) / steps * 1e3:.1f} wall), RSS {load_rss:,.0f} MiB "
          f"loaded, peak {rss_mb():,.0f} MiB, tokens {tokens[:8]}")


if __name__ == "__main__":
    main()
