"""Does laying ivf's lists out by their centres' projection on a mean decode query speed
the top-k kernel? A row reads its ~68 nearest lists (32K, k = 1%); as built, a list's place
in memory is its block's and its k-means number, so a row's lists lie in ~54 separate runs.
Ordered by c . q_mean (per layer and KV head, q_mean the mean of one question's decode
queries over the KV head's query heads), the lists a row of *another* question chooses lie
closer together. Prints, for the second question's decode tokens, the runs of adjacent
lists a row and a KV head's union read in either layout, then that question's last token's
30 kernel calls replayed through the shard's own tables and through tables of the same keys
reordered, in turn, several rounds (the same picks: the results are compared).

    python benchmarks/topk_list_order.py CONTEXT_DIR [--rounds 16] [--learn-from FILE ...]

--learn-from: q_mean from forwards over the first 400 tokens of each FILE instead (text
that is not a question, as Phase 1 encodes a context: what an ingest could store).

CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s; its ivf
indexes are built on first use where missing. An experiment: starqa lays lists out as built.
"""

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch

from starqa import bench, dist, indexes, models, native
from starqa.answering import Answerer
from starqa.ask import question_ids
from starqa.manifest import read_manifest

QUESTIONS = ("How are shards written to disk?",
             "Which function merges the partial attentions of the workers?")


def runs(places: np.ndarray) -> int:
    """Runs of consecutive numbers among `places` (distinct)."""
    places = np.sort(places)
    return 1 + int(np.sum(np.diff(places) != 1)) if len(places) else 0


def reordered(shard, layer: int, mean_q: torch.Tensor) -> tuple[native.TopKTable, list]:
    """The layer's table with each head's lists in the order of c . mean_q[h], and each
    head's list order."""
    lay, table = shard.ivf[layer], shard._tables[layer]
    keys, offsets, centroids, rows, orders = [], [], [], [], []
    for h in range(lay.centroids.shape[0]):
        order = torch.argsort(torch.from_numpy(lay.centroids[h]).float() @ mean_q[h]).numpy()
        o = lay.offsets[h]
        perm = np.concatenate([np.arange(o[c], o[c + 1]) for c in order])
        keys.append(lay.keys[h][torch.from_numpy(perm)])
        rows.append(lay.rows[h][perm])
        offsets.append(np.concatenate([[0], np.cumsum(np.diff(o)[order])]))
        centroids.append(lay.centroids[h][order])
        orders.append(order)
    lists = (torch.from_numpy(np.stack(centroids)),
             torch.from_numpy(np.stack(offsets).astype(np.int64)), table.probes)
    return native.TopKTable([(0, torch.stack(keys).contiguous())], [(0, shard.values[layer])],
                            torch.from_numpy(np.stack(rows)), lists), orders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--learn-from", nargs="*", type=Path, default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manifest = indexes.ensure(read_manifest(args.context), "ivf")
    settings = indexes.topk_settings("topk", "1%", None, "ivf", False)
    path = models.resolve_model(manifest.model.spec)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
    shard = answerer.hook.retriever
    answerer.hook.compiled = lambda *_: None  # layer by layer: each layer's call recorded
    calls = []  # per question: (layer, the call's arguments) of its one-token steps
    for layer, table in shard._tables.items():
        def recorder(*call, table=table, layer=layer):
            if call[4] == 1:  # tokens: a decode step
                calls[-1].append((layer, [x.clone() if isinstance(x, torch.Tensor) else x
                                          for x in call]))
            return type(table).attend(table, *call)
        table.attend = recorder  # this instance only, for the recording
    for question in QUESTIONS:
        calls.append([])
        answerer.answer(question_ids(manifest, path, question)[1], 6, set(), None)
    for table in shard._tables.values():
        del table.attend
    learn, held = calls
    mean_q = {}
    for layer, call in learn:  # q [Hkv, G, D]: the mean over the G query heads and tokens
        mean_q.setdefault(layer, []).append(call[0].float().mean(1))
    if args.learn_from:
        mean_q = {}
        forward = shard.parts

        def parts(layer, q, *rest, **kw):  # a forward's folded queries [1, Hkv, G * M, D]
            mean_q.setdefault(layer, []).append(q[0].float().mean(1))
            return forward(layer, q, *rest, **kw)

        shard.parts = parts
        tokenizer = models.load_tokenizer(path)
        for text in args.learn_from:
            answerer.answer(tokenizer.encode(text.read_text())[:400], 1, set(), None)
        del shard.parts
    tables, orders = {}, {}
    for layer in shard._tables:
        tables[layer], orders[layer] = reordered(shard, layer, torch.stack(mean_q[layer]).mean(0))
    print(f"{manifest.n_tokens:,} tokens; CPU: {bench.cpu_info()}")

    found = {"as built": [], "by mean query": []}
    for layer, call in held:
        lay, probes = shard.ivf[layer], shard._tables[layer].probes
        for h in range(lay.centroids.shape[0]):
            near = torch.from_numpy(lay.centroids[h]).float() @ call[0][h].float().T  # [C, G]
            chosen = [torch.topk(near[:, g], probes).indices.numpy() for g in range(near.shape[1])]
            place = np.empty_like(orders[layer][h])
            place[orders[layer][h]] = np.arange(len(place))
            for name, where in (("as built", np.arange(len(place))), ("by mean query", place)):
                found[name].append((np.mean([runs(where[c]) for c in chosen]),
                                    runs(np.unique(np.concatenate([where[c] for c in chosen])))))
    for name, seen in found.items():
        row, union = np.array(seen).mean(0)
        print(f"lists {name}: a row's {probes} lists in {row:.1f} runs, a KV head's union in "
              f"{union:.1f}")

    token = held[-len(shard._tables):]  # the held-out question's last token, a call a layer
    gc.freeze()
    variants = {"as built": shard._tables, "by mean query": tables}
    times, outs = {name: [] for name in variants}, {}
    for _ in range(args.rounds):
        for name, chosen_tables in variants.items():
            started = time.perf_counter()
            for _ in range(5):
                outs[name] = [type(chosen_tables[layer]).attend(chosen_tables[layer], *call)
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
