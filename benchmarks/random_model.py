"""A model folder of an embedded model's shape with random weights: its config, tokenizer
and chat template, weights drawn afresh (seeded), for timing where the real weights cannot
go (a GPU host that reaches no network and takes a few MB of files):

    python benchmarks/random_model.py ~/.cache/starqa/models/smollm2-135m OUT --tiny-copy CARRY
    python benchmarks/random_model.py CARRY OUT     # there: CARRY holds the small files

Answers are noise; speed and memory are the real model's. --tiny-copy writes only the
small files (no weights) to CARRY, to take along. Not a timing itself: it makes the model
the GPU timings (benchmarks/cuda_check.sh) run on.

    python benchmarks/random_model.py --smoke   # both steps on the toy model (benchmarks/toy.py)
"""

import argparse
import shutil
from pathlib import Path

SMALL = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, nargs="?",
                        help="a model folder (config.json, tokenizer)")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--tiny-copy", type=Path, help="only copy the small files here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="both steps on the toy model of benchmarks/toy.py")
    args = parser.parse_args()
    if args.smoke:
        smoke(args.seed)
    elif args.source is None or args.out is None:
        parser.error("SOURCE and OUT are required (or --smoke)")
    elif args.tiny_copy:
        copy_small(args.source, args.tiny_copy)
    else:
        copy_small(args.source, args.out)
        draw(args.source, args.out, args.seed)


def copy_small(source: Path, target: Path) -> None:
    """The config, tokenizer and template files of `source` copied into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for name in SMALL:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def draw(source: Path, out: Path, seed: int) -> None:
    """Weights of `source`'s config drawn afresh (bf16, seeded), saved into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M random "
          f"parameters of {config.model_type}")


def smoke(seed: int) -> None:
    """The two steps as for a GPU host, on the toy model: its small files carried, then
    a random model drawn there from them, which loads."""
    import toy

    toy.banner("random_model")
    folder = toy.scratch("random")
    carry, out = folder / "carry", folder / "random"
    copy_small(toy.model(folder), carry)
    copy_small(carry, out)
    draw(carry, out, seed)
    import torch

    from starqa import models

    print(f"loads as {models.load_model(out, dtype=torch.bfloat16).config.model_type}, "
          f"{len(models.load_tokenizer(out))} tokens in its vocabulary")


if __name__ == "__main__":
    main()
