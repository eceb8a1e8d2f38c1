"""The prompt split (docs/methods.md §0): the chat-templated prompt cut into a context part,
encoded once in Phase 1, and a query part, encoded per question in Phase 2.

    context = template opening + system turn + user turn's opening + the packed documents
    query   = "\\n\\nQuestion: ..." + end of the user turn (+ earlier turns) + assistant header

Both are tokenised with `add_special_tokens=False`: the template carries BOS itself.

Documents, file names, questions and earlier answers are data: they never become a control
token of the model's tokenizer, whatever they contain (`<|im_end|>` in a question is five
plain tokens, not the end of a turn). Only the chat template's own markers are control
tokens (`Encoder`).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from starqa.corpus import FileSpan, valid_text
from starqa.core.errors import ContextLengthError, StarqaError

SYSTEM = "You are a helpful assistant. Answer the question using only the documents provided. Be brief."
INTRO = "Here are the documents.\n\n"
QUESTION = "\n\nQuestion: "
_DOCS = "\u2063STARQA-DOCUMENTS\u2063"  # never in a document; stands for them in the query
_SLOT = "\u2063STARQA-SLOT-{}\u2063"  # stands for a question or an answer while rendering
_SLOTS = re.compile("\u2063STARQA-SLOT-(\\d+)\u2063")


@dataclass(frozen=True)
class ContextTokens:
    ids: list[int]
    file_tokens: list[tuple[int, int]]  # per file: token span [start, end) of its document
    line_tokens: list[list[int]]        # per file: token index where each of its lines starts


def _messages(docs: str, question: str, history: Sequence[tuple[str, str]]) -> list[dict]:
    """System turn, then the documents in the first user turn with the first question."""
    turns = [*history, (question, None)]
    first_q = turns[0][0]
    messages = [{"role": "user", "content": INTRO + docs + QUESTION + first_q.strip()}]
    for i, (q, a) in enumerate(turns):
        if i:
            messages.append({"role": "user", "content": q.strip()})
        if a is not None:
            messages.append({"role": "assistant", "content": a.strip()})
    return messages


def _render(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        # A base model without a template: a plain layout the same split applies to.
        return SYSTEM + "\n\n" + "\n\n".join(m["content"] for m in messages) + "\n\nAnswer:"
    try:
        return tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *messages],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # templates without a system role (e.g. Gemma) raise on it
        first = {**messages[0], "content": SYSTEM + "\n\n" + messages[0]["content"]}
        return tokenizer.apply_chat_template([first, *messages[1:]], tokenize=False,
                                             add_generation_prompt=True)


def context_text(tokenizer, packed: str) -> tuple[str, int]:
    """The context part around `packed`, and the char offset where the documents start."""
    rendered = _render(tokenizer, _messages(_DOCS, "?", ()))
    docs_offset = rendered.index(_DOCS)
    return rendered[:docs_offset] + packed, docs_offset


def query_text(tokenizer, question: str, history: Sequence[tuple[str, str]] = ()) -> str:
    """The query part for `question` after earlier (question, answer) turns: everything the
    template puts after the documents."""
    rendered = _render(tokenizer, _messages(_DOCS, question, history))
    return rendered[rendered.index(_DOCS) + len(_DOCS):]


def query_template(tokenizer) -> dict | None:
    """The query part for a first question as {"prefix", "suffix"} around the question's
    stripped text, when the chat template renders every question that way (checked with two
    questions); None otherwise. Kept in the manifest, it lets `ask` tokenise a question with
    the plain `tokenizers` library instead of importing transformers for the template."""
    one, two = "\u2063ONE\u2063", "\u2063TWO\u2063"
    prefix, found, suffix = query_text(tokenizer, one).partition(one)
    if not found or prefix + two + suffix != query_text(tokenizer, two):
        return None
    return {"prefix": prefix, "suffix": suffix}


def tokenize_query(tokenizer, question: str, history: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The query part's ids: the template's markers are control tokens, the question and the
    earlier turns are text (rendered with slots in their place, filled in as data)."""
    values: list[str] = []

    def slot(text: str) -> str:
        values.append(text.strip())
        return _SLOT.format(len(values) - 1)

    slotted = [(slot(q), None if a is None else slot(a)) for q, a in [*history, (question, None)]]
    rendered = query_text(tokenizer, slotted[-1][0], slotted[:-1])
    pieces: list[tuple[str, bool]] = []
    at = 0
    for slot in _SLOTS.finditer(rendered):
        pieces += [(rendered[at:slot.start()], True), (values[int(slot.group(1))], False)]
        at = slot.end()
    pieces.append((rendered[at:], True))
    return encoder(tokenizer).encode(pieces)[0]


class QueryTokens:
    """A context's questions → query ids. With the manifest's query template (the chat
    template's text before and after a question alone) the plain `tokenizers` library does
    it: neither a cold ask on its way to the first token nor a warm group starting imports
    transformers for it. Questions with conversation history, and contexts without the
    template (older caches, templates that reshape the question), take transformers'
    tokenizer, loaded when first needed."""

    def __init__(self, template, model_path):
        from starqa import models

        self.model_path = model_path
        self.template = template if isinstance(template, dict) and all(
            isinstance(template.get(k), str) for k in ("prefix", "suffix")) else None
        self.fast = models.load_fast_tokenizer(model_path) if self.template else None
        self._full = None

    @property
    def tokenizer(self):
        """A tokenizer that decodes the answer (and finds its stop tokens)."""
        return self.fast if self.fast is not None else self.full()

    def full(self):
        """transformers' tokenizer (loaded once, when first needed)."""
        if self._full is None:
            from starqa import models

            self._full = models.load_tokenizer(self.model_path)
        return self._full

    def ids(self, question: str, history: Sequence[tuple[str, str]] = ()) -> list[int]:
        if self.fast is not None and not history:
            return encoder(self.fast).encode([(self.template["prefix"], True),
                                              (question.strip(), False),
                                              (self.template["suffix"], True)])[0]
        return tokenize_query(self.full(), question, history)


