"""Phase 1 against the CPU's arithmetic peak: how far starqa's encoding is from what the
cores can do, per part of a layer, as numbers.

    python benchmarks/roofline.py [--model qwen2.5-coder-1.5b] [--block 4096] [--threads N]
    python benchmarks/roofline.py --smoke   # toy model (benchmarks/toy.py), blocks of 64

Prints, on this CPU (its model and the flags that pick the kernels):

1. The peak of each multiply-add instruction the CPU has, measured: benchmarks/
   roofline_peak.c, compiled here with the system's C compiler, runs independent
   multiply-adds on registers (no memory traffic) on `--threads` threads at once: AVX-512
   bf16 (vdpbf16ps), AVX-512 and AVX2 fp32 FMA, int8 VNNI (vpdpbusd, 2 operations a
   product-add). AMX is not probed: there the torch GEMM line below shows what oneDNN gets
   from it.
2. torch's GEMM at the model's largest Linear shape, in the dtype Phase 1 computes in: the
   peak a library reaches on these cores.
3. One Phase 1 block as star encodes it (`starqa.phase1.encode_star`): `--block` tokens
   after an anchor of as many (the anchor's KV computed once beforehand, as each worker
   does), timed per part by forward hooks on the model's Linear modules and by the
   attention hook: QKV projections, attention, output projection, MLP up (gate and up),
   MLP down, and the rest (norms, RoPE, the activation, residual adds: the forward's time
   less the parts'). For each: seconds, GFLOP (2 per multiply-add of the Linear shapes; 4 D
   per query-key pair of attention, causal pairs only), GFLOP/s and the fraction of the
   peak of the instruction Phase 1's dtype runs on (bf16 products where the CPU has them,
   else fp32 FMA).

`--threads` defaults to what star's one ingest worker gets on a CPU (every core); the
peaks are measured on as many threads, so the fractions hold for that worker
(`--threads 1`: for one core, as each of a worker per core gets). Timings: run it on an
otherwise idle CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from starqa import models
from starqa.phase1 import hooks
from starqa.phase1.blockwise import Recorder, forward
from starqa.phase1.star import anchor_kv

PROBE = Path(__file__).with_name("roofline_peak.c")

# (probe in roofline_peak.c, the /proc/cpuinfo flags it needs, FLOPs per instruction)
INSTRUCTIONS = [
    ("avx512_bf16", ("avx512_bf16",), 64),
    ("avx512_fp32", ("avx512f",), 32),
    ("avx2_fp32", ("avx2", "fma"), 16),
    ("avx512_vnni", ("avx512_vnni",), 128),
    ("avx2_vnni", ("avx_vnni",), 64),
]
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
               "amx_bf16", "amx_int8")

# Linear modules by the last part of their name, as the layer parts they belong to
PARTS = {"q_proj": "QKV", "k_proj": "QKV", "v_proj": "QKV", "qkv_proj": "QKV",
         "o_proj": "output projection", "gate_proj": "MLP up", "up_proj": "MLP up",
         "gate_up_proj": "MLP up", "down_proj": "MLP down"}
ORDER = ("QKV", "attention", "output projection", "MLP up", "MLP down", "other Linear",
         "rest (norms, RoPE, activation)")


def peaks(flags: set[str], threads: int, seconds: float = 0.5) -> dict[str, float]:
    """GFLOP/s of each probe this CPU's flags allow, on `threads` threads at once."""
    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder) / "peak.so"
        subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o",
                        str(library), str(PROBE)], check=True)
        probes = ctypes.CDLL(str(library))
        found = {}
        for name, needs, flops in INSTRUCTIONS:
            if all(flag in flags for flag in needs):
                found[name] = _rate(getattr(probes, f"peak_{name}"), flops, threads, seconds)
        return found


