"""A tiny random Llama with a word-level tokenizer and a chat template, saved as a Hugging
Face folder: the model of the unit tests (no weights to download)."""

from pathlib import Path

import torch

WORDS = ("the star attention block query answer long context budget travel approved who "
         "what is of a an and to in for by on was it file code document question policy "
         "office leave retry limit default seven").split()
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_tiny_model(folder: Path, seed: int = 0, window: int = 512) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<", ">", "system", "user", "assistant", "\"", "=", "/"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*specials, *WORDS]))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = TEMPLATE
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=window, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
