"""How much of the exact top k an ivf selection finds: real decode queries recorded from
answers on a cached context (every layer's call of the top-k kernel), then, per layer, KV
head and query row, the k keys with the largest inner product over the whole shard against
the k best of the keys the selection scans. Prints, per variant, the share of the exact top
k found and the share of its softmax mass (scale 1/sqrt(d)) the picks hold, and how many
keys a KV head reads per position (own: its rows' reads summed; shared: each key once):

    python benchmarks/dev/topk_recall.py CONTEXT_DIR [--probes 52,68] [--shared] [--int8]

Variants: `own` is what starqa's kernel does (each query row scans its own nearest lists,
as many as the table's probes); `--probes` lists other counts; `--shared` adds, for each,
the G query heads of a KV head scanning the union of their lists (each row's k picked from
all of them); `--int8` adds, for each, the scan ranking int8 codes of the keys (each
dimension scaled by its largest |key| / 127), its k (1 + margin) best then rescored with
the keys (`--margin`, default 0.25). The selection is recomputed here in fp32 with torch
(the kernel's own scores are the same products; ties aside, the same picks).

CONTEXT_DIR: a context folder (its manifest.json) with ivf indexes, e.g. `starqa ingest`'s.
"""

import argparse
import math
from pathlib import Path

import torch

from starqa.measure import bench
from starqa.runtime import dist
from starqa.topk import indexes
from starqa import models
from starqa.phase2.answerer import Answerer
from starqa.launchers.query import question_ids
from starqa.cache.manifest import read_manifest

QUESTIONS = ("Which function merges the partial attentions of the workers?",
             "How are shards written to disk?")


def record(context: Path, tokens: int) -> tuple[list, object]:
    """The decode calls (layer, q [H, G, D], k) of two answers, and the worker's shard."""
    manifest = indexes.ensure(read_manifest(context), "ivf")
    settings = indexes.topk_settings("topk", "1%", None, "ivf", False)
    path = models.resolve_model(manifest.model.spec)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
    answerer.answer(question_ids(manifest, path, "hello?")[1], 2, set(), None)  # tables made
    shard = answerer.hook.retriever
    answerer.hook.compiled = lambda *_: None  # layer by layer: each layer's call recorded
    calls = []
    for layer, table in shard._tables.items():
        def recorder(q, k, *rest, table=table, layer=layer):
            if len(rest) > 2 and rest[2] == 1:  # tokens: a decode step's one position
                calls.append((layer, q.clone(), k))
            return type(table).attend(table, q, k, *rest)
        table.attend = recorder  # this instance only, for the recording
    for question in QUESTIONS:
        answerer.answer(question_ids(manifest, path, question)[1], tokens, set(), None)
    return calls, shard


def quantized(keys: torch.Tensor) -> torch.Tensor:
    """keys [N, D] as the kernel's int8 scan sees them: a code in -127 .. 127 per dimension,
    scaled by the dimension's largest |key| / 127 (per KV head), back in fp32."""
    scale = keys.abs().amax(0).clamp(min=1e-30) / 127
    return (keys / scale).round().clamp(-127, 127) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--probes", default="", help="other list counts, comma-separated")
    parser.add_argument("--shared", action="store_true")
    parser.add_argument("--int8", action="store_true",
                        help="add, for each, the lists scanned through int8 codes of the keys")
    parser.add_argument("--margin", type=float, default=0.25,
                        help="--int8: k (1 + margin) candidates by the codes, rescored exactly")
    parser.add_argument("--tokens", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    calls, shard = record(args.context, args.tokens)
    print(f"{len(calls)} decode calls; CPU: {bench.cpu_info()}")
    found: dict[str, list[float]] = {}
    for layer, q, k in calls:
        lay, probes = shard.ivf[layer], shard._tables[layer].probes
        centroids = torch.as_tensor(lay.centroids).float()
        offsets = torch.as_tensor(lay.offsets)
        keys = torch.as_tensor(lay.keys).float()  # list order: the selection's positions
        variants = [("own", probes, False)] + [
            (f"own {p}", p, False) for p in map(int, filter(None, args.probes.split(",")))]
        variants += [(f"shared {p}", p, True) for _, p, _ in variants] if args.shared else []
        variants += [(f"{n} int8", p, s) for n, p, s in variants] if args.int8 else []
        for h in range(q.shape[0]):
            rows = q[h].float()
            scores = rows @ keys[h].T
            exact = scores.topk(k, dim=1).indices
            weights = torch.softmax(scores / q.shape[-1] ** 0.5, dim=1)
            exact_mass = weights.gather(1, exact).sum(1)
            list_of = torch.repeat_interleave(torch.arange(centroids.shape[1]),
                                              offsets[h, 1:] - offsets[h, :-1])
            near = rows @ centroids[h].T
            coded = rows @ quantized(keys[h]).T if args.int8 else None
            for name, p, shared in variants:
                chosen = torch.zeros_like(near, dtype=torch.bool)
                chosen.scatter_(1, near.topk(min(p, near.shape[1]), dim=1).indices, True)
                if shared:
                    chosen[:] = chosen.any(0)
                scanned = chosen[:, list_of]
                if name.endswith("int8"):  # k + margin by the codes, the k best of them exactly
                    wide = min(k + math.ceil(args.margin * k), scores.shape[1])
                    near_k = coded.masked_fill(~scanned, float("-inf")).topk(wide, dim=1).indices
                    picks = near_k.gather(1, scores.gather(1, near_k).topk(k, dim=1).indices)
                else:
                    picks = scores.masked_fill(~scanned, float("-inf")).topk(k, dim=1).indices
                hits = (picks.unsqueeze(2) == exact.unsqueeze(1)).any(2).float().mean(1)
                mass = weights.gather(1, picks).sum(1) / exact_mass
                reads = scanned.any(0).sum() if shared else scanned.sum()
                entry = found.setdefault(name, [0.0, 0.0, 0, 0, 0])
                entry[0] += hits.sum().item()
                entry[1] += mass.sum().item()
                entry[2] += rows.shape[0]
                entry[3] += int(reads)
                entry[4] += 1
    for name, (hits, mass, n, reads, heads) in found.items():
        print(f"{name}: found {hits / n:.3f} of the exact top k, {mass / n:.3f} of its mass; "
              f"{reads / heads:,.0f} keys read per KV head and position")


if __name__ == "__main__":
    main()
