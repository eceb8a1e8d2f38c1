"""Tiny random models with a small tokenizer and a chat template, saved as Hugging Face
folders: the models of the unit tests (no weights to download).

`arch="llama"` (the default): a Llama, word-level tokenizer, plain template. `arch="qwen2"`:
a Qwen2 (q/k/v projections with biases, randomised here so they matter; GQA 6/2 like
Qwen2.5's 12/2), a byte-level BPE loaded as Qwen2Tokenizer, Qwen2.5's ChatML template
(default system prompt included) and its special tokens.

`reference_tokens`: what transformers alone answers on such a model (greedy `generate` over
the whole prompt in fp32), the reference starqa's answers are compared with.
"""

from pathlib import Path

import torch

WORDS = ("the star attention block query answer long context budget travel approved who "
         "what is of a an and to in for by on was it file code document question policy "
         "office leave retry limit default seven").split()
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
# Qwen2.5's chat template without its tool-calling branches (starqa sends no tools).
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PROMPT_WORDS = ("You are helpful assistant Answer question using only documents provided Be "
                "brief Here Question document path md py system user").split()


def make_tiny_model(folder: Path, seed: int = 0, window: int = 512, arch: str = "llama",
                    never_stops: bool = False, vocab_multiple: int = 1) -> Path:
    """never_stops: the end-of-turn token's logit is pinned to 0 while the others vary with
    the context, so greedy answers run to max_new_tokens (for tests that interrupt one).
    vocab_multiple: the model's vocabulary padded to a multiple of it (int4 tiles take 16
    outputs at a time), the padding's logits pinned to 0 (a random model's largest is above
    it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if arch == "qwen2":
        return _make_tiny_qwen2(folder, seed, window, vocab_multiple)
    if arch != "llama":
        raise ValueError(f"unknown arch {arch!r}")
    specials = ["<unk>", "<s>", "</s>", "<", ">", "system", "user", "assistant", "\"", "=", "/"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*specials, *WORDS]))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = TEMPLATE
    config = LlamaConfig(vocab_size=_padded(len(vocab), vocab_multiple), hidden_size=64,
                         intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=window, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.2)  # large enough that the context sways the answer
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        if never_stops:
            model.lm_head.weight[config.eos_token_id] = 0.0
        model.lm_head.weight[len(vocab):] = 0.0
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def byte_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE trained on WORDS and the prompt's words (the 256 byte symbols plus
    its merges): (vocab, merges)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = " ".join([*WORDS, *PROMPT_WORDS])
    bpe.train_from_iterator([text, text.title(), text + " .\n\n"], trainer)
    trained = json.loads(bpe.to_str())["model"]
    return trained["vocab"], [tuple(m) for m in trained["merges"]]


def _make_tiny_qwen2(folder: Path, seed: int, window: int, vocab_multiple: int) -> Path:
    """transformers loads any qwen2 folder's tokenizer as Qwen2Tokenizer (byte-level BPE with
    Qwen's pre-tokenizer regex), so the tiny one is a real byte-level BPE: the 256 byte
    symbols plus merges trained on WORDS and the prompt's words."""
    from tokenizers import AddedToken
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    vocab, merges = byte_bpe()
    for special in QWEN_SPECIALS:
        vocab[special] = len(vocab)
    # Like Qwen2.5's tokenizer: no BOS added, <|im_end|> ends a turn, <|endoftext|> pads.
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None,
                         bos_token="<|endoftext|>", eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIALS], special_tokens=True)
    tok.chat_template = QWEN_TEMPLATE
    config = Qwen2Config(vocab_size=_padded(len(vocab), vocab_multiple), hidden_size=96,
                         intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=window, eos_token_id=vocab["<|im_end|>"],
                         bos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"],
                         rope_theta=1_000_000.0,
                         initializer_range=0.2)  # large enough that the context sways the answer
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # initialised to zero: make the q/k/v biases count
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
        model.lm_head.weight[len(vocab):] = 0.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def context_ids(model_path, manifest) -> list[int]:
    """The token ids of a context as `ingest` packed them: its sources read again, in path
    order (the files of `conftest.docs` share one mtime), checked against its length."""
    from starqa import corpus
    from starqa.corpus import prompt
    from starqa.models import load_tokenizer

    tok = load_tokenizer(model_path)
    files = corpus.collect(manifest.sources).files
    packed, spans = corpus.pack(files)
    ids = prompt.tokenize_context(tok, packed, spans).ids
    assert len(ids) == manifest.n_tokens
    return ids


def reference_tokens(model_path, manifest, question: str, max_new_tokens: int) -> list[int]:
    """One ordinary transformers generate over the whole prompt (context + query), fp32,
    greedy: the answer's token ids, its end-of-turn token dropped."""
    from starqa.corpus import prompt
    from starqa.models import load_model, load_tokenizer

    tok = load_tokenizer(model_path)
    model = load_model(model_path, dtype=torch.float32)
    ids = context_ids(model_path, manifest) + prompt.tokenize_query(tok, question)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    return new[:-1] if new and new[-1] == tok.eos_token_id else new
