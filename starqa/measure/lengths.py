"""`--lengths` of `starqa eval` and `starqa bench`: one grammar, one parser.

    LENGTHS := LENGTH ("," LENGTH)*      spaces around each LENGTH are fine
    LENGTH  := DIGITS                    a token count: 1500
             | NUMBER ("k" | "K")        times 1,024: 2k = 2,048, 1.5k = 1,536

A length is a whole number of tokens, at least 1 (1.1k = 1,126.4 is not). The parsed
lengths are sorted and each kept once; no text (None, or only spaces) means the command's
default. Each command then checks its own bounds (eval: the model's window; bench: a
shortest context).
"""

from __future__ import annotations

import re

from starqa.core.errors import StarqaError

_LENGTH = re.compile(r"(\d+)|(\d+(?:\.\d+)?|\.\d+)[kK]")
# The fix a bad --lengths names: pasted after the command it completes it (the shell
# skips the comment).
EXAMPLE = "--lengths 1k,2k,4k  # comma-separated token counts; k = 1,024 (1.5k = 1,536)"
HELP = "Comma-separated lengths in tokens, each a count (1500) or k = 1,024 tokens (2k, 1.5k)"


def parse_lengths(text: str | None) -> tuple[int, ...] | None:
    """"2k, 1500,1.5k" → (1500, 1536, 2048); None or blank → None (the default). Anything
    else is a StarqaError naming the part that is not a length, with EXAMPLE as its hint."""
    if text is None or not text.strip():
        return None
    lengths = set()
    for part in (p.strip() for p in text.split(",")):
        match = _LENGTH.fullmatch(part)
        value = (int(match[1]) if match[1] else float(match[2]) * 1024) if match else 0
        if value < 1 or value != int(value):
            raise StarqaError(f"Bad --lengths {text!r}: {part!r} is not a length in tokens "
                              "(a whole number of them, k = 1,024).", hint=EXAMPLE)
        lengths.add(int(value))
    return tuple(sorted(lengths))


def length_label(n: int) -> str:
    """How a length is written back: "4k" for whole multiples of 1,024, else "1,500"."""
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"
