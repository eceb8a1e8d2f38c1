"""How far int4 weights move the model's next-token predictions from dense bf16 weights,
torch's int4 kernel against starqa's (starqa/native/_int4.c), on a cached context: a measure of
accuracy far more sensitive than scoring a few greedy answers, whose flips near a small
model's window edge are chance.

    python benchmarks/dev/int4_agreement.py CONTEXT_FOLDER [--questions 3] [--tokens 40]

CONTEXT_FOLDER is a cached context (`starqa info` names its folder). For each question the
dense model's greedy answer is generated, then all three models read question and answer
(teacher forcing: every position sees the same tokens) and their next-token distributions
are compared with dense's at every answer position: top-1 agreement and mean KL(dense ||
int4). Both int4 models hold the very same int4 weights (starqa's levels, in torch's packed
layout for its kernel); only the kernels differ.
"""

import argparse
from pathlib import Path

import torch

from starqa.runtime import dist
from starqa import models
from starqa.phase2 import decode
from starqa.native import ops as native
from starqa.phase2.answerer import Answerer
from starqa.launchers.query import question_ids
from starqa.models.decoder_io import load_decoder
from starqa.cache.manifest import read_manifest

from decode_step import torch_layout  # benchmarks/dev/, beside this script

QUESTIONS = ["Which function merges the partial attentions of the workers?",
             "What does the travel policy say about approvals?",
             "Summarise the documents in one sentence.",
             "Who is responsible for security incidents?",
             "What is the budget for the next year?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=Path)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    if not native.int4_fast():
        raise SystemExit("starqa's int4 kernel does not run here (no AVX-512 VNNI, or the "
                         "kernels are not built)")
    manifest = read_manifest(args.context)
    path = models.resolve_model(manifest.model.spec)
    answerer = Answerer.from_cache(manifest, dist.local_world("cpu"), path, "int4", None)
    hook, start = answerer.hook, answerer.query_position
    dense = load_decoder(path, torch.bfloat16, "dense")
    decoders = {"starqa int4": load_decoder(path, torch.bfloat16, "int4"),
                "torch int4": load_decoder(path, torch.bfloat16, "int4")}
    torch_layout(decoders["torch int4"], dense)
    agree = {name: 0 for name in decoders}
    divergence = {name: 0.0 for name in decoders}
    positions = 0
    with torch.inference_mode():
        for question in QUESTIONS[:args.questions]:
            ids = question_ids(manifest, path, question)[1]
            answer = decode.generate(dense, answerer.info, hook, decode.Request(
                ids, start, args.tokens, draft_tokens=0, context_ids=hook.ids))
            sequence = torch.tensor(list(ids) + answer)
            where = torch.arange(start, start + len(sequence))

            def logits(decoder):
                hook.begin(len(sequence))
                hidden = decoder.forward(sequence, where, hook.attention, rowwise=True)
                return decoder.logits(hidden[len(ids) - 1:]).float().log_softmax(-1)

            reference = logits(dense)
            positions += len(reference)
            for name, decoder in decoders.items():
                got = logits(decoder)
                agree[name] += (got.argmax(-1) == reference.argmax(-1)).sum().item()
                divergence[name] += (reference.exp() * (reference - got)).sum().item()
    print(f"{manifest.model.spec}, context {manifest.n_tokens:,} tokens, {positions} answer "
          f"positions ({args.questions} questions, dense's greedy answers)")
    for name in decoders:
        print(f"{name:<12} top-1 agreement with dense {agree[name]}/{positions} "
              f"({agree[name] / positions:.3f}), mean KL {divergence[name] / positions:.5f}")


if __name__ == "__main__":
    main()