class TextStream:
    """Generated token ids in, the text to show out, piece by piece: a piece that ends in
    half a multi-byte character waits for the rest."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # shown so far

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.text = text[len(self.text):], text
        return piece

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.text = text[len(self.text):], text
        return piece


def tokenize_context(tokenizer, packed: str, spans: list[FileSpan]) -> ContextTokens:
    """Tokenise the context part, mapping each file's span and line starts to tokens through
    the tokenizer's character offsets (spans in the order of `spans`)."""
    text, base = context_text(tokenizer, packed)
    ids, ends = encoder(tokenizer).encode([(text[:base], True), (packed, False)])
    file_tokens, line_tokens = [], []
    for span in spans:
        start = _first_token_ending_after(ends, base + span.char_start)
        end = _first_token_ending_after(ends, base + span.char_end - 1) + 1
        file_tokens.append((start, min(end, len(ids))))
        text_end = span.char_end - len("\n</document>")
        lines = [span.text_start, *(i + 1 for i in _newlines(packed, span.text_start, text_end))]
        line_tokens.append([_first_token_ending_after(ends, base + c) for c in lines])
    return ContextTokens(ids, file_tokens, line_tokens)


# ---------------------------------------------------------------- text is data


class Encoder:
    """Tokenises a prompt made of pieces that are either the template's (its markers, e.g.
    `<|im_start|>`, become control tokens) or data (never: every added or special token of
    the tokenizer is matched only in the template's pieces).

    A tokenizer cuts its input at every added token and tokenises the text between them on
    its own; `encode` cuts at the template's markers alone and tokenises the text between
    them with the same tokenizer stripped of its added tokens. For pieces of data that hold
    no marker this gives the very ids of tokenising the joined text; for data that does, the
    marker's characters are plain text.
    """

    def __init__(self, backend):
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        self.markers = {t["content"]: t["id"] for t in spec.get("added_tokens") or ()}
        spec["added_tokens"] = []
        self.plain = Tokenizer.from_str(json.dumps(spec))
        self._find = re.compile("|".join(
            re.escape(m) for m in sorted(self.markers, key=len, reverse=True))) \
            if self.markers else None

    def text(self, text: str) -> list[int]:
        """Ids of `text` as data (a document, a question): no control token."""
        return self.plain.encode(valid_text(text), add_special_tokens=False).ids if text else []

    def encode(self, pieces: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        """(ids, each token's end offset in the joined text) of `pieces`, (text, is the
        template's) in order."""
        cuts: list[tuple[int, int, int]] = []  # (start, end, id) of the template's markers
        joined, at = [], 0
        for text, template in pieces:
            text = valid_text(text)
            if template and self._find is not None:
                cuts += [(at + m.start(), at + m.end(), self.markers[m.group()])
                         for m in self._find.finditer(text)]
            joined.append(text)
            at += len(text)
        whole = "".join(joined)
        ids: list[int] = []
        ends: list[int] = []
        at = 0
        for start, end, marker in [*cuts, (len(whole), len(whole), None)]:
            if start > at:
                enc = self.plain.encode(whole[at:start], add_special_tokens=False)
                ids += enc.ids
                ends += [at + e for _, e in enc.offsets]
            if marker is not None:
                ids.append(marker)
                ends.append(end)
            at = end
        return ids, ends


_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def encoder(tokenizer) -> Encoder:
    """The `Encoder` of a transformers fast tokenizer or a `models.FastTokenizer` (built
    once per tokenizer object)."""
    if (found := _ENCODERS.get(tokenizer)) is not None:
        return found
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise StarqaError("The model's tokenizer has no tokenizer.json (a slow tokenizer).",
                          hint="use a model folder with a fast tokenizer (tokenizer.json), "
                               "e.g. one saved by transformers' AutoTokenizer")
    _ENCODERS[tokenizer] = found = Encoder(backend)
    return found


def _newlines(text: str, start: int, end: int):
    i = text.find("\n", start, end)
    while i != -1:
        yield i
        i = text.find("\n", i + 1, end)


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


def room_error(n: int, m: int, max_new_tokens: int, window: int) -> ContextLengthError | None:
    """The one window check of Phase 2: a context whose question starts at position n (after
    its n tokens, or fewer at contiguous positions: `Manifest.query_position`), a question of
    m and up to `max_new_tokens` of answer must fit the model's window; None when they do,
    else the error that says how to make them fit."""
    return None if n + m + max_new_tokens <= window else over_window(n, m, max_new_tokens, window)


def over_window(n: int, m: int, max_new_tokens: int, window: int) -> ContextLengthError:
    """The over-window error of `ask`. Lowering --max-new-tokens is offered only when a
    lower value fits (as the value that does), never when the question alone fills the window."""
    fixes = []
    if n + m < window:
        fixes.append(f"allow a shorter answer (--max-new-tokens {window - n - m:,} or lower)")
    else:
        fixes.append("ask a shorter question")
    fixes += ["re-ingest less (ingest's --reserve, 512 by default, keeps room to ask)",
              "pass --beyond-window to go on anyway"]
    return ContextLengthError(
        f"Context {n:,} + question {m:,} + up to {max_new_tokens:,} answer tokens = "
        f"{n + m + max_new_tokens:,} tokens > {window:,} the model was trained on.",
        hint=", ".join(fixes[:-1]) + ", or " + fixes[-1])
