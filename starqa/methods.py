"""Method settings (frozen, recorded in every manifest) and the block plan they imply."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from starqa.errors import StarqaError

METHODS = ("star", "dense", "ring", "pulsar", "apb")
PULSAR_DEFAULTS = {"sink": 64, "heuristic": "max-idf", "budget_frac": 0.125, "chunk": 32,
                   "positions": "sparse"}
# passing None: an eighth of the block; question None: unknown at encoding time (the engine
# adds its token ids as question_ids when given)
APB_DEFAULTS = {"passing": None, "window": 64, "question": None}
# The command-line option behind each method-specific setting, for error messages.
OPTIONS = {"sink": "--sink-size", "heuristic": "--heuristic", "budget_frac": "--summary-budget",
           "chunk": "--chunk-size", "positions": "--positions", "passing": "--passing-size",
           "window": "--probe-window", "question": "--question", "anchor": "--anchor-size"}
OWNERS = {**{k: "pulsar" for k in PULSAR_DEFAULTS}, **{k: "apb" for k in APB_DEFAULTS}}
MAX_DEFAULT_BLOCK = 32_768  # the paper's fixed block size for very long contexts


@dataclass(frozen=True)
class MethodConfig:
    name: str
    block_size: int
    anchor_size: int  # star and apb; 0 for the others
    params: dict = field(default_factory=dict)  # pulsar: sink, heuristic, ...; apb: passing, ...

    def as_dict(self) -> dict:
        return asdict(self)


def method_config(name: str, n_tokens: int, block_size: int | None = None,
                  anchor_size: int | None = None, params: dict | None = None) -> MethodConfig:
    """Settings for `name` on a context of `n_tokens`, with the papers' defaults.

    star: block = a quarter of the context (capped at 32K), anchor = block.
    apb: same blocks, anchor = block/4, passing = block/8 per KV head, probe window 64.
    dense, ring: exact; blocks only split the cache into shards (one file per block), and
    ring's workers each hold a contiguous group of them.
    `params` holds the method-specific settings (keys of PULSAR_DEFAULTS / APB_DEFAULTS);
    None means not given. A setting given for another method is an error.
    """
    if name not in METHODS:
        raise StarqaError(f"Unknown method {name!r}.", hint=f"choose one of: {', '.join(METHODS)}")
    if block_size is not None and block_size < 1:
        raise StarqaError(f"--block-size must be at least 1 (got {block_size}).")
    if anchor_size is not None and anchor_size < 0:
        raise StarqaError(f"--anchor-size must be 0 or more (got {anchor_size}).")
    for key in given_settings(anchor_size, params):
        if name not in owners(key):
            raise StarqaError(f"{OPTIONS.get(key, key)} only applies to --method "
                              f"{' or '.join(owners(key))}.")
    block = block_size or min(max(1, math.ceil(n_tokens / 4)), MAX_DEFAULT_BLOCK)
    if name in ("dense", "ring"):
        return MethodConfig(name, block, 0)
    if name == "pulsar":
        return MethodConfig("pulsar", block, 0, _pulsar_params(params or {}))
    if name == "apb":
        from starqa.apb import default_anchor

        anchor = default_anchor(block) if anchor_size is None else anchor_size
        return MethodConfig("apb", block, anchor, _apb_params(params or {}, block))
    return MethodConfig("star", block, block if anchor_size is None else anchor_size)


def given_settings(anchor_size: int | None, params: dict | None) -> list[str]:
    """The method-specific settings given (not None), "anchor" for the anchor size, sorted."""
    given = {k for k, v in (params or {}).items() if v is not None}
    return sorted(given | ({"anchor"} if anchor_size is not None else set()))


def owners(setting: str) -> tuple[str, ...]:
    """The methods a setting of `given_settings` applies to."""
    if setting == "anchor":
        return ("star", "apb")
    return (OWNERS[setting],) if setting in OWNERS else ()


def _apb_params(given: dict, block: int) -> dict:
    chosen = {**APB_DEFAULTS, **{k: v for k, v in given.items()
                                 if v is not None and k in APB_DEFAULTS}}
    if chosen["passing"] is None:
        chosen["passing"] = max(1, block // 8)
    if chosen["question"] is not None and not chosen["question"].strip():
        raise StarqaError("--question is empty.")
    if chosen["passing"] < 0 or chosen["window"] < 1:
        raise StarqaError(f"--passing-size must be 0 or more and --probe-window at least 1 "
                          f"(got {chosen['passing']} and {chosen['window']}).")
    return chosen


def _pulsar_params(given: dict) -> dict:
    from starqa.pulsar import HEURISTICS, POSITIONS

    chosen = {**PULSAR_DEFAULTS, **{k: v for k, v in given.items()
                                    if v is not None and k in PULSAR_DEFAULTS}}
    if chosen["heuristic"] not in HEURISTICS:
        raise StarqaError(f"Unknown --heuristic {chosen['heuristic']!r}.",
                          hint=f"choose one of: {', '.join(HEURISTICS)}")
    if chosen["positions"] not in POSITIONS:
        raise StarqaError(f"Unknown --positions {chosen['positions']!r}.",
                          hint=f"choose one of: {', '.join(POSITIONS)}")
    if not 0 < chosen["budget_frac"] <= 1:
        raise StarqaError(f"--summary-budget must be in (0, 1] (got {chosen['budget_frac']}).")
    if chosen["chunk"] < 1 or chosen["sink"] < 0:
        raise StarqaError("--chunk-size must be at least 1 and --sink-size at least 0.")
    return chosen


def plan_blocks(n_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) token ranges of `block_size` (the last may be shorter)."""
    return [(s, min(s + block_size, n_tokens)) for s in range(0, n_tokens, block_size)]
