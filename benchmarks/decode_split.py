"""Where a Phase 2 decode token's time goes, exact against top-k, on a cached context: timers
around every compiled call of a real answer (`Answerer`, as `ask` and the warm groups run
it), split into the attention kernel (exact's `native.Layout.attend`, top-k's
`native.TopKTable.attend`), the model's steps (a layer's two calls either side of its
attention, `native.layer_before`/`layer_after`, and the logits), every layer in one call
(`native.decode_layers`, starqa/native/_step.c: attention and model steps together, as answers
run where it applies) and the rest: Python and torch between them ("glue"). Each
attention in turn, alternating, in one process:

    python benchmarks/decode_split.py CONTEXT_DIR [--attention exact,ivf,exact:loop,ivf:loop]
    python benchmarks/decode_split.py CONTEXT_DIR --attention exact,ivf --libs old.so,new.so
    python benchmarks/decode_split.py --smoke   # a toy context (benchmarks/toy.py) made here

On the CPU, int4 weights, --threads torch threads: the int4 tiles and the layer kernels
need AVX-512 VNNI or AVX2 (without them it stops, and --smoke says it skipped).

An attention named NAME:loop runs its layers one by one (`ShardAttention.compiled`
offers no words), as answers did before starqa/native/_step.c: the split of each share;
ivf:built keeps ivf's lists as built (`starqa.topk.listlayout` lays them out by a mean query);
ivf:none drops the keys a row leaves out (`--top-k-tail none`; ivf counts them by default). With
--libs, each attention runs through each build of the kernels in turn (NAME@LIB): a kernel
change measured on whole decode tokens, the model's steps and their traffic included, side
by side. A build of any commit (the package's own build is not touched):

    mkdir old && for f in $(git ls-tree --name-only REV starqa/ | grep '/_[a-z]*[.][ch]$'); do
        git show REV:$f > old/${f#starqa/}; done
    gcc -O3 -fopenmp -fno-math-errno -std=gnu11 -shared -fPIC -Iold old/_*.c -lm -o old.so

Prints
per attention the median ms per token of each share (one-token steps: no drafts, so a step
is a token). CONTEXT_DIR: a context folder (its manifest.json), e.g. `starqa ingest`'s; ivf
needs its indexes (built on first use where missing).
"""

import argparse
import gc
import time
from pathlib import Path

import torch

from starqa.measure import bench
from starqa.models import decoder
from starqa.runtime import dist
from starqa.topk import indexes, ivf
from starqa.native import kernels, ops as native
from starqa import models
from starqa.phase2.answerer import Answerer
from starqa.launchers.query import question_ids
from starqa.cache.manifest import read_manifest

QUESTION = "Which function merges the partial attentions of the workers?"


class Timers:
    """Seconds spent in wrapped callables, by share."""

    def __init__(self):
        self.spent = {"attention": 0.0, "model": 0.0, "layers": 0.0}

    def wrap(self, owner, name: str, share: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[share] += time.perf_counter() - started

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path, nargs="?")
    parser.add_argument("--attention", default="exact,ivf,exact:loop,ivf:loop")
    parser.add_argument("--top-k", default="1%")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--libs", default="", help="builds of the kernels, comma-separated")
    parser.add_argument("--smoke", action="store_true",
                        help="a toy context ingested here (no CONTEXT_DIR), 4 tokens, 1 round")
    args = parser.parse_args()
    if args.smoke:
        args.context, args.tokens, args.rounds = toy_context(), 4, 1
    elif args.context is None:
        parser.error("CONTEXT_DIR is required (or --smoke)")
    libraries = {"": native._library}  # "": the package's own build
    if args.libs:
        libraries = {f"@{Path(name).stem}": (lambda lib=kernels.load(Path(name).resolve()): lib)
                     for name in args.libs.split(",")}
    torch.set_num_threads(args.threads)
    timers = Timers()
    timers.wrap(native.Layout, "attend", "attention")
    timers.wrap(native.TopKTable, "attend", "attention")
    timers.wrap(native, "layer_before", "model")
    timers.wrap(native, "layer_after", "model")
    timers.wrap(decoder.Decoder, "logits", "model")
    timers.wrap(native, "decode_layers", "layers")

    answerers = {}
    for name in args.attention.split(","):
        attention, *modifiers = name.split(":")
        manifest = read_manifest(args.context)
        settings = None
        if attention != "exact":
            settings = indexes.topk_settings("topk", args.top_k, None, attention, False,
                                             tail="none" if "none" in modifiers else None)
            manifest = indexes.ensure(manifest, attention)
        path = models.resolve_model(manifest.model.spec)
        query = question_ids(manifest, path, QUESTION)[1]
        laid = ivf.list_order
        if "built" in modifiers:
            ivf.list_order = lambda *_: None  # as built: no layout
        try:
            answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4",
                                           settings)
        finally:
            ivf.list_order = laid
        if not answerer.decoder.layer_kernels:  # the model's steps would count as glue
            why = ("this decoder runs its layers' kernels one by one only (no int4 tiles or "
                   "no compiled kernels: int4 tiles need AVX-512 VNNI or AVX2)")
            if args.smoke:  # nothing to split on this CPU: said, not failed
                print(f"decode_split skipped: {why}")
                return
            raise SystemExit(why)
        if "loop" in modifiers:
            answerer.hook.compiled = lambda *_: None
        answerer.answer(query, 2, set(), None, draft_tokens=0)  # tables and buffers made
        answerers[name] = (answerer, query)
    gc.collect()
    gc.freeze()
    print(f"{manifest.n_tokens:,} tokens; CPU: {bench.cpu_info()}")

    found = {name + lib: [] for name in answerers for lib in libraries}
    for _ in range(args.rounds):
        for name, lib in [(name, lib) for name in answerers for lib in libraries]:
            answerer, query = answerers[name]
            native._library = libraries[lib]
            stamps = []

            def on_token(token: int) -> None:
                stamps.append((time.perf_counter(), dict(timers.spent)))

            answerer.answer(query, args.tokens, set(), on_token, draft_tokens=0)
            (t0, s0), (t1, s1) = stamps[0], stamps[-1]
            steps = len(stamps) - 1
            shares = {k: (s1[k] - s0[k]) / steps * 1e3 for k in s0}
            total = (t1 - t0) / steps * 1e3
            found[name + lib].append((total, shares["attention"], shares["model"], shares["layers"],
                                total - sum(shares.values())))
    for name, runs in found.items():
        median = [sorted(x)[len(x) // 2] for x in zip(*runs)]
        print(f"{name}: {median[0]:.1f} ms/token = attention kernel {median[1]:.1f} + model "
              f"{median[2]:.1f} + layers in one call {median[3]:.1f} + glue {median[4]:.1f} "
              f"(medians of {len(runs)})")


def toy_context() -> Path:
    """--smoke: the toy corpus ingested with the toy model (benchmarks/toy.py), in process."""
    import toy

    from starqa import engine

    toy.banner("decode_split")
    folder = toy.scratch("split")
    result = engine.ingest(engine.IngestOptions(
        paths=(str(toy.corpus(folder / "toy")),), model=str(toy.model(folder)),
        encode_in="process"))
    return result.manifest.folder


if __name__ == "__main__":
    main()
