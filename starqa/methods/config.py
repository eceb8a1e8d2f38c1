"""MethodConfig, the frozen settings of one Phase 1 run (recorded in every manifest and in
the cache key), and the checks shared by every method's settings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from starqa.core.errors import StarqaError

# The command-line option behind each method-specific setting, for error messages.
OPTIONS = {"sink": "--sink-size", "heuristic": "--heuristic", "budget_frac": "--summary-budget",
           "chunk": "--chunk-size", "positions": "--positions", "passing": "--passing-size",
           "window": "--probe-window", "question": "--question", "anchor": "--anchor-size"}
MAX_DEFAULT_BLOCK = 32_768  # the paper's fixed block size for very long contexts
# The smallest --block-size a user may ask for: APB passes on b/8 of each block's keys
# through a max-pool of width 5 (4 keys at 32), Pulsar summarises blocks in chunks of 32,
# and each block costs a forward and a file of its own (--block-size 1: one per token).
MIN_BLOCK = 32


@dataclass(frozen=True)
class MethodConfig:
    name: str
    block_size: int
    anchor_size: int  # star and apb; 0 for the others
    params: dict = field(default_factory=dict)  # pulsar: sink, heuristic, ...; apb: passing, ...

    def as_dict(self) -> dict:
        return asdict(self)


def given_settings(anchor_size: int | None, params: dict | None) -> list[str]:
    """The method-specific settings given (not None), "anchor" for the anchor size, sorted."""
    given = {k for k, v in (params or {}).items() if v is not None}
    return sorted(given | ({"anchor"} if anchor_size is not None else set()))


def check_sizes(block_size: int | None, anchor_size: int | None) -> None:
    if block_size is not None and block_size < 1:
        raise StarqaError(f"--block-size must be at least 1 (got {block_size}).")
    if anchor_size is not None and anchor_size < 0:
        raise StarqaError(f"--anchor-size must be 0 or more (got {anchor_size}).")


def check_block_size(block_size: int | None, n_tokens: int) -> None:
    """A --block-size the methods can use (`MIN_BLOCK` tokens or more; None: the default);
    StarqaError with the numbers and the fix otherwise. Only what users give is checked:
    tests and eval's oracles build smaller blocks through `method_config`."""
    if block_size is not None and block_size < MIN_BLOCK:
        raise StarqaError(
            f"--block-size {block_size} is too small: a block must hold at least {MIN_BLOCK} "
            f"tokens (APB passes on an eighth of each block, Pulsar summarises blocks in "
            f"chunks of 32, and every block is a forward and a file of its own).",
            hint=f"pass --block-size {MIN_BLOCK} or more, or leave it out for the default, a "
                 f"quarter of the context (--block-size {default_block(n_tokens)} here)")


def default_block(n_tokens: int) -> int:
    """The Star paper's block: a quarter of the context, capped at 32K; rounded up to a grid
    of eight steps per octave (at most 12.5% more, still four blocks), so that a small edit
    leaves the block size, and with it every block's plan, as it was (issue #14)."""
    quarter = max(1, math.ceil(n_tokens / 4))
    step = 1 << max(0, quarter.bit_length() - 4)  # 2^(floor(log2 quarter) - 3)
    return min(-(-quarter // step) * step, MAX_DEFAULT_BLOCK)


GRID = 256  # block sizes fitted to a window are multiples of this (stable under small edits)
# Past the window, Phase 1's attention per token grows with the block (each token meets its
# anchor and its block's earlier tokens); at 4,096 it costs about what a token's matrix
# products do on a CPU, at 16K four times that (docs/methods.md, "Past the window").
PAST_WINDOW_BLOCK = 4_096


def fitted_sizes(n: int, room: int, block_size: int | None, anchor_size: int | None
                 ) -> tuple[int, int]:
    """(block, anchor) with anchor + block ≤ `room` (the window less the reserve): the
    given sizes when they fit, else the paper's anchor = block, each at most half the room
    (on a grid of `GRID`), at most `PAST_WINDOW_BLOCK` and at most the default block for `n`
    tokens."""
    if block_size is not None and anchor_size is not None:
        if block_size + anchor_size > room:
            raise StarqaError(
                f"--block-size {block_size:,} + --anchor-size {anchor_size:,} = "
                f"{block_size + anchor_size:,} tokens do not fit the {room:,} the window "
                "leaves beside the reserve: a block and its anchor must.",
                hint=f"leave both out for sizes that fit, or pass sizes that add up to "
                     f"{room:,} or less (e.g. --block-size {room // 2:,} --anchor-size "
                     f"{room - room // 2:,})")
        return block_size, anchor_size
    if block_size is not None:
        anchor = min(block_size, room - block_size)
        if anchor < 1:
            raise StarqaError(
                f"--block-size {block_size:,} leaves no room for an anchor in the {room:,} "
                "tokens the window leaves beside the reserve.",
                hint=f"pass --block-size {room // 2:,} or less, or leave it out")
        return block_size, anchor
    if anchor_size is not None:
        block = min(default_block(n), room - anchor_size, PAST_WINDOW_BLOCK)
        if block < MIN_BLOCK:
            raise StarqaError(
                f"--anchor-size {anchor_size:,} leaves blocks of {max(block, 0):,} tokens in "
                f"the {room:,} the window leaves beside the reserve.",
                hint=f"pass --anchor-size {room // 2:,} or less, or leave it out")
        return block, anchor_size
    half = max(room // 2 // GRID * GRID, min(room // 2, 2 * GRID))
    block = min(default_block(n), half, PAST_WINDOW_BLOCK)
    return block, block


def fitted_contiguous(n: int, room: int, block_size: int | None, anchor_size: int | None,
                      params: dict) -> tuple[int, int, dict]:
    """(block, anchor, params) of contiguous positions within `room` positions (the window
    less the reserve): `fitted_sizes`, and as many slots of a block's positions as fit
    beside the anchor, at least 1 (the slots star's blocks take in turn,
    `starqa.methods.star.block_positions`). `params`: the other settings, kept."""
    block, anchor = fitted_sizes(n, room, block_size, anchor_size)
    slots = max(1, (room - anchor) // block)
    return block, anchor, {**params, "positions": "contiguous", "slots": slots}


def chosen(defaults: dict, given: dict) -> dict:
    """`defaults` overridden by the settings of `given` that are set and are among them."""
    return {**defaults, **{k: v for k, v in given.items() if v is not None and k in defaults}}
