"""The prompt split (METHODS.md section 0): the chat-templated prompt cut into a context part,
encoded once in Phase 1, and a query part, encoded per question in Phase 2.

    context = template opening + system turn + user turn's opening + the packed documents
    query   = "\\n\\nQuestion: ..." + end of the user turn + the assistant header

Both are tokenised with `add_special_tokens=False`: the template carries BOS itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from starqa.corpus import FileSpan

SYSTEM = "You are a helpful assistant. Answer the question using only the documents provided. Be brief."
INTRO = "Here are the documents.\n\n"
QUESTION = "\n\nQuestion: "
_MARK = "\u2063STARQA-QUESTION\u2063"  # never in a document; replaced by the question


@dataclass(frozen=True)
class PromptParts:
    context: str         # full context text (template opening + documents)
    query_template: str  # the query part, with a marker where the question goes
    docs_offset: int     # char offset of the packed documents inside `context`


def split_prompt(tokenizer, packed: str) -> PromptParts:
    """Render the chat template around `packed` and cut it after the documents."""
    user = INTRO + packed + QUESTION + _MARK
    try:
        rendered = _render(tokenizer, [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": user}])
    except Exception:  # templates without a system role (e.g. Gemma) raise on it
        rendered = _render(tokenizer, [{"role": "user", "content": SYSTEM + "\n\n" + user}])
    docs_offset = rendered.index(INTRO + packed) + len(INTRO)
    cut = docs_offset + len(packed)
    return PromptParts(rendered[:cut], rendered[cut:], docs_offset)


def _render(tokenizer, messages) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        # A base model without a template: a plain layout the same split applies to.
        return "\n\n".join(m["content"] for m in messages) + "\n\nAnswer:"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_context(tokenizer, parts: PromptParts, spans: list[FileSpan]):
    """Token ids of the context and each file's token span [start, end).

    Returns (ids: list[int], file_tokens: list[tuple[int, int]]) with the spans in the order of
    `spans`, mapped through the tokenizer's character offsets.
    """
    enc = tokenizer(parts.context, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ends = [end for _, end in offsets]
    file_tokens = []
    for span in spans:
        start_char = parts.docs_offset + span.char_start
        end_char = parts.docs_offset + span.char_end
        start = _first_token_ending_after(ends, start_char)
        end = _first_token_ending_after(ends, end_char - 1) + 1
        file_tokens.append((start, min(end, len(ids))))
    return ids, file_tokens


def render_query(query_template: str, question: str) -> str:
    return query_template.replace(_MARK, question.strip())


def tokenize_query(tokenizer, query_template: str, question: str) -> list[int]:
    return tokenizer(render_query(query_template, question), add_special_tokens=False)["input_ids"]


def _first_token_ending_after(ends: list[int], char: int) -> int:
    """Index of the first token whose end offset is > char (binary search)."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] > char:
            hi = mid
        else:
            lo = mid + 1
    return min(lo, max(len(ends) - 1, 0))