def _rate(probe, flops: int, threads: int, seconds: float) -> float:
    """GFLOP/s of `probe` (ACC = 16 instructions a round) run on `threads` threads at once
    (ctypes lets go of the GIL), the rounds sized to last about `seconds`."""
    probe.restype, probe.argtypes = ctypes.c_double, [ctypes.c_long]
    started = time.perf_counter()
    probe(1_000_000)
    rounds = max(1_000_000, int(1_000_000 * seconds / (time.perf_counter() - started)))
    workers = [threading.Thread(target=probe, args=(rounds,)) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    return threads * rounds * 16 * flops / elapsed / 1e9


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """GFLOP/s of torch's F.linear, [m, k] by a [n, k] weight, in `dtype`."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(x, w)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    return 2 * m * k * n * repeats / (time.perf_counter() - started) / 1e9


@dataclass
class Part:
    seconds: float = 0.0
    flops: float = 0.0


class Clock:
    """Times each Linear module of a model by forward hooks (torch's public module hooks),
    with its FLOPs from the input's shape, as the layer part its name says."""

    def __init__(self, model):
        self.parts = {name: Part() for name in ORDER}
        self.started: dict[int, float] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                part = PARTS.get(name.rsplit(".", 1)[-1], "other Linear")
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop(part))

    def _start(self, module, args):
        self.started[id(module)] = time.perf_counter()

    def _stop(self, part: str):
        def stop(module, args, output):
            found = self.parts[part]
            found.seconds += time.perf_counter() - self.started.pop(id(module))
            found.flops += 2 * args[0].shape[:-1].numel() * module.in_features \
                * module.out_features
        return stop


class TimedRecorder(Recorder):
    """Phase 1's recorder, its attention timed into `part` with the causal pairs' FLOPs."""

    def __init__(self, keep: int, past, part: Part):
        super().__init__(keep, past)
        self.part = part

    def attention(self, layer, query, key, value, scale):
        started = time.perf_counter()
        out = super().attention(layer, query, key, value, scale)
        m, dim = query.shape[2], query.shape[3]
        before = (self.past[layer][0].shape[2] if self.past else 0)
        pairs = m * before + m * (m + 1) // 2
        self.part.seconds += time.perf_counter() - started
        self.part.flops += 4 * dim * query.shape[1] * pairs
        return out


def encode_block(model, ids: torch.Tensor, block: int, clock: Clock) -> float:
    """Seconds of one star block: `block` tokens after an anchor of as many (its KV first,
    untimed), parts into `clock`."""
    with torch.inference_mode():
        hook = TimedRecorder(block, anchor_kv(model, ids[:block]), clock.parts["attention"])
        for part in clock.parts.values():
            part.seconds = part.flops = 0.0
        started = time.perf_counter()
        forward(model, ids[block:2 * block], torch.arange(block, 2 * block), hook)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None,
                        help="default: every core (star's one ingest worker on a CPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model, blocks of 64 tokens")
    args = parser.parse_args()
    if args.smoke:
        import toy

        toy.banner("roofline")
        path = toy.model(toy.scratch("roofline"))
        args.model, args.block = "the toy model", 64
    else:
        path = models.resolve_model(args.model)
    cores = os.cpu_count() or 1
    threads = args.threads or cores
    torch.set_num_threads(threads)
    name, flags = models.cpu_description()
    print(f"CPU: {name}, {cores} cores; flags: "
          f"{' '.join(f for f in SHOWN_FLAGS if f in flags) or 'none of ' + str(SHOWN_FLAGS)}")
    print(f"{threads} thread(s) of {cores} cores, as one ingest worker")

    found = peaks(flags, threads)
    print("\nInstruction peaks, measured (registers only):")
    for probe, rate in found.items():
        print(f"  {probe:<12} {rate:8.1f} GFLOP/s")
    if "amx_bf16" in flags:
        print("  AMX: not probed (torch's GEMM below runs on it through oneDNN)")

    dtype = getattr(torch, models.phase1_dtype("bfloat16", "cpu", path))
    peak_name = "avx512_bf16" if dtype == torch.bfloat16 and "avx512_bf16" in found else \
        "avx512_fp32" if "avx512_fp32" in found else "avx2_fp32"
    peak = found.get(peak_name)
    model = models.load_model(path, dtype=dtype, attn_implementation=hooks.register())
    config = model.config.get_text_config()
    widest = (args.block, config.hidden_size, config.intermediate_size)
    gemm = gemm_rate(*widest, dtype)
    print(f"\ntorch GEMM in {str(dtype).split('.')[-1]}, {widest[0]} x {widest[1]} by "
          f"{widest[2]}: {gemm:.1f} GFLOP/s" + (f" ({gemm / peak:.0%} of {peak_name})"
                                                 if peak else ""))

    vocab = config.vocab_size
    ids = (torch.arange(2 * args.block) * 7919 + 13) % min(vocab, 30_000)
    clock = Clock(model)
    encode_block(model, ids[:2 * min(args.block, 64)], min(args.block, 64), clock)  # warm-up
    total = encode_block(model, ids, args.block, clock)
    parts = clock.parts
    parts["rest (norms, RoPE, activation)"].seconds = total - sum(
        p.seconds for p in parts.values())
    print(f"\nPhase 1, {args.model}: a star block of {args.block:,} tokens after its anchor "
          f"of {args.block:,}, {str(dtype).split('.')[-1]}, {total:.2f} s "
          f"({args.block / total:.1f} tokens/s)")
    print(f"  {'part':<32} {'s':>8} {'share':>6} {'GFLOP':>9} {'GFLOP/s':>8} {'of peak':>8}")
    for part_name, part in parts.items():
        if part.seconds <= 0 and part.flops == 0:
            continue
        rate = part.flops / part.seconds / 1e9 if part.seconds > 0 else 0.0
        print(f"  {part_name:<32} {part.seconds:8.2f} {part.seconds / total:6.1%} "
              f"{part.flops / 1e9:9.1f} {rate:8.1f} "
              f"{(rate / peak if peak and part.flops else 0):8.1%}")
    flops = sum(p.flops for p in parts.values())
    rate = flops / total / 1e9
    print(f"  {'Phase 1 (the whole block)':<32} {total:8.2f} {1:6.1%} {flops / 1e9:9.1f} "
          f"{rate:8.1f} {(rate / peak if peak else 0):8.1%}")
    if peak:
        print(f"\nPhase 1 reaches {rate / peak:.0%} of the {peak_name} peak "
              f"({peak:.1f} GFLOP/s on {threads} thread(s)); torch's GEMM alone "
              f"{gemm / peak:.0%}.")
    if "avx512_vnni" in found or "avx2_vnni" in found:
        vnni = found.get("avx512_vnni") or found["avx2_vnni"]
        print(f"int8 products (VNNI) peak: {vnni:.1f} GFLOP/s, {vnni / peak:.1f}x that "
              "(what int8 weights and activations could reach)" if peak else "")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/toy.py for --smoke
    main()
