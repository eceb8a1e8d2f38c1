"""What `ingest` chooses for a context, and the one line that says it: how its positions fit
the model's window, and where its KV lives. Pure: numbers in, settings and a line out
(tests/test_planner.py holds the choices for given lengths, windows and memory).

The KV's precision is int8 past the window (where it keeps star's answers on repo_qa,
docs/results.md "KV precision"), else float (the cache's dtype) unless float would take
more than half the machine's memory: then int8 too (`--kv`, docs/architecture.md "KV
precision"). A context that fits the window with its reserve is encoded as asked. One
that does not is, by default, encoded by Star Attention with contiguous positions
(docs/methods.md, "Past the window"): each block after its anchor in the next of the
slots of a block's positions that the window holds beside the anchor and the reserve, so
that every position a block or a question meets stays within the window the model was
trained on, whatever the context's length. The blocks are sized so that anchor + block +
reserve fit the window, and there are as many slots as fit beside the anchor.
`--beyond-window` keeps the positions as they are (plain extrapolation, which the planner
never picks; docs/methods.md says what was measured of both); settings a user gave that
cannot fit are refused with the sizes that would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from starqa import methods
from starqa.cache.manifest import KV_KINDS
from starqa.core.errors import StarqaError
from starqa.launchers.ingest.options import IngestOptions


@dataclass(frozen=True)
class Choice:
    """The options an ingest runs with once planned, and the line that says what was chosen
    and why (None: nothing to say, the context fits as asked)."""

    opts: IngestOptions
    line: str | None


def plan(opts: IngestOptions, n: int, window: int,
         kv_bytes: Callable[[str], int | None] | None = None, total: int | None = None,
         available: int | None = None) -> Choice:
    """The plan for `n` tokens on a model of `window` tokens, `opts.reserve` resolved.

    kv_bytes: the KV one token takes in the cache at a KV precision (None: unknown); total,
    available: the machine's memory and what of it is free (None: unknown). The KV's
    precision, where not given, is int8 past the window, else float unless float would
    take more than half of `total` (a choice that stays put from one run to the next, and
    so does the cache key; across machines, float: their memories may differ, their choices
    may not). Raises StarqaError where the settings given cannot fit the window (the sizes
    that would, in the hint).
    """
    reserve = opts.reserve or 0
    within = n + reserve <= window
    # across machines every launcher must choose alike, and their memories may differ
    kv, why_kv = _precision(opts.kv, n, kv_bytes, total if opts.nnodes == 1 else None,
                            past=not within and not opts.beyond_window)
    opts = replace(opts, kv=kv)
    kv_line = _kv_words(n, kv, kv_bytes, available, why_kv)
    if within:
        return Choice(opts, f"Plan: {n:,} tokens fit the {window:,}-token window{kv_line}."
                      if why_kv else None)
    over = f"{n:,} tokens + {reserve:,} reserved > the {window:,}-token window"
    if opts.beyond_window:
        return Choice(opts, f"Plan: {over}: positions past the window, as asked "
                            f"(--beyond-window: the model extrapolates){kv_line}.")
    given = opts.method_params or {}
    fits = methods.get(opts.method).fits_any_window
    if not fits or given.get("positions") == "sparse":
        asked = "--positions sparse" if fits else f"--method {opts.method}"
        raise _cannot(n, reserve, window, f"{asked} places positions past it", f"leave {asked} "
                      f"out ({methods.DEFAULT} with contiguous positions stays within the "
                      "window)")
    if (window - reserve) // 2 < methods.MIN_BLOCK:
        raise _cannot(n, reserve, window, f"a window this small holds no block of "
                      f"{methods.MIN_BLOCK} tokens beside an anchor as long")
    block, anchor, params = methods.fitted_contiguous(n, window - reserve, opts.block_size,
                                                      opts.anchor_size, given)
    chosen = replace(opts, block_size=block, anchor_size=anchor, method_params=params)
    slots = params["slots"]
    span = f"{anchor:,}-{anchor + slots * block - 1:,}"
    where = (f"in turn in the window's {slots} slots of {block:,} positions ({span})"
             if slots > 1 else f"all at the same positions ({span})")
    return Choice(chosen, f"Plan: {over}: {opts.method} blocks of {block:,} tokens, each after a "
                          f"{anchor:,}-token anchor, {where}, so no position leaves the "
                          f"window{kv_line}.")


def _precision(given: str | None, n: int, kv_bytes: Callable[[str], int | None] | None,
               total: int | None, past: bool = False) -> tuple[str, str | None]:
    """(the KV's precision, why int8 was chosen or None): as given; else int8 past the
    window (planned there, where it keeps star's answers at about half float's bytes:
    docs/results.md, "KV precision"); else float unless float would take more than half
    of the machine's memory."""
    if given is not None:
        return given, None
    if past:
        return KV_KINDS[1], "past the window: it keeps float's accuracy at half the bytes"
    per_token = kv_bytes(KV_KINDS[0]) if kv_bytes else None
    whole = n * per_token if per_token else None
    if whole is None or total is None or whole <= total // 2:
        return KV_KINDS[0], None
    return KV_KINDS[1], (f"float would take {_gb(whole)}, more than half of the machine's "
                         f"{_gb(total)}")


MIN_ROOM = 64  # tokens: the least room worth offering for a question and its answer


def _cannot(n: int, reserve: int, window: int, why: str, fix: str | None = None
            ) -> StarqaError:
    """The over-window error: the numbers with the reserve (a context that fills the window
    leaves no room to ask), why no plan fits, and the ways out, among them an embedded model
    whose window holds the context."""
    from starqa.models import EMBEDDED

    need = f"{n:,} tokens" + (f" + {reserve:,} reserved for a question and an answer = "
                              f"{n + reserve:,} tokens" if reserve else "")
    fixes = [fix] if fix else []
    fixes.append("ingest fewer files (--exclude, a sub-folder)")
    if reserve and window - n >= MIN_ROOM:  # less room than that holds no real question
        fixes.append(f"reserve less (--reserve {window - n:,} or lower; now {reserve:,})")
    if longer := [f"--model {m.name}: {m.window:,} tokens" for m in EMBEDDED
                  if m.window >= n + reserve]:
        fixes.append(f"use a model with a longer window ({' or '.join(longer)})")
    fixes.append("pass --beyond-window to go on anyway")
    return StarqaError(f"The context is {need} > {window:,} the model was trained on, and "
                       f"{why}.", hint=", ".join(fixes[:-1]) + ", or " + fixes[-1])


def _kv_words(n: int, kv: str, kv_bytes: Callable[[str], int | None] | None,
              available: int | None, why: str | None) -> str:
    """'; KV 10.7 GB in float, held in memory' — the KV's size, its precision and why, and
    where it lives, for the plan's line."""
    per_token = kv_bytes(kv) if kv_bytes else None
    if not per_token:
        return ""
    size = n * per_token
    where = ("held in memory" if available is None or size <= available // 2 else
             "more than half the memory available: ask reads it from disk as it attends")
    return f"; KV {_gb(size)} in {kv}{f' ({why})' if why else ''}, {where}"


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.0f} MB"
