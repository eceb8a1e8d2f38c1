"""The top-k kernel alone, A against B in one process: one decode token's calls (a layer
each) recorded from a real answer on a cached context, then replayed through each variant
in turn, several times, alternating, so that a machine whose speed drifts by a third
between runs minutes apart still compares like with like. Prints each variant's median,
min and max ms per token (the sum of the token's calls) and whether the outputs agree.

Builds of the kernels (any two commits; the package's own build is not touched):

    git show REV:starqa/_topk.c > old/_topk.c   # likewise every other _*.c and _*.h
    gcc -O3 -fopenmp -fno-math-errno -std=gnu11 -shared -fPIC -Iold old/_attend.c \\
        old/_topk.c old/_int4.c old/_rows.c old/_layer.c old/_step.c -lm -o old.so
    python benchmarks/topk_kernel_ab.py CONTEXT_DIR --libs old.so,new.so [--index flat]

The same keys and values in 4 KB pages against a copy in transparent huge pages (the
process then runs with THP_MEM_ALLOC_ENABLE=0, so torch's own tensors are in 4 KB pages;
otherwise starqa's setting, `starqa._huge_pages`):

    python benchmarks/topk_kernel_ab.py CONTEXT_DIR --huge-pages

CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s.
"""

import os
import sys

if "--huge-pages" in sys.argv:  # before torch: its tensors in 4 KB pages, as against a copy
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0"

import argparse  # noqa: E402
import gc  # noqa: E402
import mmap  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from starqa import bench, dist, indexes, kernels, models, native  # noqa: E402
from starqa.answering import Answerer  # noqa: E402
from starqa.ask import question_ids  # noqa: E402
from starqa.manifest import read_manifest  # noqa: E402


def in_huge_pages(tensor: torch.Tensor, keep: list) -> torch.Tensor:
    """A copy of `tensor` in private anonymous memory advised MADV_HUGEPAGE, 2 MB aligned."""
    size = tensor.numel() * tensor.element_size()
    buffer = mmap.mmap(-1, size + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    start = (-raw.data_ptr()) % (2 << 20)
    copy = raw[start:start + size].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    keep.append(buffer)
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--index", default="ivf", choices=["flat", "ivf"])
    parser.add_argument("--kv-on-disk", action="store_true")
    parser.add_argument("--libs", default="", help="builds to compare, comma-separated")
    parser.add_argument("--huge-pages", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if bool(args.libs) == args.huge_pages:
        parser.error("give --libs A.so,B.so or --huge-pages")
    if args.huge_pages and args.kv_on_disk:
        parser.error("--huge-pages copies keys and values held in memory: drop --kv-on-disk")
    torch.set_num_threads(args.threads)
    manifest = indexes.ensure(read_manifest(args.context), args.index)
    settings = indexes.topk_settings("topk", "1%", None, args.index, args.kv_on_disk)
    path = models.resolve_model(manifest.model.spec)
    query = question_ids(manifest, path, "Which function merges the partial attentions "
                                         "of the workers?")[1]
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", settings)
    answerer.answer(query, 2, set(), None)  # every layer's table made
    shard = answerer.hook.retriever
    answerer.hook.compiled = lambda *_: None  # layer by layer: each layer's call recorded
    calls = []
    for layer, table in sorted(shard._tables.items()):
        def recorder(*call, table=table, layer=layer):
            calls.append((layer, table, [x.clone() if isinstance(x, torch.Tensor) else x
                                         for x in call]))
            return type(table).attend(table, *call)
        table.attend = recorder  # this instance only, for the recording
    answerer.answer(query, 3, set(), None)
    for table in shard._tables.values():
        del table.attend
    token = calls[-len(shard._tables):]  # the last token's call per layer
    gc.freeze()  # as a loaded Answerer does (starqa.gcpause): the recording never walked again
    print(f"{manifest.n_tokens:,} tokens, {len(token)} calls a token; CPU: {bench.cpu_info()}")

    variants = {}  # name -> (library or None, layer -> table)
    if args.libs:
        for name in args.libs.split(","):
            variants[name] = (kernels.load(name), {layer: table for layer, table, _ in token})
    else:
        keep, copies = [], {}
        for layer, table, _ in token:
            lay = shard.ivf[layer] if shard.ivf is not None else None
            keys = [(0, in_huge_pages(lay.keys, keep))] if lay is not None else \
                [(0, in_huge_pages(shard.keys[layer], keep))]
            values = [(0, in_huge_pages(shard.values[layer], keep))]
            lists = None if lay is None else (torch.from_numpy(lay.centroids),
                                             torch.from_numpy(lay.offsets), table.probes)
            copies[layer] = native.TopKTable(
                keys, values, None if lay is None else torch.from_numpy(lay.rows), lists,
                None if lay is None else torch.from_numpy(lay.at))
        variants["4 KB pages"] = (None, {layer: table for layer, table, _ in token})
        variants["huge pages"] = (None, copies)
    own = native._library
    times, outs = {name: [] for name in variants}, {}
    for _ in range(args.rounds):
        for name, (library, tables) in variants.items():
            native._library = (lambda lib=library: lib) if library is not None else own
            started = time.perf_counter()
            for _ in range(5):
                outs[name] = [type(tables[layer]).attend(tables[layer], *call)
                              for layer, _, call in token]
            times[name].append((time.perf_counter() - started) / 5 * 1e3)
    native._library = own
    for name, found in times.items():
        found.sort()
        print(f"{name}: median {found[len(found) // 2]:.2f} ms a token "
              f"(min {found[0]:.2f}, max {found[-1]:.2f})")
    first, *rest = variants
    for name in rest:
        worst = max(max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item())
                    for a, b in zip(outs[first], outs[name]))
        print(f"largest difference, {first} against {name}: {worst:.3g}")


if __name__ == "__main__":
    main()
