"""How good is re-rotating a star block's stored keys to a new position (issue #14)?

A star block that moved by δ positions (an edit before it) can keep its KV with its keys
rotated by δ (starqa.reingest.rotate). Exact in layer 0; above it, every hidden state was computed
with the anchor δ positions nearer. This script measures, on a real model and a real
context (samples/), the relative error of the re-rotated KV against the KV encoded fresh at
the new position, for several δ, beside two yardsticks: not rotating at all, and star's
own error (star's block KV against dense's, the approximation star makes anyway).

    python benchmarks/rerotate_error.py [--model smollm2-135m] [--block 1024]
    python benchmarks/rerotate_error.py --smoke   # toy model (benchmarks/toy.py), block 32

Accuracy only (no timing): safe on a busy CPU; the numbers do not depend on its flags
beyond rounding. Prints one table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from starqa import corpus, models
from starqa.phase1 import hooks
from starqa.corpus import prompt
from starqa.phase1 import encode_dense, encode_star
from starqa.reingest.rotate import inv_freq, rerotate


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--deltas", default="1,8,64,512")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model, blocks of 32 tokens, deltas 1,8,16")
    args = parser.parse_args()
    if args.smoke:
        import toy

        toy.banner("rerotate_error")
        path = toy.model(toy.scratch("rerotate"))
        args.model, args.block, args.deltas = "the toy model", 32, "1,8,16"
    else:
        path = models.resolve_model(args.model)
    tok = models.load_tokenizer(path)
    root = Path(__file__).resolve().parents[1] / "samples"
    files = corpus.collect([str(root / "code"), str(root / "handbook")]).files
    packed, spans = corpus.pack(files)
    ids = torch.tensor(prompt.tokenize_context(tok, packed, spans).ids)
    b = args.block
    deltas = [int(d) for d in args.deltas.split(",")]
    need = 3 * b + max(deltas)
    assert len(ids) >= need, f"samples give {len(ids)} tokens, need {need}: lower --block"
    dtype = getattr(torch, args.dtype)
    model = models.load_model(path, dtype=dtype, attn_implementation=hooks.register())
    freqs = inv_freq(path)
    start = 2 * b  # the block [2b, 3b) after the anchor [0, b): star's third block

    def star_kv(offset: int):
        # the same tokens ids[2b:3b] encoded at `offset`: build a context whose block there
        # holds them (the tokens between anchor and block do not matter to star)
        ctx = torch.cat([ids[:offset], ids[start:start + b]])
        [(_, k, v)] = encode_star(model, ctx, [(0, b), (offset, offset + b)], [1], anchor_size=b)
        return k, v

    k0, v0 = star_kv(start)
    dense = list(encode_dense(model, ids[:3 * b], [(0, b), (b, 2 * b), (2 * b, 3 * b)]))[2]
    print(f"model {args.model}, {args.dtype}, block = anchor = {b} tokens, block at {start}")
    print(f"star's own error (star block KV vs dense): K {rel(k0, dense[1]):.4f}  "
          f"V {rel(v0, dense[2]):.4f}")
    print(f"{'delta':>6} {'K rotated':>10} {'K not rot.':>10} {'V kept':>8} "
          f"{'K layer0 rot.':>13} {'K last rot.':>11}")
    for d in deltas:
        k1, v1 = star_kv(start + d)
        rot = rerotate(k0, d, freqs)
        print(f"{d:>6} {rel(rot, k1):>10.4f} {rel(k0, k1):>10.4f} {rel(v0, v1):>8.4f} "
              f"{rel(rot[0], k1[0]):>13.4f} {rel(rot[-1], k1[-1]):>11.4f}")


if __name__ == "__main__":
    main()
