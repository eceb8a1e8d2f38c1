"""A model folder of an embedded model's shape with random weights: its config, tokenizer
and chat template, weights drawn afresh (seeded), for timing where the real weights cannot
go (a GPU machine that reaches no network and takes a few MB of files):

    python benchmarks/random_model.py ~/.cache/starqa/models/smollm2-135m OUT --tiny-copy CARRY
    python benchmarks/random_model.py CARRY OUT     # there: CARRY holds the small files

Answers are noise; speed and memory are the real model's. --tiny-copy writes only the
small files (no weights) to CARRY, to take along."""

import argparse
import shutil
from pathlib import Path

SMALL = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a model folder (config.json, tokenizer)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny-copy", type=Path, help="only copy the small files here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target = args.tiny_copy or args.out
    target.mkdir(parents=True, exist_ok=True)
    for name in SMALL:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, target / name)
    if args.tiny_copy:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random "
          f"parameters of {config.model_type}")


if __name__ == "__main__":
    main()
