"""How close was exact attention's own answer: one `starqa eval` sample, answered with exact
attention and with top-k at each budget, and at the first token where an answer leaves
exact's, the three likeliest next tokens under each. Tells a top-k loss that changes what
the model is sure of from one where exact attention itself was a near tie (then any
approximation may flip it, and so may another dtype or kernel):

    python benchmarks/topk_margin.py niah_multikey_1 4 --length 8k --top-k 1%,4%,10%

The sample is the one `starqa eval --tasks TASK --lengths LENGTH --seed SEED` answers at
INDEX (same generator, same dense Phase 1, fp32 by default as the eval runs that measured
retention at 8K); answers run one token a step (no drafts), so each LM head call is a step.
"""

import argparse
import os

os.environ.setdefault("STARQA_DRAFT_TOKENS", "0")  # before starqa reads it: a call a token

import torch  # noqa: E402

from starqa import bench  # noqa: E402
from starqa.evals import generators, runner  # noqa: E402
from starqa.indexes import topk_settings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task")
    parser.add_argument("index", type=int, help="the sample's index in the eval")
    parser.add_argument("--length", default="8k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-k", default="1%,4%,10%")
    parser.add_argument("--kind", default="flat", help="index kind: flat or ivf")
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    opts = runner.EvalOptions(methods="dense", tasks=args.task, lengths=args.length,
                              samples=args.index + 1, seed=args.seed, dtype=args.dtype,
                              json_path=os.devnull)
    plan = runner.plan(opts)
    evaluator = runner.Evaluator(plan)
    sample = generators.generate(args.task, plan.lengths[0], args.seed, evaluator.tokenizer,
                                 args.index)
    encoded = evaluator.encode(sample, "dense")
    print(f"{args.task} #{args.index}, {len(sample.context_ids):,} tokens; answers "
          f"{sample.answers}; CPU: {bench.cpu_info()}")

    steps: list[torch.Tensor] = []
    logits = evaluator.decoder.logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        steps.append(out[-1].float())
        return out

    evaluator.decoder.logits = recorded
    runs = {}
    for label in ["exact", *args.top_k.split(",")]:
        settings = None if label == "exact" else \
            topk_settings("topk", label, None, args.kind, False)
        steps.clear()
        result = evaluator.answer(sample, "dense", settings, encoded)
        runs[label] = (result["token_ids"], list(steps))
        print(f"{label:>6}: {'right' if result['correct'] else 'wrong'}  "
              f"{result['prediction']!r}")

    def likeliest(step: torch.Tensor) -> str:
        top = torch.softmax(step, -1).topk(3)
        return ", ".join(f"{evaluator.tokenizer.decode([int(i)])!r} {float(p):.3f}"
                         for p, i in zip(top.values, top.indices))

    exact_tokens, exact_steps = runs["exact"]
    for label, (tokens, found) in runs.items():
        if label == "exact":
            continue
        at = next((i for i, (a, b) in enumerate(zip(exact_tokens, tokens)) if a != b), None)
        if at is None:
            print(f"{label:>6}: exact's tokens")
            continue
        print(f"{label:>6}: leaves exact's answer at token {at}: exact {likeliest(exact_steps[at])}"
              f"; {label} {likeliest(found[at])}")


if __name__ == "__main__":
    main()
