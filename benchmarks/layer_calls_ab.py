"""A real decode, each layer's steps around its attention in one compiled call each
(starqa/_layer.c, what runs) against the same kernels called one by one from Python, side
by side in one process: one answer's worker (`Answerer`, as `ask` and the warm groups run
it) on a cached context, alternating the two, `--rounds` answers of 16 tokens each, the
medians compared (this kind of machine drifts by a third between runs minutes apart):

    python benchmarks/layer_calls_ab.py CONTEXT_DIR [--attention exact,topk] [--rounds 6]

CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s. exact decodes
with its default drafts, top-k (1%, ivf) without, as users get them. The two give the same
tokens (the same bits), which is checked.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from starqa import bench, dist, indexes, models
from starqa.answering import Answerer
from starqa.ask import question_ids
from starqa.manifest import read_manifest

QUESTION = "Which function merges the partial attentions of the workers?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--attention", default="exact,topk")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {bench.cpu_info()}, {args.threads} threads")
    for attention in args.attention.split(","):
        manifest = read_manifest(args.context)
        index = "ivf" if attention == "topk" else None
        if index:
            manifest = indexes.ensure(manifest, index)
        settings = indexes.topk_settings(attention, "1%" if index else None, None, index, False)
        path = models.resolve_model(manifest.model.spec)
        query = question_ids(manifest, path, QUESTION)[1]
        answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
        decoder = answerer.decoder
        if not decoder.layer_kernels:
            raise SystemExit("this decoder runs its layers' kernels one by one only "
                             "(no int4 tiles or no compiled kernels here)")
        # a layer at a time either way (starqa/_step.c's one call for all of them:
        # benchmarks/decode_split.py)
        answerer.hook.compiled = lambda *_: None
        answerer.answer(query, 4, set(), None)  # warm: tables, pages, scratch
        times, tokens = {True: [], False: []}, {}
        for _ in range(args.rounds):
            for fused in (True, False):
                decoder.layer_kernels = fused
                stamps = []
                tokens[fused], _ = answerer.answer(query, 16, set(),
                                                   lambda _: stamps.append(time.perf_counter()))
                times[fused].append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
        decoder.layer_kernels = True
        print(f"{manifest.n_tokens:,} tokens, {attention}{' (ivf, 1%)' if index else ''}; "
              f"the same tokens: {tokens[True] == tokens[False]}")
        for fused, label in ((True, "one call a layer side"), (False, "kernels one by one")):
            found = sorted(times[fused])
            print(f"    {label:>22}: median {statistics.median(found):.1f} ms/token "
                  f"(min {found[0]:.1f}, max {found[-1]:.1f})")
        del answerer, decoder


if __name__ == "__main__":
    main()
