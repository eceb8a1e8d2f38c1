"""Drafted tokens by prompt lookup: a guess at the next few tokens of an answer, from where
its last tokens appeared before.

An answer about documents repeats their words: names, identifiers, whole lines of code.
When the answer's last few tokens occurred earlier in the context, the question or the
answer itself, the tokens that followed them there are a good guess of what comes next.
`starqa.phase2.decode.Batch` feeds the guess through the model in one forward with the token
before it and keeps the tokens the model itself picks, up to the first that differs from
the guess (plus the model's own pick after it). A forward of a few rows reads every weight
once, as a forward of one does, so each accepted draft is a token for a fraction of a
decode step; the answer is the same, token for token, as one token per forward.

Pure: token ids in, token ids out; no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The longest run of the answer's last tokens that is matched, and the shortest that is
# trusted: a single token ("the", ",") follows too many things to predict what comes next.
MAX_MATCH = 4
MIN_MATCH = 2


class Drafter:
    """The context's token ids, then the question's and the answer's as they come, in one
    buffer; `propose` looks the buffer's last tokens up in what came before them."""

    def __init__(self, context: torch.Tensor | None, question: Sequence[int], room: int):
        context = torch.empty(0, dtype=torch.long) if context is None else context.long().cpu()
        self._ids = torch.empty(len(context) + len(question) + room, dtype=torch.long)
        self._ids[:len(context)] = context
        self._length = len(context)
        self.extend(question)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append the tokens the answer just got (the buffer grows if it must)."""
        end = self._length + len(tokens)
        if end > len(self._ids):
            grown = torch.empty(max(end, 2 * len(self._ids)), dtype=torch.long)
            grown[:self._length] = self._ids[:self._length]
            self._ids = grown
        self._ids[self._length:end] = torch.as_tensor(list(tokens), dtype=torch.long)
        self._length = end

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        run (MIN_MATCH to MAX_MATCH tokens) the buffer ends with; [] when there is none."""
        n = self._length
        if limit < 1 or n < MIN_MATCH + 1:
            return []
        ids = self._ids[:n]
        # Ends of earlier occurrences of the last token (not the last token itself) ...
        ends = (ids[:n - 1] == ids[n - 1]).nonzero().flatten()
        ends = ends[ends >= MIN_MATCH - 1]
        if not ends.numel():
            return []
        # ... and how many of the tokens before it match too (up to MAX_MATCH in all).
        matched = torch.ones_like(ends)
        alive = torch.ones_like(ends, dtype=torch.bool)
        for back in range(1, min(MAX_MATCH, n - 1)):
            before = ends - back
            same = (before >= 0) & (ids[before.clamp(min=0)] == ids[n - 1 - back])
            alive &= same
            matched += alive
        best = int(matched.max())
        if best < MIN_MATCH:
            return []
        end = int(ends[matched == best][-1])  # the latest of the longest
        return ids[end + 1:min(end + 1 + limit, n)].tolist()
