"""Phase 2's decode loop: encode the question on every worker against its shards, then
generate greedily, every rank in step (the query host picks the tokens and broadcasts them).
Several questions over one context are decoded together (`Batch`: continuous batching, each
question's answer the one it gets alone); one question is a batch of one (`generate`).

Every worker runs all layers on the same query tokens (starqa.models.decoder) through its
`ShardAttention` (starqa.phase2.shard_attention), whose partial attentions are merged exactly
across workers in every layer, so every rank continues with the same hidden states. After
the question each forward may check tokens drafted by prompt lookup (starqa.phase2.lookup).
A world of one is the same code with no collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from starqa.core import MAX_DRAFT_TOKENS
from starqa.core.errors import StarqaError
from starqa.phase2.lookup import Drafter
from starqa.phase2.shard_attention import ShardAttention
from starqa.runtime import dist

# Drafted tokens checked per forward (`Batch`): 3 makes a forward of 4 rows, which costs
# torch's int4 kernel 1.8x a row's time (measured, Qwen2.5-Coder-1.5B's shapes, 2-core
# Zen 5) where a fifth row would double it.
DRAFT_TOKENS = 3
# Question tokens per forward of a long question's prefill: its progress is told between
# them, and the other questions' answers go on between them (each chunk's rows computed as
# in one forward over the whole question: see `Batch`).
PREFILL_CHUNK = 512
# The rows a forward of several questions spends on drafts, at most: past them a row costs
# nearly what a token does (the kernels are compute-bound there), so with B questions each
# drafts up to DRAFT_ROWS / B - 1 tokens (none from four questions on).
DRAFT_ROWS = DRAFT_TOKENS + 1


def draft_tokens_setting(default: int = DRAFT_TOKENS) -> int:
    """Drafted tokens per forward: STARQA_DRAFT_TOKENS if set (0 turns drafts off), else
    `default`. They never change the answer on CPU (see `Batch`), only its speed."""
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
    """What a `Batch` answers: the question's token ids at positions from `start_position`,
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
    """What a `Batch` tells a question's asker and asks it, on the query host: `on_token(id)` for
    each token of the answer as it comes, `should_stop()` after each forward (True: the
    answer ends there), `on_progress(done, total)` after each forward of its question's
    prefill (question tokens done, of its total)."""

    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_progress: Callable[[int, int], None] | None = None


def generate(decoder, info: dist.DistInfo, hook: ShardAttention, request: Request,
             callbacks: Callbacks = Callbacks()) -> list[int]:
    """One question's greedy answer over `hook`: a `Batch` of one (which says how)."""
    return Batch(decoder, info, hook).alone(request, callbacks).generated


@dataclass(eq=False)
class Answering:
    """One question in flight in a `Batch`, the same on every rank: its slot of the
    attention's state (`ShardAttention.use`), its next forward's input `ids` (the question,
    then the answer's last token and `drafts` guessed ones) at positions from `position`,
    and the answer so far."""

    slot: int
    request: Request
    callbacks: Callbacks
    drafter: Drafter | None
    ids: list[int]
    position: int
    prefilled: Any = None
    drafts: int = 0
    generated: list[int] = field(default_factory=list)
    started: bool = False  # its question's forward has run
    done: bool = False
    chunk: int = 0  # rows of its next forward, a part of its question's (0: all its ids)

    @property
    def inputs(self) -> list[int]:
        """Its next forward's input ids."""
        return self.ids[:self.chunk] if self.chunk else self.ids

    @property
    def draft_tokens(self) -> int:
        return max(0, self.request.draft_tokens)


