"""One Phase 2 forward of B questions' decode rows (`phase2.decode.Batch`'s forwards), against
one question's, on a cached context, in one run:

    python benchmarks/dev/batch_step.py [--context samples] [--batches 2,4,8]

Loads the context in this process (its Phase 2 weights: int4 on a CPU), gives B slots a
20-token question each, then times (min-of-trials ms): one question's one-row forward as a
batch of one runs it (the compiled step) and layer by layer; B questions' rows in one
batched forward (`ShardAttention.batch`, the shard read once by `starqa_attend_batch`,
linears row by row); and the model's layers alone for B rows (the attention left out):
what batching costs per row beyond the first.
"""

import argparse
import time

import torch

from starqa.api.doors import find
from starqa.engine import LocalAnswerer


def best(run, trials: int = 5) -> float:
    run()
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default=None)
    parser.add_argument("--batches", default="2,4,8")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    local = LocalAnswerer.load(find(args.context))
    answerer = local.answerer
    decoder, hook, at = answerer.decoder, answerer.hook, answerer.query_position
    print(f"context {local.manifest.name}: {local.manifest.n_tokens:,} tokens, weights "
          f"{decoder.weights}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for slot in range(max(batches)):  # each slot a 20-token question
            hook.use(slot)
            hook.begin(64)
            decoder.forward(torch.arange(100, 120), torch.arange(at, at + 20), hook.attention,
                            compiled=hook.compiled)
            hook.advance(20)
        hook.use(0)
        one = torch.tensor([5])
        where = torch.tensor([at + 20])
        compiled = best(lambda: decoder.forward(one, where, hook.attention,
                                                compiled=hook.compiled))
        layered = best(lambda: decoder.forward(one, where, hook.attention))
        print(f"one question: {compiled:.1f} ms (compiled step), {layered:.1f} ms (layer by "
              "layer)")
        for b in batches:
            rows, places = torch.tensor([5] * b), torch.tensor([at + 20] * b)

            def batched() -> None:
                hook.batch([(slot, 1) for slot in range(b)])
                decoder.forward(rows, places, hook.attention, rowwise=True)
                hook.use(0)

            model = best(lambda: decoder.forward(rows, places, lambda _, q, k, v: q.float(),
                                                 rowwise=True))
            forward = best(batched)
            print(f"B={b}: {forward:.1f} ms a forward ({forward / b:.1f} a question), the "
                  f"model's layers {model:.1f} ms")


if __name__ == "__main__":
    main()
