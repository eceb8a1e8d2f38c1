"""Phase 2's decode loop: encode the question on every worker against its shards, then
generate greedily, every rank in step (the query host picks the tokens and broadcasts them).

Every worker runs all layers on the same query tokens (starqa.models.decoder) through its
`ShardAttention` (starqa.phase2.shard_attention), whose partial attentions are merged exactly
across workers in every layer, so every rank continues with the same hidden states. After
the question each forward may check tokens drafted by prompt lookup (starqa.phase2.lookup).
A world of one is the same code with no collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from starqa.core import MAX_DRAFT_TOKENS
from starqa.core.errors import StarqaError
from starqa.phase2.lookup import Drafter
from starqa.phase2.shard_attention import ShardAttention
from starqa.runtime import dist

# Drafted tokens checked per forward (`generate`): 3 makes a forward of 4 rows, which costs
# torch's int4 kernel 1.8x a row's time (measured, Qwen2.5-Coder-1.5B's shapes, 2-core
# Zen 5) where a fifth row would double it.
DRAFT_TOKENS = 3


def draft_tokens_setting(default: int = DRAFT_TOKENS) -> int:
    """Drafted tokens per forward: STARQA_DRAFT_TOKENS if set (0 turns drafts off), else
    `default`. They never change the answer on CPU (see `generate`), only its speed."""
    raw = os.environ.get("STARQA_DRAFT_TOKENS")
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) > MAX_DRAFT_TOKENS:
        raise StarqaError(f"STARQA_DRAFT_TOKENS={raw!r} is not a number of tokens from 0 to "
                          f"{MAX_DRAFT_TOKENS}.",
                          hint="export STARQA_DRAFT_TOKENS=3   (or 0 to answer without drafts)")
    return int(raw)


@dataclass(frozen=True)
class Request:
    """What `generate` answers: the question's token ids at positions from `start_position`,
    up to `max_new_tokens` of answer, ended early by any of `stop_ids`.

    draft_tokens: tokens guessed by prompt lookup per forward (0: none) in `context_ids`
    (the query host's shard ids), the question and the answer so far. prefilled: the
    question's forward, run already by starqa.coldstart.firsttoken (its `Prefill`; a cold
    ask's head start before torch was imported, a world of one on the CPU)."""

    query_ids: Sequence[int]
    start_position: int
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    draft_tokens: int = DRAFT_TOKENS
    context_ids: torch.Tensor | None = None
    prefilled: Any = None  # a coldstart.firsttoken.Prefill (phase2 imports no coldstart)


@dataclass(frozen=True)
class Callbacks:
    """What `generate` tells its caller and asks it, on the query host: `on_token(id)` for
    each token of the answer as it comes, `should_stop()` after each forward (True: the
    answer ends there)."""

    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None


@torch.inference_mode()
def generate(decoder, info: dist.DistInfo, hook: ShardAttention, request: Request,
             callbacks: Callbacks = Callbacks()) -> list[int]:
    """Greedy generation of up to `request.max_new_tokens` after its question. The query
    host picks the tokens and broadcasts them; it sends a stop instead when
    `callbacks.should_stop()` (evaluated there only) asks to stop early.

    Drafts (`request.draft_tokens` > 0): after the question, each forward is the answer's
    last token and up to that many tokens guessed by prompt lookup (starqa.phase2.lookup).
    Every row picks its next token; the guesses are kept up to the first the model did not
    pick, and the pick after the last kept one is the answer's next token, so one forward
    gives 1 to draft_tokens + 1 tokens. On CPU with int8/int4 weights each row's arithmetic
    is that of a one-token forward (`Decoder.forward(rowwise=True)`, the attention kernel
    treats rows alike), so the answer is bit for bit the one without drafts; elsewhere it
    is the same up to rounding.

    request.prefilled: the question's forward, run already: adopted instead of run again
    (`ShardAttention.adopt`), and the first token it streamed itself not passed to
    `on_token` a second time."""
    loop = _Loop(decoder, info, hook, request, callbacks)
    ids, drafts, position = list(request.query_ids), 0, request.start_position
    prefilled, generated = request.prefilled, []
    hook.begin(len(ids) + request.max_new_tokens + loop.draft_tokens)
    hook.track = True
    try:
        while len(generated) < request.max_new_tokens:
            first = len(ids) - 1 - drafts  # the row that picks the answer's next token
            # the tokens starqa.coldstart.firsttoken streamed already
            streamed = list(prefilled.emitted) if prefilled is not None else []
            rows = loop.forward(ids, position, drafts, prefilled)
            prefilled = None
            tokens, finished, next_drafts = loop.pick(rows, ids[first:],
                                                      request.max_new_tokens - len(generated))
            quiet = len(streamed)  # streamed already: not passed to on_token again
            if tokens[:quiet] != streamed:
                raise RuntimeError(f"the first token computed before torch ({streamed}) is "
                                   f"not the one torch picks ({tokens[:1]})")
            # The rows before `first` and the len(tokens) from it hold the answer's tokens.
            hook.advance(first + len(tokens), slice(first, first + len(tokens)))
            position += first + len(tokens)
            for index, token in enumerate(tokens):
                generated.append(token)
                if callbacks.on_token is not None and index >= quiet:
                    callbacks.on_token(token)
            if finished or not tokens:
                break
            drafts, ids = len(next_drafts), [tokens[-1], *next_drafts]
    finally:
        hook.track = False
    return generated


class _Loop:
    """One answer's forwards and picks on one rank (`generate`'s steps)."""

    def __init__(self, decoder, info: dist.DistInfo, hook: ShardAttention, request: Request,
                 callbacks: Callbacks):
        self.decoder, self.info, self.hook = decoder, info, hook
        self.stop_ids, self.should_stop = set(request.stop_ids), callbacks.should_stop
        self.draft_tokens = max(0, request.draft_tokens)
        self.drafter = (Drafter(request.context_ids, request.query_ids, request.max_new_tokens)
                        if hook.query_host and self.draft_tokens else None)
        # What the query host broadcasts after each forward (`_pack`), the same on every rank.
        self.message = (torch.zeros(2 * self.draft_tokens + 4, dtype=torch.long,
                                    device=decoder.device) if info.world_size > 1 else None)

    def forward(self, ids: list[int], position: int, drafts: int, prefilled) -> torch.Tensor:
        """The hidden rows [1 + drafts, H] that pick tokens, of a forward over `ids` at
        positions from `position` (its last 1 + drafts rows); the question's forward that
        starqa.coldstart.firsttoken ran before torch came, where `prefilled` holds it."""
        if prefilled is not None:
            self.hook.adopt(prefilled)
            return torch.from_numpy(prefilled.hidden).view(self.decoder.dtype)
        device = self.decoder.device
        return self.decoder.forward(torch.tensor(ids, device=device),
                                    torch.arange(position, position + len(ids), device=device),
                                    self.hook.attention, rowwise=drafts > 0,
                                    compiled=self.hook.compiled)[len(ids) - 1 - drafts:]

    def pick(self, rows: torch.Tensor, ids: list[int], budget: int
             ) -> tuple[list[int], bool, list[int]]:
        """The query host's picks (`_pick`) from `rows` for their input `ids`, at most
        `budget` tokens, on every rank: (tokens, finished, drafts for the next forward)."""
        picked = None
        if self.hook.query_host:
            stop = self.should_stop is not None and self.should_stop()
            picked = _pick(self.decoder, rows, ids, self.drafter, self.stop_ids, budget,
                           self.draft_tokens, stop)
        if self.info.world_size > 1:  # the query host's picks, to every rank
            if picked is not None:
                _pack(self.message, *picked)
            picked = _unpack(dist.broadcast(self.info, self.message, src=self.info.world_size - 1))
        return picked


def _pick(decoder, hidden: torch.Tensor, ids: list[int], drafter: Drafter | None,
          stop_ids: set[int], budget: int, draft_tokens: int, stop: bool
          ) -> tuple[list[int], bool, list[int]]:
    """(Query host) From the last forward's rows that pick tokens, hidden [1 + d, H] for its
    input ids [1 + d] (the answer's last token and d drafts): the answer's next tokens (at
    most `budget`, none from a stop token on), whether the answer is finished, and the
    drafts for the next forward."""
    if stop:
        return [], True, []
    picks = _argmax(decoder.logits(hidden))
    kept = 0  # drafts the model picked itself
    while kept < len(ids) - 1 and picks[kept] == ids[1 + kept]:
        kept += 1
    tokens, finished = picks[:kept + 1][:budget], False
    for i, token in enumerate(tokens):
        if token in stop_ids:
            tokens, finished = tokens[:i], True
            break
    budget -= len(tokens)
    drafts: list[int] = []
    if drafter is not None and not finished and budget > 1:
        drafter.extend(tokens)
        drafts = drafter.propose(min(draft_tokens, budget - 1))
    return tokens, finished or budget < 1, drafts


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first largest logit (a NaN counts as the largest), as torch's argmax and
    starqa.coldstart.firsttoken's numpy one pick it. On the CPU numpy's over the logits widened to
    fp32 (exactly: the same picks): torch's argmax of a bf16 row of 49,152 took ~180 µs of each
    decode token, numpy's ~20."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return np.argmax(logits.float().numpy(), axis=-1).tolist()


def _pack(message: torch.Tensor, tokens: list[int], finished: bool, drafts: list[int]) -> None:
    """`_pick`'s result into the broadcast message [2 D + 4] (D drafted tokens at most):
    [len(tokens), finished, tokens padded to D + 1, len(drafts), drafts padded to D]."""
    room = (len(message) - 4) // 2
    values = [0] * len(message)
    values[0], values[1] = len(tokens), int(finished)
    values[2:2 + len(tokens)] = tokens
    values[3 + room] = len(drafts)
    values[4 + room:4 + room + len(drafts)] = drafts
    message.copy_(torch.tensor(values, dtype=torch.long))


def _unpack(message: torch.Tensor) -> tuple[list[int], bool, list[int]]:
    """`_pack`'s inverse, on every rank: (tokens, finished, drafts)."""
    values, room = message.tolist(), (len(message) - 4) // 2
    at = 4 + room  # the drafts, after their count
    return values[2:2 + values[0]], bool(values[1]), values[at:at + values[at - 1]]
