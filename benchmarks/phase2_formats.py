"""Phase 2 decode speed of every compute dtype and weight format, on the CPU it runs on (or
a GPU with --device cuda): the numbers behind `--weights` and `--dtype` defaults
(docs/models.md, docs/results.md). Which kernels run follows the CPU's flags: int4's and
int8's fast kernels need AVX-512 VNNI (int4 has an AVX2 path too), bf16 products are
emulated without avx512_bf16 or AMX.

    python benchmarks/phase2_formats.py [--model smollm2-135m] [--tokens 7480] [--new 32]
    python benchmarks/phase2_formats.py --smoke   # toy model (benchmarks/toy.py), 300 keys

A shard of `--tokens` random keys per layer stands in for a cached context (decode cost
depends on its size, not its content); the question is 21 tokens. Prints time to first
token (the question's prefill), ms per generated token, each format in turn, and what
source attribution costs after the answer (`key_mass`, as a share of the decode time; while
decoding it only keeps references to each step's last query row). The shard's token ids
are drawn from 200 values, so every generated token matches ~1/200 of the keys: more
matches, and more cost, than text has for all but its commonest tokens.
"""

import argparse
import time

import torch

from starqa.runtime import dist
from starqa import models
from starqa.phase2 import decode
from starqa.phase2.shard_attention import ShardAttention
from starqa.models.decoder_io import load_decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=7480)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--weights", default="dense,int8,int4")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (dense weights only)")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model, a shard of 300 keys, 4 new tokens")
    args = parser.parse_args()
    import subprocess

    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), "?")
    if args.smoke:
        import toy

        toy.banner("phase2_formats")
        path = toy.model(toy.scratch("formats"))
        args.model, args.tokens, args.new = "the toy model", 300, 4
    else:
        path = models.resolve_model(args.model)
    info = dist.local_world(args.device)
    if info.device.type == "cuda":
        cpu = f"{torch.cuda.get_device_name()} (host: {cpu})"
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model}, shard {args.tokens:,} tokens")
    print(f"{'dtype':<10}{'weights':<8}{'load s':>8}{'first token s':>15}{'ms/token':>10}"
          f"{'weights MB':>12}{'sources ms':>12}{'of decode':>10}")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for weights in args.weights.split(","):
            load_decoder(path, dtype, weights, info.device)  # prepare once, outside the timing
            started = time.perf_counter()
            decoder = load_decoder(path, dtype, weights, info.device)
            loaded = time.perf_counter() - started
            c = decoder.config
            shape = (1, c.kv_heads, args.tokens, c.head_dim)
            shard = [[(torch.randn(shape, dtype=dtype, device=info.device),
                       torch.randn(shape, dtype=dtype, device=info.device))]
                     for _ in range(c.layers)]
            vocab = min(200, decoder.embed.shape[0])  # the ids drawn: 200 (the toy model: fewer)
            hook = ShardAttention(info, shard, query_host=True,
                                  ids=torch.randint(0, vocab, (args.tokens,)))
            question = [(100 + i) % vocab for i in range(21)]
            warm_up = decode.Request(question, args.tokens, 3)
            decode.generate(decoder, info, hook, warm_up)
            first: list[float] = []
            started = time.perf_counter()
            timed = decode.Callbacks(lambda _: first or first.append(time.perf_counter()))
            tokens = decode.generate(decoder, info, hook,
                                     decode.Request(question, args.tokens, args.new), timed)
            end = time.perf_counter()
            hook.key_mass([t % vocab for t in tokens])
            attributed = time.perf_counter() - end
            print(f"{str(dtype).removeprefix('torch.'):<10}{weights:<8}{loaded:>8.2f}"
                  f"{first[0] - started:>15.3f}{(end - first[0]) / (len(tokens) - 1) * 1e3:>10.1f}"
                  f"{decoder.nbytes() / 1e6:>12.0f}{attributed * 1e3:>12.1f}"
                  f"{attributed / (end - first[0]):>10.1%}", flush=True)


if __name__ == "__main__":
    main()