class Batch:
    """Questions answered together over one worker's attention (continuous batching): a
    question joins (`join`) between two forwards and leaves when its answer ends; each
    `step` is one forward over the rows of every question under way, each at its own
    position with its own KV, drafts and stop rule. Every rank holds the same batch: the
    questions join in the same order everywhere and the query host broadcasts its picks.

    Exactness: a forward's rows are those each question's forward alone would hold, and
    every row is computed as in that forward: each question's rows attend the shard and
    their own KV as its own call would (`ShardAttention.batch`; the shard read once for all
    rows), the linear layers run row by row (`rowwise`; on the CPU with int8/int4 weights a
    row's result never depends on the other rows), and a question whose prefill would take
    the many-row kernels (`Decoder.layer_rows`) has forwards of its own, in parts.
    So on the CPU with quantised weights a question's answer is bit for bit the one it gets
    alone; elsewhere (dense GEMMs) the same up to rounding.

    Greedy: the query host picks each token and broadcasts its picks; it ends an answer
    instead when its `callbacks.should_stop()` (evaluated there only) asks. Drafts
    (`request.draft_tokens` > 0): after the question, each forward of a question is its
    answer's last token and up to that many tokens guessed by prompt lookup
    (starqa.phase2.lookup). Every row picks its next token; the guesses are kept up to the
    first the model did not pick, and the pick after the last kept one is the answer's next
    token, so one forward gives 1 to draft_tokens + 1 tokens, the same tokens as without
    drafts (each row computed as a one-token forward would, as above). Questions answered
    together share DRAFT_ROWS drafted rows a forward.

    request.prefilled: the question's forward, run already (a cold ask's head start before
    torch, starqa.coldstart.firsttoken): adopted instead of run again
    (`ShardAttention.adopt`), and the first token it streamed itself not passed to
    `on_token` a second time."""

    def __init__(self, decoder, info: dist.DistInfo, hook: ShardAttention):
        self.decoder, self.info, self.hook = decoder, info, hook
        self.active: list[Answering] = []
        self._parted = False  # the last forward was a part of a long question's prefill
        hook.track = True

    def close(self) -> None:
        """No more forwards: the attention stops keeping rows."""
        self.hook.track = False

    def alone(self, request: Request, callbacks: Callbacks = Callbacks()) -> Answering:
        """One question answered to its end in this batch, with no other, which then
        closes; its `Answering` (its slot holds its rows for `key_mass`)."""
        answering = self.join(request, callbacks)
        try:
            while not answering.done:
                self.step()
        finally:
            self.close()
        return answering

    def join(self, request: Request, callbacks: Callbacks = Callbacks()) -> Answering:
        """Add a question (on every rank, in the same order); its question's forward runs
        in a later `step`. Answers that ended leave their slot to it: take their sources
        first (`ShardAttention.use` + `key_mass`)."""
        taken = {a.slot for a in self.active}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        draft_tokens = max(0, request.draft_tokens)
        self.hook.use(slot)
        self.hook.begin(len(request.query_ids) + request.max_new_tokens + draft_tokens)
        drafter = (Drafter(request.context_ids, request.query_ids, request.max_new_tokens)
                   if self.hook.query_host and draft_tokens else None)
        answering = Answering(slot, request, callbacks, drafter, list(request.query_ids),
                              request.start_position, request.prefilled)
        self.active.append(answering)
        return answering

    def _plan(self) -> list[Answering]:
        """The questions of the next forward: one whose question's forward was run already
        (`prefilled`) alone; else every question under way and the new ones whose
        questions fit a row-by-row forward (`Decoder.layer_rows`), up to PREFILL_CHUNK
        question rows in all (so questions asked together get their first tokens
        together); or a longer new question's next part alone (`_prefill_chunk`), every
        other forward while others are under way."""
        new = [a for a in self.active if not a.started]
        if new and new[0].prefilled is not None:
            return [new[0]]
        started = [a for a in self.active if a.started]
        floor = getattr(self.decoder, "layer_rows", 0)
        fits, rows = [], 0
        for a in new:  # new questions that fit row-by-row forwards, PREFILL_CHUNK rows in all
            if len(a.ids) < floor and rows + len(a.ids) <= PREFILL_CHUNK:
                fits.append(a)
                rows += len(a.ids)
        long = [a for a in new if len(a.ids) >= floor]
        if (started or fits) and not (long and started and not self._parted):
            self._parted = False
            return started + fits
        # a long question's next part, alone; between its parts the others go on
        alone = long[0] if long else new[0]
        alone.chunk = _prefill_chunk(len(alone.ids), floor)
        self._parted = bool(started)
        return [alone]

    @torch.inference_mode()
    def step(self) -> list[Answering]:
        """One forward over the planned questions' rows; each question's picks taken (its
        callbacks called on the query host). Returns the answers that ended."""
        plan = self._plan()
        streamed = [list(a.prefilled.emitted) if a.prefilled is not None else [] for a in plan]
        hidden = self._forward(plan)
        if plan[0].chunk and plan[0].chunk < len(plan[0].ids):  # a part of a prefill
            self._prefilled_part(plan[0])
            return []
        picks = self._picks(plan, hidden)
        ended = []
        for a, quiet, (tokens, finished, next_drafts) in zip(plan, streamed, picks):
            if tokens[:len(quiet)] != quiet:
                raise RuntimeError(f"the first token computed before torch ({quiet}) is "
                                   f"not the one torch picks ({tokens[:1]})")
            first = len(a.ids) - 1 - a.drafts  # the row that picked the answer's next token
            # The rows before `first` and the len(tokens) from it hold the answer's tokens.
            self.hook.advance_slot(a.slot, first + len(tokens), slice(first, first + len(tokens)))
            a.position += first + len(tokens)
            if not a.started and a.callbacks.on_progress is not None:
                a.callbacks.on_progress(len(a.request.query_ids), len(a.request.query_ids))
            a.started, a.prefilled, a.chunk = True, None, 0
            for index, token in enumerate(tokens):
                a.generated.append(token)
                if a.callbacks.on_token is not None and index >= len(quiet):
                    a.callbacks.on_token(token)
            if finished or not tokens:
                a.done = True
                ended.append(a)
            else:
                a.drafts, a.ids = len(next_drafts), [tokens[-1], *next_drafts]
        self.active = [a for a in self.active if not a.done]
        return ended

    def _prefilled_part(self, a: Answering) -> None:
        """A part of `a`'s question went through: its KV kept (the prefill goes on, no token
        picked), its progress told."""
        self.hook.advance_slot(a.slot, a.chunk, slice(0, 0), question=True)
        a.position += a.chunk
        a.ids, a.chunk = a.ids[a.chunk:], 0
        if a.callbacks.on_progress is not None:
            total = len(a.request.query_ids)
            a.callbacks.on_progress(total - len(a.ids), total)

    def _forward(self, plan: list[Answering]) -> list[torch.Tensor]:
        """Each planned question's rows that pick tokens [1 + drafts, H], of one forward;
        the question's forward that starqa.coldstart.firsttoken ran before torch came,
        where `prefilled` holds it."""
        device = self.decoder.device
        if len(plan) == 1:
            a = plan[0]
            self.hook.use(a.slot)
            if a.prefilled is not None:
                self.hook.adopt(a.prefilled)
                return [torch.from_numpy(a.prefilled.hidden).view(self.decoder.dtype)]
            rowwise, compiled = a.drafts > 0, self.hook.compiled
        else:
            self.hook.batch([(a.slot, len(a.inputs)) for a in plan])
            rowwise, compiled = True, None
        ids = [i for a in plan for i in a.inputs]
        positions = torch.cat([torch.arange(a.position, a.position + len(a.inputs))
                               for a in plan]).to(device)
        hidden = self.decoder.forward(torch.tensor(ids, device=device), positions,
                                      self.hook.attention, rowwise=rowwise, compiled=compiled)
        self.hook.use(plan[0].slot)  # the batched forward is done
        rows, end = [], 0
        for a in plan:
            end += len(a.inputs)
            rows.append(hidden[end - 1 - a.drafts:end])
        return rows

    def _picks(self, plan: list[Answering], rows: list[torch.Tensor]
               ) -> list[tuple[list[int], bool, list[int]]]:
        """The query host's picks (`_pick`) for each planned question, at most its budget,
        on every rank: (tokens, finished, drafts for its next forward) each."""
        picked = None
        if self.hook.query_host:
            drafts = DRAFT_ROWS // len(self.active) - 1  # each question's share of DRAFT_ROWS
            logits = self.decoder.logits(torch.cat(rows)) if len(rows) > 1 else \
                self.decoder.logits(rows[0])
            picks = _argmax(logits)
            picked, at = [], 0
            for a, hidden in zip(plan, rows):
                mine, at = picks[at:at + len(hidden)], at + len(hidden)
                stop = a.callbacks.should_stop is not None and a.callbacks.should_stop()
                picked.append(_pick(mine, a.ids[len(a.ids) - 1 - a.drafts:], a.drafter,
                                    set(a.request.stop_ids),
                                    a.request.max_new_tokens - len(a.generated),
                                    min(a.draft_tokens, drafts), stop))
        if self.info.world_size > 1:  # the query host's picks, to every rank
            message = torch.zeros(len(plan), 2 * MAX_DRAFT_TOKENS + 4, dtype=torch.long,
                                  device=self.decoder.device)
            if picked is not None:
                for row, pick in zip(message, picked):
                    _pack(row, *pick)
            message = dist.broadcast(self.info, message, src=self.info.world_size - 1)
            picked = [_unpack(row) for row in message]
        return picked


def _prefill_chunk(rows: int, floor: float) -> int:
    """The rows of the next forward of a question's prefill of `rows` rows: PREFILL_CHUNK,
    unless fewer than `floor` (`Decoder.layer_rows`: a forward of fewer rows takes other
    kernels, whose bits differ) would be left for the last forward: then all of them."""
    floor = floor if floor != float("inf") else 1
    return PREFILL_CHUNK if rows - PREFILL_CHUNK >= max(floor, 1) else rows


def _pick(picks: list[int], ids: list[int], drafter: Drafter | None, stop_ids: set[int],
          budget: int, draft_tokens: int, stop: bool) -> tuple[list[int], bool, list[int]]:
    """(Query host) From the model's picks for the last forward's rows that pick tokens
    [1 + d], for their input ids [1 + d] (the answer's last token and d drafts): the
    answer's next tokens (at most `budget`, none from a stop token on), whether the answer
    is finished, and the drafts for the next forward."""
    if stop:
        return [], True, []
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
    """`_pick`'s result into a row of the broadcast message [2 D + 4] (D drafted tokens at
    most, MAX_DRAFT_TOKENS):
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
