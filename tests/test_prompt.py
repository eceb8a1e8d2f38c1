"""The prompt split: context + query tokens are the whole chat-templated prompt."""

from starqa import corpus
from starqa.corpus import prompt
from starqa.models import load_tokenizer


def test_context_plus_query_is_the_rendered_prompt(tok):
    files = [corpus.TextFile("a.md", "the star block\nthe query\n", 30)]
    packed, spans = corpus.pack(files)
    context, offset = prompt.context_text(tok, packed)
    full = tok.apply_chat_template(
        [{"role": "system", "content": prompt.SYSTEM},
         {"role": "user", "content": prompt.INTRO + packed + prompt.QUESTION + "who is it"}],
        tokenize=False, add_generation_prompt=True)
    assert context + prompt.query_text(tok, "who is it") == full
    assert context[offset:] == packed


def test_history_goes_into_the_query_part(tok):
    query = prompt.query_text(tok, "second", [("first", "answer one")])
    assert query.index("first") < query.index("answer one") < query.index("second")
    assert query.startswith(prompt.QUESTION + "first")


def test_file_and_line_token_spans(tok):
    files = [corpus.TextFile("a.md", "the star\nblock query\nanswer\n", 30),
             corpus.TextFile("b.md", "long context\n", 13)]
    packed, spans = corpus.pack(files)
    tokens = prompt.tokenize_context(tok, packed, spans)
    (a0, a1), (b0, b1) = tokens.file_tokens
    assert a0 < a1 <= b0 < b1 <= len(tokens.ids)
    vocab = {v: k for k, v in tok.get_vocab().items()}
    lines = tokens.line_tokens[0]
    assert [vocab[tokens.ids[i]] for i in lines] == ["the", "block", "answer"]
    assert vocab[tokens.ids[tokens.line_tokens[1][0]]] == "long"


def test_query_template_with_the_plain_tokenizers_library(tiny_model, tiny_qwen):
    """A cold ask tokenises the question with `tokenizers` alone, from the template's query
    part kept in the manifest: the very ids, decoded text and stop ids transformers gives,
    for the tiny Llama (word level) and the tiny Qwen2 (byte-level BPE, ChatML)."""
    from starqa import models

    for path in (tiny_model, tiny_qwen):
        tok, fast = load_tokenizer(path), models.load_fast_tokenizer(path)
        template = prompt.query_template(tok)
        assert template is not None and template["prefix"].startswith(prompt.QUESTION)
        for question in ("who approved the travel budget", "  the office ?\n", "a"):
            ids = prompt.tokenize_query(tok, question)
            assert fast.encode(template["prefix"] + question.strip() + template["suffix"]) == ids
            assert fast.decode(ids) == tok.decode(ids, skip_special_tokens=True)
        assert models.stop_ids(fast, path) == models.stop_ids(tok, path)
        assert models.stop_ids(fast, path)  # an answer can end
