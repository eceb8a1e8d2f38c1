"""The model's own part of a Phase 2 decode step (every layer's weights, norms and RoPE; the
attention left out), torch's kernels against starqa's, side by side in one run:

    python benchmarks/dev/decode_step.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--rows 1,4]

For each model (bf16, int4 weights) and each forward size (1 row: a token; 4 rows: a token
and 3 drafted ones), min-of-trials ms of one forward plus the LM head on its last row:

- torch: int4 through torch's `_weight_int4pack_mm_for_cpu` (torch's packed layout),
  RMSNorm and RoPE as torch operators (what starqa ran before starqa/native/_int4.c and _rows.c);
- int4: starqa's int4 kernel (starqa/native/_int4.c), norms and RoPE still torch's;
- rows: starqa's int4 kernel and its RMSNorm, RoPE and SiLU·mul (starqa/native/_rows.c), each
  called from Python;
- starqa: the same kernels, a layer's steps before and after its attention one call each
  (starqa/native/_layer.c): what runs now.

Then, per weight shape of the models, one product of 1 and 4 rows through each int4 kernel
in GB/s of int4 weights read (5 bits a weight with the scales), from many copies of the
weights so that they come from memory, as in a decode step.
"""

import argparse
import json
import subprocess
import time

import torch

from starqa import models
from starqa.native import ops as native
from starqa.models.decoder_io import load_decoder
from starqa.models.linear import Linear, _int4_pack, _int4_tiles
from starqa.models.prepared import INT4_GROUP, DecoderConfig


def cpu_line() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("Flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return f"{name} ({', '.join(f for f in wanted if f in flags)})"


def best_of(run, repeat: int, trials: int = 5) -> float:
    best = float("inf")
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(repeat):
            run()
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


def torch_layout(decoder, dense) -> None:
    """decoder's int4 Linears again in torch's packed layout, from `dense`'s weights."""
    for layer, plain in zip(decoder.layers, dense.layers):
        for name in ("qkv", "out", "gate_up", "down"):
            lin, weight = getattr(layer, name), getattr(plain, name).weight
            packed, scales = _int4_pack(weight.float(), decoder.dtype)
            setattr(layer, name, Linear("int4", packed, scales, lin.bias, lin.w8, lin.w8_scale))
    packed, scales = _int4_pack(dense.lm_head.weight.float(), decoder.dtype)
    decoder.lm_head = Linear("int4", packed, scales)


def step_times(model: str, rows_list: list[int]) -> None:
    path = models.resolve_model(model)
    dense = load_decoder(path, torch.bfloat16, "dense")
    ours = load_decoder(path, torch.bfloat16, "int4")
    theirs = load_decoder(path, torch.bfloat16, "int4")
    torch_layout(theirs, dense)
    del dense

    def attention(layer, q, k, v):  # the attention left out: its output is its query
        return q.contiguous()

    # (name, decoder, starqa's norm/RoPE/SiLU kernels, a layer's steps in one call each)
    setups = [("torch", theirs, False, False), ("int4", ours, False, False),
              ("rows", ours, True, False), ("starqa", ours, True, True)]
    print(f"{model}: ms per forward (weights, norms, RoPE; no attention)")
    print(f"{'rows':>5}" + "".join(f"{name:>9}" for name, *_ in setups) + f"{'torch/starqa':>14}")
    for rows in rows_list:
        ids, positions = torch.arange(100, 100 + rows), torch.arange(5000, 5000 + rows)
        times = []
        for _, decoder, native_rows, layer_kernels in setups:
            decoder.native_rows = native_rows and native.rows_supported(decoder.device,
                                                                        decoder.dtype)
            decoder.layer_kernels = layer_kernels and decoder.native_rows

            def run(decoder=decoder):
                hidden = decoder.forward(ids, positions, attention, rowwise=True)
                decoder.logits(hidden[-1:])

            run()
            times.append(best_of(run, 10))
        print(f"{rows:>5}" + "".join(f"{t * 1e3:>9.2f}" for t in times)
              + f"{times[0] / times[-1]:>14.2f}")


def kernel_rates(shapes: list[tuple[int, int]]) -> None:
    print("int4 kernels, GB/s of int4 weights (5 bits a weight), weights from memory")
    print(f"{'N x K':>12}{'rows':>6}{'torch':>8}{'starqa':>8}{'ratio':>7}")
    for n, k in shapes:
        weight = torch.randn(n, k)
        copies = max(2, 150_000_000 // (n * k))  # ~100 MB of weights in all
        torch_packed = [_int4_pack(weight, torch.bfloat16) for _ in range(copies)]
        tiles = [_int4_tiles(weight) for _ in range(copies)]
        for rows in (1, 4):
            x = torch.randn(rows, k).bfloat16()
            turn = iter(range(10**9))

            def theirs():
                packed, scales = torch_packed[next(turn) % copies]
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales)

            def ours():
                native.int4_mm(x, tiles[next(turn) % copies])

            t_theirs, t_ours = best_of(theirs, copies), best_of(ours, copies)
            size = n * k * 5 / 8
            print(f"{f'{n}x{k}':>12}{rows:>6}{size / t_theirs / 1e9:>8.1f}"
                  f"{size / t_ours / 1e9:>8.1f}{t_theirs / t_ours:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    if not native.int4_fast():
        raise SystemExit("starqa's int4 kernel does not run here (no AVX-512 VNNI, or the "
                         "kernels are not built: pip install -e .)")
    print(f"{cpu_line()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    shapes = []
    for model in args.models.split(","):
        step_times(model, [int(r) for r in args.rows.split(",")])
        path = models.resolve_model(model)
        c = DecoderConfig.read(path)
        q = (c.heads + 2 * c.kv_heads) * c.head_dim
        inter = json.loads((path / "config.json").read_text())["intermediate_size"]
        shapes += [(q, c.hidden), (c.hidden, c.heads * c.head_dim), (2 * inter, c.hidden),
                   (c.hidden, inter), (c.vocab, c.hidden)]
    kernel_rates(shapes)


if __name__ == "__main__":
    main()
