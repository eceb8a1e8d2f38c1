"""ivf's lists as built against laid out by a mean query (starqa.listlayout): a row reads its
~68 nearest lists (32K, k = 1%); as built, a list's place in memory is its block's and its
k-means number (~54 separate runs a row); starqa lays each layer and KV head's lists out by
their centre's inner product with the mean query of a short forward of the worker's first
tokens (`listlayout.mean_queries`). Loads the context twice (laid out, as `starqa ask` does, and
as built), records a question's decode calls and prints the runs of adjacent lists a row and
a KV head's union read in either layout, then that question's last token's 30 kernel calls
replayed through either shard's tables in turn, several rounds (the same picks: the results
are compared).

    python benchmarks/topk_list_order.py CONTEXT_DIR [--rounds 16] [--sample 32]

CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s; its ivf
indexes are built on first use where missing. --sample: tokens the mean query is taken over
(starqa's `listlayout.SAMPLE`).
"""

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch

from starqa import bench, dist, indexes, listlayout, models
from starqa.answering import Answerer
from starqa.ask import question_ids
from starqa.manifest import read_manifest
from starqa.retrieval import TopKShard

QUESTION = "Which function merges the partial attentions of the workers?"


def runs(places: np.ndarray) -> int:
    """Runs of consecutive numbers among `places` (distinct)."""
    places = np.sort(places)
    return 1 + int(np.sum(np.diff(places) != 1)) if len(places) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sample", type=int, default=listlayout.SAMPLE)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manifest = indexes.ensure(read_manifest(args.context), "ivf")
    settings = indexes.topk_settings("topk", "1%", None, "ivf", False)
    path = models.resolve_model(manifest.model.spec)
    listlayout.SAMPLE = args.sample  # read by listlayout.mean_queries
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
    laid = answerer.hook.retriever
    built = TopKShard.from_cache(manifest, list(range(len(manifest.blocks))), settings,
                                 getattr(torch, manifest.dtype), torch.device("cpu"))
    built.make_tables()
    answerer.hook.compiled = lambda *_: None  # layer by layer: each layer's call recorded
    calls = []  # (layer, the call's arguments) of the question's one-token steps
    for layer, table in laid._tables.items():
        def recorder(*call, table=table, layer=layer):
            if call[4] == 1:  # tokens: a decode step
                calls.append((layer, [x.clone() if isinstance(x, torch.Tensor) else x
                                      for x in call]))
            return type(table).attend(table, *call)
        table.attend = recorder  # this instance only, for the recording
    answerer.answer(question_ids(manifest, path, QUESTION)[1], 6, set(), None)
    for table in laid._tables.values():
        del table.attend
    print(f"{manifest.n_tokens:,} tokens, mean query over {args.sample} tokens; "
          f"CPU: {bench.cpu_info()}")

    shards = {"as built": built, "laid out": laid}
    for name, shard in shards.items():
        found = []
        for layer, call in calls:
            lay, probes = shard.ivf[layer], shard._tables[layer].probes
            for h in range(lay.centroids.shape[0]):
                near = torch.from_numpy(lay.centroids[h]).float() @ call[0][h].float().T
                chosen = [torch.topk(near[:, g], probes).indices.numpy()
                          for g in range(near.shape[1])]
                found.append((np.mean([runs(c) for c in chosen]),
                              runs(np.unique(np.concatenate(chosen)))))
        row, union = np.array(found).mean(0)
        print(f"lists {name}: a row's {probes} lists in {row:.1f} runs, a KV head's union in "
              f"{union:.1f}")

    token = calls[-len(laid._tables):]  # the question's last token, a call a layer
    gc.freeze()
    times, outs = {name: [] for name in shards}, {}
    for _ in range(args.rounds):
        for name, shard in shards.items():
            started = time.perf_counter()
            for _ in range(5):
                outs[name] = [type(shard._tables[layer]).attend(shard._tables[layer], *call)
                              for layer, call in token]
            times[name].append((time.perf_counter() - started) / 5 * 1e3)
    for name, seen in times.items():
        seen.sort()
        print(f"lists {name}: median {seen[len(seen) // 2]:.2f} ms a token (min {seen[0]:.2f}, "
              f"max {seen[-1]:.2f})")
    first, second = outs.values()
    print("largest difference:",
          max(float((a[0] - b[0]).abs().max()) for a, b in zip(first, second)))


if __name__ == "__main__":
    main()
