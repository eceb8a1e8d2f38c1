"""The chosen files laid out as one text (`pack`), each inside a `<document path="...">`
block, with every file's span so that answers point back to files and lines; a body's own
tags are escaped, so a file cannot close its block and forge another."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

from starqa.corpus.sources import FileSpan, TextFile


_CLOSE = "\n</document>"


# What the model reads has exactly the files `info` lists: a path is an escaped attribute
# value (a file named `q" trusted="yes.md` adds no attribute), and a body's own
# `<document`/`</document` tags (any case, spaced) are escaped as `&lt;`, so a file cannot
# close its block and forge another. Neither adds a line: sources keep their line numbers.
_TAG = re.compile(r"<(?=\s*/?\s*document)", re.IGNORECASE)


_ATTRIBUTE = str.maketrans({"&": "&amp;", '"': "&quot;", "<": "&lt;", ">": "&gt;",
                            **{chr(c): f"&#{c};" for c in (*range(32), 127)}})


def header(path: str) -> str:
    """The line that opens a file's block in the packed text."""
    return f'<document path="{valid_text(path).translate(_ATTRIBUTE)}">\n'


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, one for one (offsets into it stay
    right): Python keeps bytes that are not UTF-8 (a file name's, a typed or piped
    question's, a socket client's) as lone surrogates, which tokenizers refuse and terminals
    cannot print."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def escape_body(text: str) -> str:
    """A file's text as packed: its own document tags escaped (same lines, same length but
    for three characters a tag)."""
    return _TAG.sub("&lt;", text)


def pack(files: Sequence[TextFile]) -> tuple[str, list[FileSpan]]:
    """Join files as `<document path="...">` blocks separated by a blank line, with their spans."""
    blocks: list[str] = []
    spans: list[FileSpan] = []
    pos = 0
    for f in files:
        header_line, body = header(f.path), escape_body(f.text.rstrip())
        block = f"{header_line}{body}{_CLOSE}"
        if blocks:
            pos += 2  # the "\n\n" between blocks
        lines = body.count("\n") + 1 if body else 0
        spans.append(FileSpan(f.path, pos, pos + len(block), pos + len(header_line), lines))
        blocks.append(block)
        pos += len(block)
    return "\n\n".join(blocks), spans


def line_of(span: FileSpan, packed: str, char_offset: int) -> int:
    """1-based line in the file at `char_offset` of `packed`; offsets outside the text clamp."""
    text_end = span.char_end - len(_CLOSE)
    offset = min(max(char_offset, span.text_start), text_end)
    return min(packed.count("\n", span.text_start, offset) + 1, max(span.lines, 1))


def content_hash(files: Iterable[TextFile]) -> str:
    """sha256 hex over every file's path and text, in order; length-prefixed so unambiguous."""
    h = hashlib.sha256(b"starqa-corpus-v1\0")
    for f in files:
        for part in (f.path.encode(), f.text.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()
