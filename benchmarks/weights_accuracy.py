"""Accuracy of Phase 2's weight formats on `starqa eval`'s samples, paired: each sample's
context is encoded once (Phase 1, dense weights, the cache as `ingest` makes it), then the
very same shards answer the question with every weight format.

    python benchmarks/weights_accuracy.py [--model smollm2-135m] [--lengths 4k] \\
        [--samples 5] [--weights dense,int8,int4] [--method dense] [--tasks ...]
    python benchmarks/weights_accuracy.py --smoke   # toy model, one 300-token sample a task

Accuracy only, on the CPU (the formats' kernels follow its flags, their answers do not
depend on them beyond rounding): safe on a busy CPU.

Prints per task: accuracy per format, and each format's retention (accuracy / dense's) and
how often its answer is token for token dense's. Same generators, seed, greedy decoding and
early stop as `starqa eval` (dense weights in the cache's dtype are the reference).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="4k")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--weights", default="dense,int8,int4")
    parser.add_argument("--method", default="dense")
    parser.add_argument("--tasks", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="the toy model (benchmarks/toy.py), 300 tokens, 1 sample a task")
    args = parser.parse_args()

    import torch

    from starqa.runtime import dist
    from starqa.phase1 import hooks
    from starqa import methods, models
    from starqa.cache import shards
    from starqa.phase2.answerer import Answerer, RankShare
    from starqa.models.decoder_io import load_decoder
    from starqa.measure.evals import generators, runner, scoring

    formats = [w.strip() for w in args.weights.split(",")]
    if formats[0] != "dense":
        formats.insert(0, "dense")
    if args.smoke:
        import toy

        toy.banner("weights_accuracy")
        model_path = toy.model(toy.scratch("weights"))
        args.lengths, args.samples = "300", 1
        args.tasks = args.tasks or "niah,vt,cwe,fwe"  # qa's prompt alone is longer
    else:
        model_path = models.resolve_model(args.model)
    tasks = generators.resolve_tasks(args.tasks)
    lengths = runner.parse_lengths(args.lengths)
    tokenizer = models.load_tokenizer(model_path)
    stops = models.stop_ids(tokenizer, model_path)
    dtype = torch.bfloat16
    encoder = models.load_model(model_path, dtype=dtype, attn_implementation=hooks.register())
    decoders = {w: load_decoder(model_path, dtype, w) for w in formats}
    info = dist.local_world()
    print(f"{model_path.name}, {args.method} Phase 1 in bf16, tasks {', '.join(tasks)}, lengths "
          f"{args.lengths}, {args.samples} samples per cell, weights {', '.join(formats)}",
          flush=True)

    correct: dict[tuple[str, str], list[bool]] = defaultdict(list)
    same: dict[tuple[str, str], list[bool]] = defaultdict(list)
    started = time.perf_counter()
    for length in lengths:
        for task in tasks:
            for index in range(args.samples):
                sample = generators.generate(task, length, args.seed, tokenizer, index)
                n = len(sample.context_ids)
                config = methods.method_config(args.method, n)
                method = methods.get(config.name)
                blocks = methods.plan_blocks(n, config.block_size)
                prepared = method.prepare(sample.context_ids, config, blocks)
                encoded = method.encode_local(encoder, torch.tensor(sample.context_ids), config,
                                              blocks, prepared)
                shard = shards.shard_of([(k, v) for _, k, v in sorted(encoded, key=lambda x: x[0])],
                                       dtype)
                start = method.query_position(sample.context_ids, config, blocks, prepared)
                answers = {}
                for weights in formats:
                    tokens: list[int] = []

                    def should_stop() -> bool:
                        text = tokenizer.decode(tokens, skip_special_tokens=True)
                        return bool(tokens) and scoring.is_correct(text, sample.answers,
                                                                   sample.match)

                    Answerer(info, decoders[weights], RankShare(shard, start)).answer(
                        sample.query_ids, sample.max_new_tokens, stops, tokens.append,
                        should_stop)
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    answers[weights] = tokens
                    correct[(task, weights)].append(
                        scoring.is_correct(text, sample.answers, sample.match))
                    same[(task, weights)].append(tokens == answers["dense"])
                print(f"  {task} {runner.length_label(length)} #{index}: " + ", ".join(
                    f"{w} {'✓' if correct[(task, w)][-1] else '✗'}" for w in formats)
                    + f"  ({time.perf_counter() - started:.0f} s)", flush=True)

    print(f"\n{'task':<14}" + "".join(f"{w:>10}" for w in formats)
          + "".join(f"{'ret ' + w:>12}{'same ' + w:>12}" for w in formats[1:]))
    for task in [*tasks, "all"]:
        chosen = tasks if task == "all" else [task]
        right = {w: [c for t in chosen for c in correct[(t, w)]] for w in formats}
        row = f"{task:<14}" + "".join(f"{sum(right[w]) / len(right[w]):>10.2f}" for w in formats)
        for w in formats[1:]:
            agree = [c for t in chosen for c in same[(t, w)]]
            retention = sum(right[w]) / sum(right["dense"]) if sum(right["dense"]) else float("nan")
            row += f"{retention:>12.2f}{sum(agree) / len(agree):>12.2f}"
        print(row)
    print(f"\n{len(tasks) * len(lengths) * args.samples} samples, each answered with every "
          f"format; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
